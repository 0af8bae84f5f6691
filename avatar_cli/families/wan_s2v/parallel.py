"""Ulysses sequence parallelism for the Wan2.2-S2V DiT: the ranks split one clip's token sequence.

Layout. The sequence [noisy | ref | motion] of N tokens is padded with zero tokens to W·n (W ranks, n = ceil(N / W))
and rank r holds rows [r·n, (r + 1)·n) (`dit.TokenShard`); only the last rank(s) hold padding. Everything in a block
but self-attention is per token, so it runs on the shard alone, with the rank's own RoPE rows and its own segment
boundary (see dit.py's module docstring). Self-attention:

  q, k, v (1, H, n, Dh)          my tokens, all heads
    -- all-to-all -->            (1, H/W, W·n, Dh)  all tokens, my heads; padding trimmed to N
    -- SDPA over the N real tokens on H/W heads --
    -- all-to-all back -->       (1, H, n, Dh)      my tokens, all heads (padding rows come back as zeros)

Padding tokens are trimmed before SDPA, so they are never keys (nor queries) of real tokens: the result equals
one rank's up to float reduction order.

Audio injectors: each rank injects its own noisy tokens, with no collective. A token's injection depends only on
the token and its latent frame (the AdaIN LayerNorm is per token; the frame picks the AdaIN scale and shift and the
five audio keys), so a shard boundary inside a frame needs no gathering: `WanS2VDiT.inject` cuts the rank's noisy
rows at frame boundaries and injects a partial frame as a frame of its own. Chosen over the official all-gather of
the full sequence around every injector, which at 480p moves the whole fp32 hidden state (32,760 x 5,120, 0.67 GB)
12 times per forward and makes every rank inject all 29,120 noisy tokens; and over shards cut on latent-frame
boundaries, which would tie the shard sizes to the frame size (uneven shards, more padding, and ref/motion tokens
to split separately) for the same result.

Head: each rank applies it to the noisy tokens it holds, and the ranks all-gather the head outputs
(prod(patch)·C = 64 channels per token, not the 5,120 of the hidden state), so every rank returns the whole
(C, F, h, w) velocity and the sampler runs unchanged and identically everywhere. Inference only: plain
collectives, no autograd.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from avatar_cli.families.base import check_degree
from avatar_cli.families.wan_s2v.dit import TokenShard, s2v_positions


class UlyssesAttention:
    """A `SelfAttention.attn_op`: q, k, v (B, H, n, Dh), a rank's n rows of the padded sequence -> (B, H, n, Dh).

    A plain object, not an nn.Module, so installing it adds nothing to the model's state dict. `seq_len`, the real
    token count N of the whole sequence, is set by `SequenceParallelWanDiT` for each forward.
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.seq_len: int | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.seq_len is None:
            raise RuntimeError("UlyssesAttention called outside SequenceParallelWanDiT (no sequence length)")
        W, N = self.world, self.seq_len
        B, H, n, Dh = q.shape
        hs = H // W

        # Seq-shard -> head-shard, q, k and v in one collective. Slot w of the send buffer goes to rank w.
        qkv = torch.stack([q, k, v])  # (3, B, H, n, Dh)
        send = qkv.reshape(3, B, W, hs, n, Dh).permute(2, 0, 1, 3, 4, 5).contiguous()  # (W, 3, B, hs, n, Dh)
        recv = torch.empty_like(send)  # slot w = rank w's tokens, my heads
        dist.all_to_all_single(recv, send, group=self.group)
        full = recv.permute(1, 2, 3, 0, 4, 5).reshape(3, B, hs, W * n, Dh)[:, :, :, :N]  # (3, B, hs, N, Dh)

        a = F.scaled_dot_product_attention(full[0], full[1], full[2])  # (B, hs, N, Dh)

        # Head-shard -> seq-shard; the padding rows go back as zeros and nothing reads them.
        a = F.pad(a, (0, 0, 0, W * n - N))  # (B, hs, W·n, Dh)
        send = a.reshape(B, hs, W, n, Dh).permute(2, 0, 1, 3, 4).contiguous()  # (W, B, hs, n, Dh)
        recv = torch.empty_like(send)  # slot w = rank w's heads, my tokens
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.permute(1, 0, 2, 3, 4).reshape(B, H, n, Dh)  # (B, H, n, Dh)


class SequenceParallelWanDiT(nn.Module):
    """Wraps a WanS2VDiT (plain or FSDP2-sharded) so each rank computes a contiguous shard of the token sequence.

    Called like `WanS2VDiT.forward(x, t, context, ref, motion, cond, audio)`, with the same inputs on every rank;
    every rank returns the whole (C, F, h, w) float32 velocity. The wrapped model's forward runs once per call
    (with its `shard` argument), so FSDP2's hooks gather and free the parameters as for a plain call. Its
    self-attention op is replaced for good: call the model through this wrapper from then on.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None):
        super().__init__()
        # Before anything else: a bad rank count fails at start, on every rank alike, before any collective.
        check_degree(model.params.num_heads, dist.get_world_size(group))
        self.dit = model
        self.params = model.params
        self.op = UlyssesAttention(group)
        self.rank = dist.get_rank(group)
        model.set_attn_op(self.op)

    def forward(self, x: torch.Tensor, t, context: torch.Tensor, ref: torch.Tensor, motion: torch.Tensor | None,
                cond: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """As `WanS2VDiT.forward`: x (16, F, h, w) ... -> (16, F, h, w) float32 on every rank."""
        p, W = self.params, self.op.world
        _, frames, lat_h, lat_w = x.shape
        N = s2v_positions(p, frames, lat_h, lat_w, motion is not None).shape[0]  # tokens in the whole sequence
        n = -(-N // W)  # rows per rank, the last rank(s) padded
        self.op.seq_len = N
        try:
            out = self.dit(x, t, context, ref, motion, cond, audio,
                           shard=TokenShard(self.rank * n, n))  # (1, my noisy tokens, prod(patch)·C)
        finally:
            self.op.seq_len = None
        # Rank r's noisy tokens are rows r·n onwards of the sequence; pad each to n rows so the gather lines up.
        out = F.pad(out, (0, 0, 0, n - out.shape[1])).contiguous()  # (1, n, prod(patch)·C)
        parts = [torch.empty_like(out) for _ in range(W)]  # W x (1, n, prod(patch)·C)
        dist.all_gather(parts, out, group=self.op.group)
        (pt, ph, pw) = p.patch_size
        grid = (frames // pt, lat_h // ph, lat_w // pw)
        noisy = torch.cat(parts, dim=1)[0, :grid[0] * grid[1] * grid[2]]  # (F·H·W, prod(patch)·C)
        return self.dit.unpatchify(noisy, grid)  # (C, F, h, w)
