"""torchrun --nproc_per_node 2: LiveAvatar's streaming forward under Ulysses sequence parallelism
(live_parallel.SequenceParallelStream) must equal causal.py on one rank.

Inputs and weights: the LiveAvatar goldens' (tests/golden/liveavatar, the tiny DiT: 2 heads, so 1 head a rank; an
8x16 latent, P = 32 tokens a frame, a block's 96 rows cut at row 48, inside latent frame 1). The stream is 2 clips
of 4 blocks x 4 steps with the sink prefilled at block 0 and refreshed at block 4 with block 0's first latent, as
live.py does (and as the goldens were recorded: the 2-rank latents are also held to their code's). Phase 1, at
the same time: rank 0 streams through causal.py alone, rank 1 through the class over a group of itself (must be
bit-identical). Phase 2: both ranks stream through the class over the 2-rank group.
Prints one JSON line on rank 0; exits non-zero on any mismatch.
"""

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from avatar_cli.families.wan_s2v import causal
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.live_parallel import SequenceParallelStream, shard_caches
from avatar_cli.runtime.distributed import init_distributed
from common import exit_now

GOLDEN = Path(__file__).parents[1] / "golden"
BLOCKS, PER_CLIP = 8, 4
TOL = 1e-5  # max abs diff / max abs, the bound causal.py holds against their code


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def stream(g: dict, empty, prefill, block) -> tuple[list[torch.Tensor], causal.CausalCaches]:
    """8 blocks through (empty caches, prefill_sink, stream_block) -> each block's latents, the caches at the end."""
    H, W = g["input.ref"].shape[-2:]
    caches, ctx, motion = empty(H, W), g["input.context"], g["input.motion"]
    out = []
    for b in range(BLOCKS):
        clip, k = divmod(b, PER_CLIP)
        if b == 0:
            prefill(caches, g["input.ref"], motion, ctx)
        elif b == PER_CLIP:
            prefill(caches, out[0][:, 0:1], motion, ctx)  # the rolled sink frame: block 0's first latent
        key = f"clip{clip}.block{k}"
        noise = g[f"clip{clip}.noise"][:, 3 * k:3 * k + 3]  # (16, 3, h, w)
        out.append(block(caches, noise, b, ctx, g[f"{key}.audio"], g[f"{key}.sink_offset"].tolist()))
    return out, caches


@torch.no_grad()
def main() -> int:
    d = init_distributed("cpu")
    assert d.world_size == 2, d
    config = json.loads((GOLDEN / "wan_s2v" / "dit_tiny_config.json").read_text())
    model = WanS2VDiT(WanDiTParams.from_config(config)).eval()
    model.load_state_dict(load_file(GOLDEN / "wan_s2v" / "dit_tiny_weights.safetensors"), strict=True)
    g = load_file(GOLDEN / "liveavatar" / "stream_tiny.safetensors")
    p, ok, res = model.params, True, {}
    alone = [dist.new_group([r]) for r in range(2)]  # every rank takes part in creating each group

    # Phase 1: rank 0 the reference (causal.py), rank 1 the class over a 1-rank group.
    if d.rank == 0:
        want, want_caches = stream(g, lambda H, W: causal.CausalCaches.empty(p, H, W),
                                   lambda c, *a: causal.prefill_sink(model, c, *a),
                                   lambda c, *a: causal.stream_block(model, c, *a))
    else:
        one = SequenceParallelStream(model, alone[1])
        got1, got1_caches = stream(g, one.empty_caches, one.prefill_sink, one.stream_block)
        want = [torch.empty_like(z) for z in got1]
        want_caches = causal.CausalCaches(**{n: torch.empty_like(t) for n, t in got1_caches.tensors().items()})
    for t in [*want, *want_caches.tensors().values()]:
        dist.broadcast(t, 0, group=d.group)
    if d.rank == 1:
        res["one_rank_bit_equal"] = all(torch.equal(a, b) for a, b in zip(got1, want)) and all(
            torch.equal(a, b) for a, b in zip(got1_caches.tensors().values(), want_caches.tensors().values()))
        ok &= res["one_rank_bit_equal"]

    # Phase 2: 2 ranks.
    sp = SequenceParallelStream(model, d.group)
    rows: list[int] = []  # the rows layer 0's FFN sees on this rank
    hook = model.blocks[0].ffn.register_forward_pre_hook(lambda _m, a: rows.append(a[0].shape[1]))
    got, caches = stream(g, sp.empty_caches, sp.prefill_sink, sp.stream_block)
    hook.remove()
    res["latents_rel"] = [rel(a, b) for a, b in zip(got, want)]
    ok &= max(res["latents_rel"]) < TOL
    res["latents_absmax"] = min(z.abs().max().item() for z in want)
    # and against THEIR CausalWanModel_S2V's recording (the bound test_wan_causal.py holds causal.py to)
    res["golden_rel"] = max(rel(z, g[f"clip{b // PER_CLIP}.block{b % PER_CLIP}.latents"]) for b, z in enumerate(got))
    ok &= res["golden_rel"] < TOL
    res["cache_heads"] = caches.k.shape[3]
    ok &= caches.k.shape[3] == p.num_heads // 2 and caches.sink_k.shape[2] == p.num_heads // 2
    for z in got:  # every rank returns the same latents
        same = z.clone()
        dist.broadcast(same, 0, group=d.group)
        ok &= torch.equal(same, z)
    res["rows"] = sorted(set(rows))  # 48 (half a block's 96) and 40 (half the sink's 80)

    whole = sp.gather_caches(caches)  # on rank 0
    if d.rank == 0:
        res["caches_rel"] = {n: rel(a, b) for (n, a), b in zip(whole.tensors().items(), want_caches.tensors().values())}
        ok &= max(res["caches_rel"].values()) < TOL and bool((whole.k.abs().amax(dim=(3, 4)) > 0).all())
    else:
        ok &= whole is None
        whole = causal.CausalCaches(**{n: torch.empty_like(t) for n, t in want_caches.tensors().items()})
    for t in whole.tensors().values():
        dist.broadcast(t, 0, group=d.group)
    # A resumed render cuts the saved whole caches into its heads: exactly what this rank holds.
    res["reshard_equal"] = all(torch.equal(a, b) for a, b in zip(sp.shard_caches(whole).tensors().values(),
                                                                   caches.tensors().values()))
    ok &= res["reshard_equal"]
    ok &= shard_caches(whole, d.rank, 2).k.data_ptr() != whole.k.data_ptr()

    # A head count the degree does not divide fails at construction, before any collective: rank 0 alone tries it.
    res["heads_error"] = None
    if d.rank == 0:
        try:
            SequenceParallelStream(WanS2VDiT(dataclasses.replace(p, num_heads=1)), d.group)
        except ValueError as e:
            res["heads_error"] = str(e)
        ok &= res["heads_error"] is not None
    d.barrier()

    oks = [None] * d.world_size
    per_rank = [None] * d.world_size
    dist.all_gather_object(oks, ok, group=d.group)
    dist.all_gather_object(per_rank, res, group=d.group)
    if d.is_main:
        print(json.dumps({"ok": all(oks), **per_rank[1], **per_rank[0]}), flush=True)
    d.destroy()
    return 0 if all(oks) else 1


if __name__ == "__main__":
    exit_now(main())
