"""Ulysses sequence parallelism for the DiT: the ranks split one chunk's frames instead of repeating it.

Layout. The DiT's joint sequence is [ctx tokens (text + reference); video tokens, frame by frame].
Each rank holds all ctx tokens (few, cheap to repeat) and a contiguous shard of the frames; the
frame count is padded at the end to a multiple of the degree W. Everything in a block except
attention is per token or per frame, so it runs on the shard alone. Attention:

  q, k, v (B, H, Nc + Ls*P, Dh)   ctx + my frames, all heads
    -- all-to-all (video tokens) --> (B, H/W, W*Ls*P, Dh)  all frames, my heads; padding trimmed
    + my heads of the ctx tokens      (B, H/W, Nc + L*P, Dh)
    -- full SDPA on H/W heads --
    -- all-to-all back (video) -->   (B, H, Ls*P, Dh)   my frames, all heads
    -- all-gather (ctx, by head) --> (B, H, Nc, Dh)     identical on every rank

Padded frames are never keys or queries of real tokens (they are trimmed before SDPA), so the
result equals one rank's up to float reduction order. Inference only: plain collectives, no autograd.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from avatar_cli.families.base import check_degree
from avatar_cli.families.mini.dit import nearest_given


@dataclass(frozen=True)
class ShardLayout:
    vid_tokens: int  # video tokens held by each rank (Ls * P), ctx excluded
    pad_tokens: int  # padding video tokens at the end of the full (gathered) sequence


class UlyssesAttention:
    """An `Attention.attn_op`: q, k, v (B, H, Nc + Ls*P, Dh) -> (B, H, Nc + Ls*P, Dh).

    A plain object, not an nn.Module, so installing it adds nothing to the model's state dict.
    `layout` is set by `SequenceParallelDiT` for each forward.
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.layout: ShardLayout | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.layout is None:
            raise RuntimeError("UlyssesAttention called outside SequenceParallelDiT (no shard layout)")
        W, r = self.world, self.rank
        B, H, N, Dh = q.shape
        hs, nl = H // W, self.layout.vid_tokens
        n_ctx = N - nl
        n_real = W * nl - self.layout.pad_tokens  # real video tokens in the whole chunk

        # Seq-shard -> head-shard, q, k and v in one collective. Slot w of the send buffer goes to rank w.
        vid = torch.stack([q[:, :, n_ctx:], k[:, :, n_ctx:], v[:, :, n_ctx:]])  # (3, B, H, nl, Dh)
        send = vid.reshape(3, B, W, hs, nl, Dh).permute(2, 0, 1, 3, 4, 5).contiguous()  # (W, 3, B, hs, nl, Dh)
        recv = torch.empty_like(send)  # (W, 3, B, hs, nl, Dh): slot w = rank w's frames, my heads
        dist.all_to_all_single(recv, send, group=self.group)
        full = recv.permute(1, 2, 3, 0, 4, 5).reshape(3, B, hs, W * nl, Dh)[:, :, :, :n_real]  # (3, B, hs, Lv, Dh)
        mine = slice(r * hs, (r + 1) * hs)
        qh, kh, vh = (torch.cat([t[:, mine, :n_ctx], f], dim=2)  # (B, hs, Nc + Lv, Dh)
                      for t, f in zip((q, k, v), full))

        a = F.scaled_dot_product_attention(qh, kh, vh)  # (B, hs, Nc + Lv, Dh)

        # Head-shard -> seq-shard for the video tokens; padding goes back as zeros and is dropped later.
        a_vid = F.pad(a[:, :, n_ctx:], (0, 0, 0, W * nl - n_real))  # (B, hs, W*nl, Dh)
        send = a_vid.reshape(B, hs, W, nl, Dh).permute(2, 0, 1, 3, 4).contiguous()  # (W, B, hs, nl, Dh)
        recv = torch.empty_like(send)  # slot w = rank w's heads, my frames
        dist.all_to_all_single(recv, send, group=self.group)
        out_vid = recv.permute(1, 0, 2, 3, 4).reshape(B, H, nl, Dh)  # (B, H, nl, Dh)

        # ctx tokens: every rank computed its heads for all of them; gather the heads.
        parts = [torch.empty_like(a[:, :, :n_ctx]) for _ in range(W)]  # W x (B, hs, Nc, Dh)
        dist.all_gather(parts, a[:, :, :n_ctx].contiguous(), group=self.group)
        out_ctx = torch.cat(parts, dim=1)  # (B, H, Nc, Dh)
        return torch.cat([out_ctx, out_vid], dim=2)  # (B, H, Nc + nl, Dh)


class SequenceParallelDiT(nn.Module):
    """Wraps a DiT (plain or FSDP-sharded) so each rank computes a shard of the frames.

    Same call signature and result as the DiT: every rank gets the full velocity (B, L, C, h, w),
    so the sampler runs unchanged and identically on all ranks.
    """

    def __init__(self, dit: nn.Module, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.dit = dit
        self.params = dit.params
        self.op = UlyssesAttention(group)
        check_degree(dit.params.heads, self.op.world)
        for block in dit.blocks:
            block.attn.attn_op = self.op

    def forward(self, x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, audio: torch.Tensor,
                ref_lo: torch.Tensor, ref_hi: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        W, r = self.op.world, self.op.rank
        B, L = x.shape[:2]
        ls = math.ceil(L / W)  # frames per rank
        pad = ls * W - L
        shard = slice(r * ls, (r + 1) * ls)

        def local(z: torch.Tensor) -> torch.Tensor:
            """z (B, L, ...) -> my frames (B, ls, ...), zero frames past the end."""
            z = torch.cat([z, z.new_zeros(B, pad, *z.shape[2:])], dim=1) if pad else z  # (B, W*ls, ...)
            return z[:, shard]

        self.op.layout = ShardLayout(vid_tokens=ls * self.params.tokens_per_frame,
                                     pad_tokens=pad * self.params.tokens_per_frame)
        # The nearest given frames are found over the whole chunk, then sharded like everything per frame.
        near = None
        if self.params.near_given:
            near = tuple(local(n) for n in nearest_given(x, mask, self.params.max_gap))
        try:
            v = self.dit(local(x), local(t), local(mask), local(audio), ref_lo, ref_hi, text,
                         frame_offset=r * ls, near=near)  # (B, ls, C, h, w)
        finally:
            self.op.layout = None
        parts = [torch.empty_like(v) for _ in range(W)]  # W x (B, ls, C, h, w)
        dist.all_gather(parts, v.contiguous(), group=self.op.group)
        return torch.cat(parts, dim=1)[:, :L]  # (B, L, C, h, w)
