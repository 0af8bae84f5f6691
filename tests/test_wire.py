"""The rank-to-rank wire (runtime/wire.py) on two gloo ranks on 127.0.0.1: tensors of several dtypes and shapes
arrive exact under a bound on sends in flight; a tensor that never comes ends the wait at the group's timeout, and
one other than the one expected is an error naming both."""

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from avatar_cli.runtime.wire import MAX_DIMS, Wire, WireError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "latents": torch.randn(3, 16, 4, 5, generator=g),  # float32
        "ring.k": torch.randn(2, 1, 3, 2, 4, generator=g).to(torch.bfloat16),
        "half": torch.randn(7, generator=g).to(torch.float16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),  # 0-d
        "chunk": torch.tensor([4, 60, 12, -1, 2**40], dtype=torch.int64),
        "counts": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "bytes": torch.tensor(list(b"kind"), dtype=torch.uint8),
        "empty": torch.empty(0, 3),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous: sent as its values
    }


def _ranks(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                           timeout=timedelta(seconds=30))
    quick = Wire.gloo(timeout_s=1.0)  # every rank makes it, in the same order
    wire = Wire(None, pending=1)
    sent = _tensors()
    try:
        if rank == 0:
            for block in range(3):  # each tensor three times, one block each, at most one block in flight
                for name, t in sent.items():
                    wire.send(1, name, t + block if t.dtype != torch.uint8 else t)
                wire.end_block()
            wire.flush()
            wire.send(1, "sink_frame", torch.empty(0))  # a header alone: its receiver stops at the name
            wire.flush()
        else:
            for block in range(3):
                for name, t in sent.items():
                    got = wire.recv(0, name)
                    want = t + block if t.dtype != torch.uint8 else t
                    assert got.dtype == want.dtype and got.shape == want.shape, name
                    assert torch.equal(got, want), name
            with pytest.raises(WireError, match=r"expected 'latents' from rank 0, got 'sink_frame'"):
                wire.recv(0, "latents")
            with pytest.raises(WireError, match=r"waiting for 'never' from rank 0: .*Timed out"):
                quick.recv(0, "never")  # rank 0 sends nothing on this group
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_exchange_named_tensors_exactly():
    mp.spawn(_ranks, args=(_free_port(),), nprocs=2, join=True)  # a rank's failed assert fails the test


def test_what_a_wire_cannot_carry_is_refused_before_anything_is_sent():
    wire = Wire(None)  # no process group: each refusal comes before the first send
    with pytest.raises(ValueError, match="complex64; a wire carries torch.float32"):
        wire.send(1, "z", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=f"at most {MAX_DIMS}"):
        wire.send(1, "z", torch.zeros([1] * (MAX_DIMS + 1)))
    with pytest.raises(ValueError, match="is over 48 bytes"):
        wire.send(1, "x" * 49, torch.zeros(1))
