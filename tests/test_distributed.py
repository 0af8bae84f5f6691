"""Multi-rank runtime on CPU (gloo): 2 ranks under torchrun equal 1 rank; a dead or stuck rank ends the others."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from avatar_cli.families.mini.dit import DiT
from avatar_cli.families.mini.config import SIZES
from avatar_cli.runtime.distributed import Dist, init_distributed
from avatar_cli.runtime.placement import model_sizes, resident_bytes
from avatar_cli.families.base import check_degree
from tests.conftest import torchrun

SCRIPTS = Path(__file__).parent / "dist_scripts"
TORCHRUN = ["--standalone", "--nproc_per_node", "2"]
HANG_GUARD_S = 180.0  # a rank that hangs sleeps 600 s: past this the test fails (no speed bound)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(SCRIPTS), **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_fsdp_and_sequence_parallel_equal_one_rank():
    r = torchrun(*TORCHRUN, str(SCRIPTS / "sp_equivalence.py"), env=_env(), timeout=120)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(lines[-1])
    assert res["ok"] is True
    diffs = {k: v for k, v in res.items() if "/step" in k}
    assert len(diffs) == 17 and max(diffs.values()) < 3e-6, diffs  # relative to max |output|
    assert res["L5/out_absmax"] > 1.0  # the outputs are not trivially zero
    assert 0.45 < res["per_block/local_param_fraction"] < 0.55  # each rank holds about half
    assert res["heads_error"] == 1.0


def test_two_ranks_offload_shards_to_host_and_render_the_same_video(job_dir: Path):
    r = torchrun(*TORCHRUN, str(SCRIPTS / "offload_render.py"), str(job_dir / "job.yaml"), env=_env(), timeout=180)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(lines[-1])
    assert res["ok"] is True and res["same_video"] is True
    assert res["fsdp_offload"] == {"dit": True, "text": True}  # FSDP2 keeps the transformers' shards on the host
    assert res["offloaders"] == ["audio", "sr", "vae"] and res["live_bytes"] == 0 and res["loads"] > 5


def test_resident_bytes_per_rank_follow_the_reshard_policy():
    dit = DiT(SIZES["tiny"].dit)
    total, block, blocks = (sum(p.nbytes for p in m.parameters()) for m in (dit, dit.blocks[0], dit.blocks))
    size = model_sizes(dit)
    assert (size.total, size.block, size.root) == (total, block, total - blocks)
    # per_block: the shard, the root (FSDP2 keeps it gathered) and two gathered blocks
    assert resident_bytes(size, 4, "per_block") == total // 4 + (total - blocks) + 2 * block
    assert resident_bytes(size, 4, "per_stage") == total // 4 + total


def stopped_in_the_peers_chunk(stdout: str) -> bool:
    """Rank 0 finished chunk 1 (its peer then joined chunk 2's collectives), perhaps chunk 2, never chunk 3, where
    its peer died or hung."""
    # Not anchored to lines: two ranks print to one pipe, so one rank's line can land inside the other's.
    done = [int(m) for m in re.findall(r"rank 0: chunk (\d+) done", stdout)]
    return done in ([0, 1], [0, 1, 2])


def test_killed_rank_ends_the_other_under_torchrun():
    r = torchrun(*TORCHRUN, str(SCRIPTS / "kill_rank.py"), "die", env=_env(), timeout=HANG_GUARD_S + 30)
    assert r.returncode != 0
    assert "rank 1: die at chunk 3" in r.stdout
    assert "unreachable" not in r.stdout
    assert stopped_in_the_peers_chunk(r.stdout), r.stdout[-2000:]


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_surviving_rank_exits_nonzero_on_its_own(mode):
    """No torchrun agent to clean up: rank 0 must fail by itself (peer reset, or the collective timeout)."""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "kill_rank.py"), mode],
                              env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(r),
                                       LOCAL_RANK=str(r), AVATAR_DIST_TIMEOUT_S="5"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=HANG_GUARD_S)  # a hang fails here
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[0].returncode != 0, err[-2000:]
    assert stopped_in_the_peers_chunk(out), out[-2000:]
    # die: gloo sees the peer's socket close; hang: only our collective timeout can end it.
    expected = ("Connection", "Timed out") if mode == "die" else ("Timed out",)
    assert any(e in err for e in expected), err[-2000:]


def test_without_torchrun_there_are_no_distributed_calls(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    d = init_distributed("cpu")
    assert d == Dist() and d.is_main and not d.enabled and d.group is None
    assert not dist.is_initialized()
    assert d.broadcast_object({"frames": 7}) == {"frames": 7}
    assert d.agree(7, "frames") == 7
    d.barrier()
    d.destroy()


def test_torchrun_with_one_process_stays_single(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not init_distributed("cpu").enabled
    assert not dist.is_initialized()


def test_heads_not_divisible_by_degree_is_a_clear_error():
    with pytest.raises(ValueError, match=r"dit.heads=6 is not divisible by the degree 4"):
        check_degree(6, 4)
    check_degree(6, 3)


def test_default_attention_op_is_sdpa_and_frame_offset_zero_is_unchanged():
    torch.manual_seed(0)
    dit = DiT(SIZES["tiny"].dit).eval()
    assert all(b.attn.attn_op is F.scaled_dot_product_attention for b in dit.blocks)
    n_ctx, frames = 3, 2
    cos0, _ = dit.rope(n_ctx, frames, torch.device("cpu"))
    cos1, _ = dit.rope(n_ctx, frames, torch.device("cpu"), frame_offset=1)
    P = SIZES["tiny"].dit.tokens_per_frame
    # Frame 1 of the unshifted table is frame 0 of the table shifted by one.
    assert torch.equal(cos0[n_ctx + P: n_ctx + 2 * P], cos1[n_ctx: n_ctx + P])
    assert not torch.equal(cos0, cos1)


def test_launcher_exit_code_is_the_cause_not_the_collateral():
    from avatar_cli.launch import exit_code, worker_threads

    assert exit_code({}) == 0
    assert exit_code({0: 2, 1: 2, 2: -15}) == 2  # bad input seen by every rank; one was SIGTERMed first
    assert exit_code({0: 143, 1: 1}) == 1  # rank 1 raised; rank 0 was ended by the launcher
    assert exit_code({0: 143, 1: -9}) == 1  # rank 1 killed outright: a failed render
    assert exit_code({1: 2, 0: 1}) == 1  # rank 0's own code wins: it is what the user was told
    assert (worker_threads(2, cpus=16), worker_threads(8, cpus=2)) == (8, 1)
