"""The audio-to-video Diffusion Transformer, trained by flow matching.

One joint self-attention sequence per chunk: [text tokens, reference tokens, video tokens].
Each video frame carries its own conditioning vector (flow time + audio features + the pooled
prompt + a mask embedding), and its tokens carry the reference latent at the same place, so one
network serves N chunks (clean motion frames at the start) and I chunks (clean anchors at both
ends): the mask only says which frames are given.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from avatar_cli.families.mini.layers import (GeluMLP, MLPEmbedder, RMSNorm, apply_rope, modulate, per_row, rope_3d,
                                            timestep_embedding)


@dataclass(frozen=True)
class DiTParams:
    latent_channels: int = 8
    latent_size: int = 16  # side of the low-resolution latent the DiT works at
    patch: int = 2
    dim: int = 128
    depth: int = 4
    heads: int = 2
    mlp_ratio: float = 4.0
    audio_dim: int = 128
    text_dim: int = 128
    ref_hi_patch: int = 4  # the high-res reference latent is patchified coarser: same token count, more detail per token
    # What the network's output means. "x": the clean frame, as a change from the reference latent, turned into
    # the velocity (x1 - x_t) / (1 - t) here, so the noise in x_t cancels exactly instead of having to be copied
    # through the blocks; "v": the velocity itself (model dirs written before this field existed).
    predict: str = "x"
    # Frames near a given one (motion frames, I-chunk anchors) continue it: each frame's tokens carry the nearest
    # given frame on either side at the same place, its modulation how far away they are, and with predict="x"
    # the clean frame is predicted as a change from the reference latent blended toward those given frames by a
    # learned weight per distance, tapered to zero at max_gap (a cut-off step showed as a jump 8 frames into each
    # chunk; zero, so chunks never compound through it). Without this the DiT ignored its motion frames: its
    # first frame was as far from the truth as its last. Model dirs written before the field load with False.
    near_given: bool = True
    max_gap: int = 8  # distances told apart up to here; farther (or none) is one class, with blend weight 0

    @property
    def tokens_per_frame(self) -> int:
        return (self.latent_size // self.patch) ** 2


def nearest_given(x: torch.Tensor, mask: torch.Tensor, max_gap: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The given frame at or before / at or after each frame, and how far away it is.

    x (B, L, C, h, w); mask (B, L) bool. Returns left, right (B, L, C, h, w), zeros where there is none, and
    gap_left, gap_right (B, L) long in [0, max_gap], max_gap where there is none or it is farther.
    """
    B, L = mask.shape
    pos = torch.arange(L, device=mask.device).expand(B, L)  # (B, L)
    left = torch.where(mask, pos, -1).cummax(dim=1).values  # (B, L) index of the last given frame <= j, or -1
    right = torch.where(mask, pos, L).flip(1).cummin(dim=1).values.flip(1)  # (B, L) first given >= j, or L
    rows = torch.arange(B, device=mask.device)[:, None]  # (B, 1)

    def pick(idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        z = x[rows, idx.clamp(0, L - 1)]  # (B, L, C, h, w)
        return z * valid[:, :, None, None, None].to(z.dtype)

    has_l, has_r = left >= 0, right < L  # (B, L)
    gap_l = torch.where(has_l, pos - left, max_gap).clamp(max=max_gap)  # (B, L)
    gap_r = torch.where(has_r, right - pos, max_gap).clamp(max=max_gap)  # (B, L)
    return pick(left, has_l), pick(right, has_r), gap_l, gap_r


# q, k, v (B, H, N, Dh) -> (B, H, N, Dh). Sequence parallelism swaps in its own (families/mini/parallel.py).
AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_op: AttentionOp = F.scaled_dot_product_attention
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = RMSNorm(dim // heads)
        self.k_norm = RMSNorm(dim // heads)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # (B, H, N, Dh) each
        q = apply_rope(self.q_norm(q), cos, sin)  # (B, H, N, Dh)
        k = apply_rope(self.k_norm(k), cos, sin)  # (B, H, N, Dh)
        a = self.attn_op(q, k, v)  # (B, H, N, Dh)
        return self.proj(a.transpose(1, 2).flatten(2))  # (B, N, D)


class DiTBlock(nn.Module):
    def __init__(self, p: DiTParams):
        super().__init__()
        d = p.dim
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(d, p.heads)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        hidden = int(d * p.mlp_ratio)
        self.mlp = GeluMLP(d, hidden)
        self.ada = nn.Linear(d, 6 * d)

    def forward(self, ctx: torch.Tensor, vid: torch.Tensor, c_ctx: torch.Tensor, c_vid: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx (B, Nc, D); vid (B, L, P, D); c_ctx (B, 1, D); c_vid (B, L, 1, D)."""
        m_ctx = self.ada(F.silu(c_ctx)).chunk(6, dim=-1)  # 6 x (B, 1, D)
        m_vid = per_row(self.ada, F.silu(c_vid)).chunk(6, dim=-1)  # 6 x (B, L, 1, D)
        B, L, P, D = vid.shape
        n_ctx = ctx.shape[1]

        h = torch.cat([modulate(self.norm1(ctx), m_ctx[0], m_ctx[1]),
                       modulate(self.norm1(vid), m_vid[0], m_vid[1]).reshape(B, L * P, D)], dim=1)  # (B, N, D)
        a = self.attn(h, cos, sin)  # (B, N, D)
        # residual + gate * branch in one pass each (addcmul)
        ctx = torch.addcmul(ctx, m_ctx[2], a[:, :n_ctx])  # (B, Nc, D)
        vid = torch.addcmul(vid, m_vid[2], a[:, n_ctx:].reshape(B, L, P, D))  # (B, L, P, D)

        ctx = torch.addcmul(ctx, m_ctx[5], self.mlp(modulate(self.norm2(ctx), m_ctx[3], m_ctx[4])))  # (B, Nc, D)
        vid = torch.addcmul(vid, m_vid[5], self.mlp(modulate(self.norm2(vid), m_vid[3], m_vid[4])))  # (B, L, P, D)
        return ctx, vid


class FinalLayer(nn.Module):
    def __init__(self, p: DiTParams):
        super().__init__()
        self.norm = nn.LayerNorm(p.dim, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Linear(p.dim, 2 * p.dim)
        self.linear = nn.Linear(p.dim, p.patch * p.patch * p.latent_channels)

    def forward(self, vid: torch.Tensor, c_vid: torch.Tensor) -> torch.Tensor:
        shift, scale = per_row(self.ada, F.silu(c_vid)).chunk(2, dim=-1)  # (B, L, 1, D) each
        return self.linear(modulate(self.norm(vid), shift, scale))  # (B, L, P, p*p*C)


class DiT(nn.Module):
    def __init__(self, p: DiTParams):
        super().__init__()
        self.params = p
        c, d = p.latent_channels, p.dim
        self.x_embed = nn.Linear(p.patch * p.patch * c, d)
        self.ref_lo_embed = nn.Linear(p.patch * p.patch * c, d)
        # The reference latent also enters every frame's tokens at the same place (as channel concat does
        # in image-to-video models): a token sees what the person looks like right where it is.
        self.ref_in = nn.Linear(p.patch * p.patch * c, d)
        self.ref_hi_embed = nn.Linear(p.ref_hi_patch * p.ref_hi_patch * c, d)
        self.text_embed = nn.Linear(p.text_dim, d)
        self.t_embed = MLPEmbedder(256, d)
        self.audio_embed = MLPEmbedder(p.audio_dim, d)
        # The prompt's mean token also joins every frame's modulation vector (as FLUX's pooled text vector
        # does): expression and motion energy are global to a frame, which modulation expresses directly.
        self.text_pool = MLPEmbedder(p.text_dim, d)
        self.mask_embed = nn.Embedding(2, d)
        if p.near_given:
            self.left_in = nn.Linear(p.patch * p.patch * c, d)
            self.right_in = nn.Linear(p.patch * p.patch * c, d)
            self.gap_left = nn.Embedding(p.max_gap + 1, d)
            self.gap_right = nn.Embedding(p.max_gap + 1, d)
            self.near_logit = nn.Parameter(torch.zeros(p.max_gap))  # blend weight logit per distance 0..max_gap-1
        self.ctx_cond = nn.Parameter(torch.zeros(1, 1, d))
        self.blocks = nn.ModuleList([DiTBlock(p) for _ in range(p.depth)])
        self.final = FinalLayer(p)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """DiT-style init: Xavier linears, zeroed modulation gates and output (adaLN-Zero)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight, generator=generator)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02, generator=generator)
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)
        nn.init.normal_(self.ctx_cond, std=0.02, generator=generator)
        if self.params.near_given:  # start from 0.9^distance before the taper: a frame beside a given one is mostly it
            w = (0.9 ** torch.arange(self.params.max_gap, dtype=torch.float32)).clamp(max=0.99)
            with torch.no_grad():
                self.near_logit.copy_(torch.log(w / (1 - w)))
        for block in self.blocks:
            nn.init.zeros_(block.ada.weight)
            nn.init.zeros_(block.ada.bias)
        for layer in (self.final.ada, self.final.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def patchify(self, z: torch.Tensor, patch: int) -> torch.Tensor:
        """z (..., C, H, W) -> (..., H/p * W/p, p*p*C)"""
        *lead, C, H, W = z.shape
        z = z.reshape(*lead, C, H // patch, patch, W // patch, patch)
        z = z.movedim(-4, -1)  # (..., H/p, p, W/p, p, C)
        z = z.transpose(-3, -4)  # (..., H/p, W/p, p, p, C)
        return z.reshape(*lead, (H // patch) * (W // patch), patch * patch * C)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, L, P, p*p*C) -> (B, L, C, h, w)"""
        p, c, n = self.params.patch, self.params.latent_channels, self.params.latent_size // self.params.patch
        B, L = x.shape[:2]
        x = x.reshape(B, L, n, n, p, p, c)  # (B, L, h/p, w/p, p, p, C)
        x = x.permute(0, 1, 6, 2, 4, 3, 5)  # (B, L, C, h/p, p, w/p, p)
        return x.reshape(B, L, c, n * p, n * p)

    def rope(self, n_ctx: int, frames: int, device: torch.device,
             frame_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (Nc + L*P, Dh/2): video tokens rotate by (frame, row, col); context tokens don't rotate.

        frame_offset: index of the first of these frames in the chunk (non-zero on a sequence-parallel shard).
        """
        n = self.params.latent_size // self.params.patch
        head_dim = self.params.dim // self.params.heads
        t = torch.arange(frame_offset, frame_offset + frames, device=device).repeat_interleave(n * n)  # (L*P,)
        hw = torch.arange(n * n, device=device).repeat(frames)  # (L*P,)
        cos, sin = rope_3d(t, hw // n, hw % n, head_dim)  # (L*P, Dh/2)
        ones = torch.ones(n_ctx, head_dim // 2, device=device)
        return torch.cat([ones, cos]), torch.cat([ones * 0, sin])

    def near_blend(self, left: torch.Tensor, right: torch.Tensor, gap_l: torch.Tensor, gap_r: torch.Tensor,
                   ref_lo: torch.Tensor) -> torch.Tensor:
        """How far each frame's base moves from the reference toward its nearest given frames. -> (B, L, C, h, w)"""
        g = self.params.max_gap
        taper = 1.0 - torch.arange(g, device=self.near_logit.device) / g  # (max_gap,) to zero at max_gap
        w = torch.cat([torch.sigmoid(self.near_logit) * taper, self.near_logit.new_zeros(1)])  # (max_gap + 1,)
        wl, wr = w[gap_l], w[gap_r]  # (B, L) each
        norm = (wl + wr).clamp(min=1.0)  # between two anchors the weights share 1
        wl, wr = (wl / norm)[:, :, None, None, None], (wr / norm)[:, :, None, None, None]
        ref = ref_lo[:, None]  # (B, 1, C, h, w)
        return (wl * (left - ref) + wr * (right - ref)).to(left.dtype)

    def forward(self, x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, audio: torch.Tensor,
                ref_lo: torch.Tensor, ref_hi: torch.Tensor, text: torch.Tensor, frame_offset: int = 0,
                near: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """Predict the flow velocity of every frame.

        x (B, L, C, h, w) latents (clean where mask is set); t (B, L) flow time per frame, 1 = clean;
        mask (B, L) bool; audio (B, L, audio_dim); ref_lo (B, C, h, w); ref_hi (B, C, 2h, 2w);
        text (B, Nt, text_dim), Nt may be 0.  Returns v (B, L, C, h, w) (see `DiTParams.predict`).
        frame_offset: where x's first frame sits in the chunk, for RoPE; a sequence-parallel rank passes
        its shard's start (the other frames are reached through its attention op), and `near`: its shard of
        `nearest_given` over the whole chunk (computed here from x and mask when None).
        """
        p = self.params
        B, L = x.shape[:2]
        ref_tokens = self.patchify(ref_lo, p.patch)  # (B, P, p*p*C)
        vid = self.x_embed(self.patchify(x, p.patch)) + self.ref_in(ref_tokens)[:, None]  # (B, L, P, D)
        ctx = torch.cat([
            per_row(self.text_embed, text),  # (B, Nt, D)
            self.ref_lo_embed(ref_tokens),  # (B, P, D)
            self.ref_hi_embed(self.patchify(ref_hi, p.ref_hi_patch)),  # (B, P', D)
        ], dim=1)  # (B, Nc, D)

        base = ref_lo[:, None]  # (B, 1, C, h, w) what the output is a change from (predict="x")
        if p.near_given:
            left, right, gap_l, gap_r = near if near is not None else nearest_given(x, mask, p.max_gap)
            base = base + self.near_blend(left, right, gap_l, gap_r, ref_lo)  # (B, L, C, h, w)
            vid = vid + self.left_in(self.patchify(left, p.patch)) + self.right_in(self.patchify(right, p.patch))
        pooled = text.mean(dim=1) if text.shape[1] else text.new_zeros(B, p.text_dim)  # (B, text_dim)
        c_vid = (self.t_embed(timestep_embedding(t, 256).to(x.dtype))
                 + self.audio_embed(audio)
                 + self.text_pool(pooled)[:, None]
                 + self.mask_embed(mask.long()))  # (B, L, D)
        if p.near_given:
            c_vid = c_vid + self.gap_left(gap_l) + self.gap_right(gap_r)  # (B, L, D)
        c_vid = c_vid[:, :, None]  # (B, L, 1, D)
        c_ctx = self.ctx_cond.to(x.dtype).expand(B, -1, -1)  # (B, 1, D)
        cos, sin = self.rope(ctx.shape[1], L, x.device, frame_offset)

        for block in self.blocks:
            ctx, vid = block(ctx, vid, c_ctx, c_vid, cos, sin)
        out = self.unpatchify(self.final(vid, c_vid))  # (B, L, C, h, w)
        if p.predict == "v":
            return out
        x1 = base + out  # (B, L, C, h, w) the clean frames; at init (zero output) the reference
        # Given frames have t = 1; their velocity is never used (the sampler re-imposes them, the loss skips them).
        v = (x1.float() - x.float()) / (1.0 - t.float()).clamp(min=0.05)[:, :, None, None, None]  # (B, L, C, h, w)
        return v.to(out.dtype)  # the dtype the sampler runs in (t is float32 and would promote it)
