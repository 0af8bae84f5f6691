"""Ulysses sequence parallelism for LiveAvatar's block-causal streaming forward (causal.py): W ranks split each
block's work, every rank holding the whole DiT (replicated, not FSDP-sharded: every rank computes with every
block's weights, on its own rows) and 1/W of every cache.

Layout, per forward (causal.py's `exchange` argument; this module provides the exchange, `UlyssesExchange`):
- Rows. The block's L = 3·P noisy tokens (P per latent frame) are padded with zero rows to W·n, n = ceil(L / W),
  and rank r computes rows [r·n, (r + 1)·n): the per-frame modulation, cross-attention, FFN, audio injection
  (dit.py's `inject`: rows that start or end inside a latent frame are injected as a partial frame) and the head.
  The head outputs (prod(patch)·C = 64 channels a token) are all-gathered, so every rank returns the whole
  (16, 3, h, w) velocity and runs the same Euler update on it.
- Heads. Self-attention trades rows for heads (all-to-all): q, k, v (1, H, n, Dh) -> (1, H/W, L, Dh). Rank r
  attends with heads [r·H/W, (r + 1)·H/W) of every token against its heads' ring and sink, writes the block's
  keys and values into its heads' ring, and trades back. Padding rows are trimmed before the attention, so they are
  never keys nor written to a ring.
- Caches. Each rank's rings and sink hold its H/W heads only (`SequenceParallelStream.empty_caches`): the rings'
  memory divides by W. `gather_caches` assembles whole caches on one rank (a resume point saves whole caches, so a
  checkpoint does not depend on W); `shard_caches` cuts whole caches into a rank's heads (a resumed render).
- Sink prefill. Split the same way: rank r runs rows [r·n', (r + 1)·n') of the N' sink tokens and keeps its heads'
  un-roped keys and values.

Everything but the two all-to-alls per layer and the head's gather is per row, and the attention of one head sees
exactly what the one-rank forward's does (same keys, same order), so W ranks equal one rank up to float reduction
order, and a one-rank group through this class equals causal.py bit for bit (its collectives only copy).

Cost at full size (Wan2.2-S2V-14B: 40 layers, 40 heads x 128, D 5120; 704x384: P = 1056, L = 3168, sink 2640
tokens; bf16; W = 8; `rank_costs` computes these, tests/test_wan_live_parallel.py checks them):
- per rank, the 4 rings 5.19 GB (41.52 GB / 8), the sink 0.27 GB (2.16 GB / 8), beside the replicated weights
  (32.6 GB bf16, 16.65 GB FP8);
- per block-forward, a rank sends 4 x 40 x 396 rows x 5120 x 2 B = 649 MB through the all-to-alls (q, k, v out, the
  attention back: 16.2 MB a layer, 7/8 of it to other ranks: 568 MB over the links), and 811 kB of head outputs
  (all-gathered: 3168 x 64 x 4 B);
- activations per block-forward, per rank, counted on meta with a fused attention (the test): peak 143 MB (one
  rank alone: 1.09 GB). The largest: the rows' modulation 396 x 6 x 5120 fp32 = 48.7 MB, keys and values
  [ring | roped sink] 5 heads x 15,312 x 128 bf16 = 19.6 MB each, a layer's all-to-all'd q, k, v 12.2 MB. Not
  counted: a 629 MB fp32 copy of time_projection's weight that linear_f32 makes at every forward while the weight
  is bf16 (whatever W), and the score matrix of a non-fused attention (5 x 3168 x 15,312 fp32 = 970 MB);
- the sink prefill (once per job, again at block 4) runs 2640 / 8 = 330 rows a rank: 1/8 of its 75.4 TFLOP
  (bench/live_budget.py), ~24 ms at 40 % of 989 TFLOP/s, and its all-to-alls move 4 x 40 x 330 x 5120 x 2 B =
  541 MB a rank.
"""

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from avatar_cli.families.base import check_degree
from avatar_cli.families.wan_s2v import causal
from avatar_cli.families.wan_s2v.causal import STEPS, CausalCaches, frame_tokens, sink_tokens
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT


class UlyssesExchange:
    """causal.HeadExchange over a process group: rows <-> heads by all_to_all_single, head outputs by all_gather.
    Inference only: plain collectives, no autograd."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def to_heads(self, qkv: torch.Tensor, tokens: int) -> torch.Tensor:
        """(S, 1, H, n, Dh) this rank's rows, all heads -> (S, 1, H/W, tokens, Dh) every real row, this rank's
        heads. Slot w of the send buffer goes to rank w."""
        W, (S, B, H, n, Dh) = self.world, qkv.shape
        send = qkv.reshape(S, B, W, H // W, n, Dh).permute(2, 0, 1, 3, 4, 5).contiguous()  # (W, S, B, H/W, n, Dh)
        recv = torch.empty_like(send)  # slot w = rank w's rows, my heads
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.permute(1, 2, 3, 0, 4, 5).reshape(S, B, H // W, W * n, Dh)[:, :, :, :tokens]  # (S, B, H/W, N, Dh)

    def to_rows(self, a: torch.Tensor, tokens: int) -> torch.Tensor:
        """(1, H/W, tokens, Dh) -> (1, H, n, Dh); the padding rows come back as zeros and nothing reads them."""
        W, (B, hs, N, Dh) = self.world, a.shape
        n = -(-tokens // W)
        a = F.pad(a, (0, 0, 0, W * n - N))  # (B, H/W, W·n, Dh)
        send = a.reshape(B, hs, W, n, Dh).permute(2, 0, 1, 3, 4).contiguous()  # (W, B, H/W, n, Dh)
        recv = torch.empty_like(send)  # slot w = rank w's heads, my rows
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.permute(1, 0, 2, 3, 4).reshape(B, W * hs, n, Dh)  # (B, H, n, Dh)

    def gather_rows(self, out: torch.Tensor, tokens: int) -> torch.Tensor:
        """(m, C) this rank's real rows -> (tokens, C), rank 0's rows first, on every rank."""
        n = -(-tokens // self.world)
        out = F.pad(out, (0, 0, 0, n - out.shape[0])).contiguous()  # (n, C)
        parts = [torch.empty_like(out) for _ in range(self.world)]  # W x (n, C)
        dist.all_gather(parts, out, group=self.group)
        return torch.cat(parts)[:tokens]  # (tokens, C)


def head_slice(p: WanDiTParams, rank: int, world: int) -> slice:
    """The heads rank `rank` of `world` holds: [rank·H/W, (rank + 1)·H/W)."""
    check_degree(p.num_heads, world)
    hs = p.num_heads // world
    return slice(rank * hs, (rank + 1) * hs)


def shard_caches(whole: CausalCaches, rank: int, world: int) -> CausalCaches:
    """Whole caches (every head; e.g. read from a resume point) -> rank `rank`'s heads of them, copies (the rings
    are written in place, so they must not alias the whole ones). ValueError if world does not divide the heads."""
    heads = whole.k.shape[3]
    check_degree(heads, world)
    hs = heads // world
    return CausalCaches(**{n: t[..., rank * hs:(rank + 1) * hs, :].contiguous() for n, t in whole.tensors().items()})


def gather_caches(caches: CausalCaches, group: dist.ProcessGroup | None, dst: int = 0,
                  device: torch.device | str = "cpu") -> CausalCaches | None:
    """Every rank's head-sharded caches -> the whole caches on rank `dst` of the group (on `device`), None on the
    others; every rank must call it. Gathered one (step, layer) at a time, so the transient on `dst` is one layer's
    whole ring (260 MB at full size), not all of them (43.7 GB)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    out = None
    if me == dst:
        out = CausalCaches(**{n: t.new_empty(*t.shape[:-2], t.shape[-2] * world, t.shape[-1], device=device)
                              for n, t in caches.tensors().items()})
    for name, t in caches.tensors().items():
        for idx in itertools.product(*map(range, t.shape[:-3])):  # (step, layer) of a ring, (layer,) of the sink
            piece = t[idx].contiguous()  # (tokens, h, Dh)
            parts = [torch.empty_like(piece) for _ in range(world)] if me == dst else None
            dist.gather(piece, parts, group=group, group_dst=dst)
            if parts is not None:
                getattr(out, name)[idx] = torch.cat(parts, dim=1)  # (tokens, H, Dh)
    return out


class SequenceParallelStream:
    """causal.py's streaming functions with each block split over the ranks of `group` (module docstring). Same
    inputs on every rank; every rank returns the whole latents. The caches it makes and reads hold the rank's heads.

    A head count not divisible by the group's size is a ValueError here, before any collective."""

    def __init__(self, model: WanS2VDiT, group: dist.ProcessGroup | None = None):
        check_degree(model.params.num_heads, dist.get_world_size(group))
        self.model = model
        self.exchange = UlyssesExchange(group)

    @property
    def heads(self) -> slice:
        return head_slice(self.model.params, self.exchange.rank, self.exchange.world)

    def empty_caches(self, lat_h: int, lat_w: int, steps: int = STEPS, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> CausalCaches:
        """Zero rings and an empty sink of this rank's H/W heads (causal.CausalCaches.empty)."""
        p = self.model.params
        return CausalCaches.empty(p, lat_h, lat_w, steps=steps, dtype=dtype, device=device,
                                  heads=p.num_heads // self.exchange.world)

    def prefill_sink(self, caches: CausalCaches, ref: torch.Tensor, motion: torch.Tensor,
                     context: torch.Tensor) -> None:
        """causal.prefill_sink, the sink's rows split over the ranks, each keeping its heads."""
        causal.prefill_sink(self.model, caches, ref, motion, context, exchange=self.exchange)

    def stream_block(self, caches: CausalCaches, noise: torch.Tensor, block_index: int, context: torch.Tensor,
                     audio: torch.Tensor, sink_offsets: int | Sequence[int], cond: torch.Tensor | None = None,
                     shift: float = 3.0) -> torch.Tensor:
        """causal.stream_block split over the ranks. -> latents (16, 3, h, w), the same on every rank."""
        return causal.stream_block(self.model, caches, noise, block_index, context, audio, sink_offsets, cond, shift,
                                   exchange=self.exchange)

    def euler_step(self, caches: CausalCaches, step: int, steps: int, x: torch.Tensor, block_index: int,
                   inputs: causal.BlockInputs, sink_offset: int, cond: torch.Tensor | None = None,
                   shift: float = 3.0) -> torch.Tensor:
        """causal.euler_step (one step of a block) split over the ranks."""
        return causal.euler_step(self.model, caches, step, steps, x, block_index, inputs, sink_offset, cond, shift,
                                 exchange=self.exchange)

    def shard_caches(self, whole: CausalCaches) -> CausalCaches:
        """Whole caches -> this rank's heads (a resumed render)."""
        return shard_caches(whole, self.exchange.rank, self.exchange.world)

    def gather_caches(self, caches: CausalCaches, dst: int = 0,
                      device: torch.device | str = "cpu") -> CausalCaches | None:
        """This group's head-sharded caches -> whole ones on rank dst (a resume point), None elsewhere."""
        return gather_caches(caches, self.exchange.group, dst, device)


def rank_costs(p: WanDiTParams, lat_h: int, lat_w: int, world: int, steps: int = STEPS,
               dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes per rank under W = world ranks (module docstring): `rings` (all steps) and `sink` held; per block-forward
    `all_to_all` (sent: q, k, v out and the attention back, every layer; (W-1)/W of it leaves the rank) and
    `head_gather` (the fp32 head outputs all-gathered, received)."""
    check_degree(p.num_heads, world)
    size = torch.empty((), dtype=dtype).element_size()
    shard = CausalCaches.empty(p, lat_h, lat_w, steps, dtype=dtype, device="meta", heads=p.num_heads // world)
    L = causal.FRAMES_PER_BLOCK * frame_tokens(p, lat_h, lat_w)
    n = -(-L // world)
    out_dim = p.patch_size[0] * p.patch_size[1] * p.patch_size[2] * p.out_dim
    return {"rings": 2 * shard.k.numel() * size,
            "sink": 2 * p.num_layers * sink_tokens(p, lat_h, lat_w) * (p.num_heads // world) * p.head_dim * size,
            "all_to_all": 4 * p.num_layers * n * p.dim * size,
            "head_gather": world * n * out_dim * 4}

