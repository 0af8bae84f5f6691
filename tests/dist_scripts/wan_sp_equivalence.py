"""torchrun --nproc_per_node 2: the wan-s2v DiT under Ulysses sequence parallelism (plain, then FSDP2-sharded) must
equal the plain DiT on one rank.

Weights: the golden fixture's tiny DiT (already re-randomised, so the zero-initialised head, injector outputs, AdaIN
and token-type embedding all carry weight). Prints one JSON line on rank 0 with the max abs differences relative to
the largest |output|, the rows each rank's blocks saw, and the checks; exits non-zero on any mismatch.
"""

import copy
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT, s2v_positions
from avatar_cli.families.wan_s2v.parallel import SequenceParallelWanDiT
from avatar_cli.runtime.distributed import init_distributed
from avatar_cli.runtime.parallelize import parallelize_model, reshard_stage
from common import exit_now

GOLDEN = Path(__file__).parents[1] / "golden" / "wan_s2v"
TOL = 1e-5  # max abs diff / max abs, the bound the golden tests hold the single-rank DiT to


def clip(g: torch.Generator, frames: int, lat_h: int, lat_w: int, with_motion: bool) -> tuple:
    """Random inputs of one clip, identical on every rank: x, t, context, ref, motion, cond, audio."""
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return (r(16, frames, lat_h, lat_w), 700, r(5, 32), r(16, 1, lat_h, lat_w),
            r(16, 19, lat_h, lat_w) if with_motion else None, r(16, frames, lat_h, lat_w), r(1, 25, 32, 4 * frames))


def cases() -> dict[str, tuple]:
    c = load_file(GOLDEN / "dit_cases.safetensors")
    g = torch.Generator().manual_seed(3)

    def golden(k: str) -> tuple:
        return (c[f"{k}.x"], c[f"{k}.t"], c[f"{k}.context"], c[f"{k}.ref"], None if c[f"{k}.drop_motion"] else
                c[f"{k}.motion"], c[f"{k}.cond"], c[f"{k}.audio"])

    # a: clip 0, N = 384 + 96 = 480, rank 1 starts inside latent frame 2; b: with motion, N = 624, rank 1 starts
    # inside frame 3; odd: 4 frames of 3x5 tokens, N = 75, rank 1 holds one padding token and partial frames at
    # both ends; one_frame: 1 frame with motion, N = 56, rank 1 holds no noisy token at all.
    return {"a": golden("a"), "b": golden("b"), "odd": clip(g, 4, 6, 10, False), "one_frame": clip(g, 1, 8, 8, True)}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@torch.no_grad()  # not inference_mode: FSDP2 fails under it in torch 2.14
def main() -> int:
    d = init_distributed("cpu")
    assert d.world_size == 2, d
    p = WanDiTParams.tiny()
    plain = WanS2VDiT(p).eval()
    plain.load_state_dict(load_file(GOLDEN / "dit_tiny_weights.safetensors"), strict=True)
    inputs = cases()
    want = {k: plain(*a) for k, a in inputs.items()}  # (16, F, h, w) each
    results: dict = {f"{k}/out_absmax": w.abs().max().item() for k, w in want.items()}
    results["tokens"] = {k: s2v_positions(p, a[0].shape[1], a[0].shape[2], a[0].shape[3], a[4] is not None).shape[0]
                         for k, a in inputs.items()}
    ok = True

    for mode in ("plain", "per_block", "per_stage"):
        model = copy.deepcopy(plain)
        if mode != "plain":
            model = parallelize_model(model, d.mesh, reshard=mode)
        sp = SequenceParallelWanDiT(model, d.group)
        rows: list[int] = []  # the sequence rows block 0 sees on this rank
        hook = sp.dit.blocks[0].register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[1]))
        for k, args in inputs.items():
            for step in range(2 if mode == "per_stage" else 1):  # per_stage: the 2nd step reuses gathered blocks
                got = sp(*args)
                diff = rel(got, want[k]) if got.shape == want[k].shape else float("inf")
                results[f"{mode}/{k}/step{step}"] = diff
                ok &= diff < TOL
                same = got.clone()
                dist.broadcast(same, 0, group=d.group)
                ok &= torch.equal(same, got)  # every rank returns the same velocity
            reshard_stage(sp.dit)
        hook.remove()
        per_rank = [None] * d.world_size
        dist.all_gather_object(per_rank, rows, group=d.group)
        results[f"{mode}/rows"] = per_rank

    # A head count the degree does not divide fails at construction, before any collective: rank 0 alone tries it
    # (a collective there would meet rank 1's barrier below instead, and hang or fail).
    results["heads_error"] = None
    if d.rank == 0:
        bad = WanS2VDiT(dataclasses.replace(p, num_heads=1)).eval()
        try:
            SequenceParallelWanDiT(bad, d.group)
        except ValueError as e:
            results["heads_error"] = str(e)
        ok &= results["heads_error"] is not None and "heads=1" in results["heads_error"]
        ok &= all(b.self_attn.attn_op is torch.nn.functional.scaled_dot_product_attention for b in bad.blocks)
    d.barrier()

    oks = [None] * d.world_size
    dist.all_gather_object(oks, ok, group=d.group)
    if d.is_main:
        print(json.dumps({"ok": all(oks), **results}), flush=True)
    d.destroy()
    return 0 if all(oks) else 1


if __name__ == "__main__":
    exit_now(main())
