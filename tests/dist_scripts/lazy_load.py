"""torchrun --nproc_per_node 2: a lazy wan-s2v DiT placed FSDP2-sharded must equal the eager load.

argv: the sharded checkpoint folder (the tiny golden weights in the release's 4-shard layout), then the golden
folder (the same weights in one file, and the forward's inputs). For each placement (float32 as stored;
bfloat16; float32 with the shards offloaded to the host) every rank checks that each parameter's local shard is,
bit for bit, its rows of the full tensor (FSDP2's torch.chunk split: rank 1 of a 1- or 3-row tensor holds 0 or 1
rows), and that a forward equals the eager model's.
Prints one JSON line on rank 0; exits non-zero on any mismatch.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from avatar_cli.families.base import ParallelPlan
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.modules.loading import TensorIndex
from avatar_cli.modules.module import lazy_module
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.distributed import init_distributed
from avatar_cli.runtime.offload import HostTransfer
from avatar_cli.runtime.placement import place
from common import exit_now

# No sequence parallel here; the head count only has to allow the degree.
PLAN = ParallelPlan(sharded=("dit",), sp_heads=WanDiTParams.tiny().num_heads)


def forward(model: torch.nn.Module, cases: dict) -> torch.Tensor:
    """The golden case "b" (a later clip, with motion). -> (16, F, h, w) float32."""
    return model(cases["b.x"], cases["b.t"], cases["b.context"], cases["b.ref"], cases["b.motion"], cases["b.cond"],
                 cases["b.audio"])


@torch.no_grad()  # not inference_mode: FSDP2 fails under it in torch 2.14
def main() -> int:
    folder, golden = sys.argv[1], Path(sys.argv[2])
    d = init_distributed("cpu")
    assert d.world_size == 2, d
    full = load_file(golden / "dit_tiny_weights.safetensors")
    cases = load_file(golden / "dit_cases.safetensors")
    results: dict[str, object] = {}
    ok = True
    for label, dtype, offload in (("float32", torch.float32, False), ("bfloat16", torch.bfloat16, False),
                                  ("float32/offload", torch.float32, True)):
        module = lazy_module("dit", WanS2VDiT, WanDiTParams.tiny(), TensorIndex.from_safetensors(folder))
        extra = dict(transfer=HostTransfer(), free_bytes=1, offload="model") if offload else {}
        place({"dit": module}, Runtime(torch.device("cpu"), dtype), d, plan=PLAN, **extra)
        same = uneven = empty = 0
        params = dict(module.model.named_parameters())
        for name, want in full.items():
            p = params[name]
            ok &= isinstance(p, DTensor)
            rows = -(-want.shape[0] // d.world_size)  # torch.chunk's rows per rank
            expect = want.to(dtype)[d.rank * rows:(d.rank + 1) * rows]
            local = p.to_local()
            same += local.dtype == dtype and local.shape == expect.shape and torch.equal(local, expect)
            uneven += want.shape[0] % d.world_size != 0
            empty += local.shape[0] == 0
        ok &= same == len(full) and len(params) == len(full)
        eager = WanS2VDiT(WanDiTParams.tiny()).eval()
        eager.load_state_dict(full, strict=True)
        want = forward(eager.to(dtype), cases)
        diff = ((forward(module.model, cases) - want).abs().max() / want.abs().max()).item()
        ok &= diff == 0.0  # the same weights gathered, the same ops: the same bits
        results[label] = {"equal_shards": same, "tensors": len(full), "uneven": uneven, "empty_on_rank": empty,
                          "forward_rel_diff": diff}
    # Every rank's figures: rank 1 holds the empty shards of the 1-row tensors.
    ranks: list[dict] = [{}] * d.world_size
    torch.distributed.all_gather_object(ranks, {"ok": ok, **results})
    if d.is_main:
        print(json.dumps({"ok": all(r["ok"] for r in ranks), "ranks": ranks}), flush=True)
    d.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_now(main())
