"""torchrun --nproc_per_node 2: a LoRA merged at load into a wan-s2v DiT placed FSDP2-sharded merges each rank's rows.

argv: a tiny wan-s2v model directory, its LoRA (PEFT layout), the LoRA's rank and scale, the golden folder (the
forward's inputs). For each placement (lazy float32 as stored; lazy bfloat16; lazy float32 with the shards
offloaded to the host; eager float32, sharded after loading) every rank checks, against the whole weights merged
by merge_lora in one process:
- each target's local shard is, bit for bit, its rows of the merged weight, and FSDP2's padding rows stay zero;
- every other parameter is its rows of the base weight (only the targets change);
- a forward (the golden case "b", all-gathered) equals the merged model's bit for bit, and differs from the base's.
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
from avatar_cli.families.wan_s2v.lora import LoraMerge, merge_lora, read_lora
from avatar_cli.modules.loading import TensorIndex, _fsdp_params
from avatar_cli.modules.module import Module, lazy_module
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.distributed import init_distributed
from avatar_cli.runtime.offload import HostTransfer
from avatar_cli.runtime.placement import place
from common import exit_now

PLAN = ParallelPlan(sharded=("dit",), sp_heads=WanDiTParams.tiny().num_heads)


def forward(model: torch.nn.Module, cases: dict) -> torch.Tensor:
    """The golden case "b" (a later clip, with motion). -> (16, F, h, w) float32."""
    return model(cases["b.x"], cases["b.t"], cases["b.context"], cases["b.ref"], cases["b.motion"], cases["b.cond"],
                 cases["b.audio"])


def eager(state: dict, dtype: torch.dtype) -> WanS2VDiT:
    m = WanS2VDiT(WanDiTParams.tiny()).eval()
    m.load_state_dict(state, strict=True)
    return m.to(dtype)


@torch.no_grad()  # not inference_mode: FSDP2 fails under it in torch 2.14
def main() -> int:
    model_dir, lora_path, rank, scale, golden = (Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]),
                                                 float(sys.argv[4]), Path(sys.argv[5]))
    d = init_distributed("cpu")
    assert d.world_size == 2, d
    index = TensorIndex.from_safetensors(model_dir / "diffusion_pytorch_model.safetensors.index.json")
    state = {}
    for shard in sorted(model_dir.glob("diffusion_pytorch_model-*.safetensors")):
        state.update(load_file(shard))
    cases = load_file(golden / "dit_cases.safetensors")
    lora = read_lora(lora_path, rank)
    results: dict[str, object] = {}
    ok = True
    for label, dtype, offload, lazy in (("float32", torch.float32, False, True),
                                        ("bfloat16", torch.bfloat16, False, True),
                                        ("float32/offload", torch.float32, True, True),
                                        ("float32/eager", torch.float32, False, False)):
        base = eager(state, dtype)
        merged = eager(state, dtype)
        merge_lora(merged, lora, scale)  # the whole weights, in one process: what the rows must equal
        want = merged.state_dict()
        if lazy:
            module = lazy_module("dit", WanS2VDiT, WanDiTParams.tiny(), index)
        else:
            module = Module("dit", eager(state, torch.float32), "eager")
        module.after_load = LoraMerge(lora, scale)
        extra = dict(transfer=HostTransfer(), free_bytes=1, offload="model") if offload else {}
        place({"dit": module}, Runtime(torch.device("cpu"), dtype), d, plan=PLAN, **extra)
        ok &= module.after_load is None  # run, and only once
        fsdp = _fsdp_params(module.model)
        rows_equal = padding_zero = merged_rows = 0
        for name, p in module.model.named_parameters():
            ok &= isinstance(p, DTensor)
            w = want[name]
            per_rank = -(-w.shape[0] // d.world_size)  # torch.chunk's rows per rank, as FSDP2 splits dim 0
            expect = w[d.rank * per_rank:(d.rank + 1) * per_rank]
            local = p.to_local()
            rows_equal += local.dtype == dtype and local.shape == expect.shape and torch.equal(local, expect)
            padded = fsdp[id(p)]._sharded_param_data.view(fsdp[id(p)].padded_sharded_param_size)
            padding_zero += bool((padded[local.shape[0]:] == 0).all())
            merged_rows += name.removesuffix(".weight") in lora.modules and local.shape[0] > 0
        params = len(want)
        ok &= rows_equal == padding_zero == params
        got, ref = forward(module.model, cases), forward(merged, cases)
        diff = ((got - ref).abs().max() / ref.abs().max()).item()
        lora_effect = ((forward(base, cases) - got).abs().max() / got.abs().max()).item()
        ok &= diff == 0.0 and lora_effect > 1e-2  # the same merged bits gathered; the LoRA changes the output
        results[label] = {"rows_equal": rows_equal, "params": params, "padding_zero": padding_zero,
                          "targets_with_rows": merged_rows, "forward_rel_diff": diff, "lora_effect": lora_effect}
    ranks: list[dict] = [{}] * d.world_size
    torch.distributed.all_gather_object(ranks, {"ok": ok, **results})
    if d.is_main:
        print(json.dumps({"ok": all(r["ok"] for r in ranks), "targets": len(lora.modules), "ranks": ranks}),
              flush=True)
    d.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_now(main())
