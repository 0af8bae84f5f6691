"""SwiftVR's transformer (official `swiftvr/models/transformer.py:WanTransformer3DModel` as run by
`swiftvr/streaming/dit.py`), key-for-key with the release's `transformer/diffusion_pytorch_model*.safetensors`.

A Wan2.2-TI2V-5B-style DiT run once per chunk at the fixed timestep t = 1000 on the ReAE latents of the upscaled
low-quality frames; the restored latents are z - prediction. Module paths are the diffusers ones the release is
saved under (`attn1` self-attention, `attn2` cross-attention, `norm2` the affine pre-norm of the cross-attention,
`ffn.net.0.proj` the GELU's Linear, `condition_embedder.*`); the unkeyed norms (norm1, norm3, norm_out) are
weightless LayerNorms.

What differs from a plain Wan DiT:
- Self-attention is window attention over all latent frames: the (H, W) token grid is covered by windows of
  min(16, H) x min(16, W) tokens (`window_hw`), whose starts per axis follow `axis_starts`; odd blocks use the
  half-window-shifted starts. Every window attends densely within itself (all T frames of it, no mask), and each
  token keeps the output of one window covering it: the lowest-numbered on plain blocks, the highest on shifted
  ones (official `WanShiftWindow2DInferProcessor`, `_make_hw_starts`, `_WindowRuntimeMetaCache._build_owner_pos_cpu`).
- RoPE is applied to the whole sequence before the windows are gathered, with the time positions offset by the
  stream's running latent count; positions past the table's `rope_max_seq_len` rows take the official extension
  (`streaming/dit.py:_ensure_rope_cache_len`): angle(p) = p · atan2(sin_1, cos_1) from the stored table's row 1.
- The head uses the model's `scale_shift_table` plus the time embedding in fp32 (`streaming/dit.py:_dit_forward_chunk`,
  not the model's own `forward`).

Precision follows the official code run in one dtype (`.to(dtype)` casts every weight and the RoPE table), rounding
where it rounds: the Linears and convs run in the weight dtype; the block modulation is added in fp32 and rounded;
LayerNorms compute in fp32; q/k RMSNorm is torch's (weight applied before rounding); the gated residuals and the
RoPE's even outputs are single addcmuls; the head's modulation runs in fp32; the timestep sinusoid is diffusers'
fp32 one. In float32 on CPU the outputs equal the official goldens bit for bit (tests/test_swiftvr_golden.py).
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from avatar_cli.modules.norms import FP32LayerNorm

TIMESTEP = 1000.0  # official streaming/dit.py INFERENCE_TIMESTEP: one step from the fully degraded end of the flow
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class SwiftVRParams:
    """The architecture fields of `transformer/config.json` (adapter.params_from_config reads it)."""

    patch_size: tuple[int, int, int]
    num_heads: int
    head_dim: int
    in_channels: int
    out_channels: int
    text_dim: int
    freq_dim: int
    ffn_dim: int
    num_layers: int
    cross_attn_norm: bool
    eps: float
    rope_max_seq_len: int
    window_hw: tuple[int, int]

    def __post_init__(self):
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"SwiftVRParams.head_dim={self.head_dim}: must be even and at least 6 (3 RoPE axes)")
        if min(self.window_hw) <= 0:
            raise ValueError(f"SwiftVRParams.window_hw={self.window_hw}: window sides must be positive")

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """Channels of the t, h and w axes: h = w = 2 (head_dim // 6), t the rest (44, 42, 42 at 128)."""
        hw = 2 * (self.head_dim // 6)
        return self.head_dim - 2 * hw, hw, hw

    @classmethod
    def release(cls) -> "SwiftVRParams":
        """The released SwiftVR DiT (Wan2.2-TI2V-5B's sizes)."""
        return cls(patch_size=(1, 2, 2), num_heads=24, head_dim=128, in_channels=48, out_channels=48, text_dim=4096,
                   freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024,
                   window_hw=(16, 16))


# --- window partition ------------------------------------------------------------------------------------------

def axis_starts(size: int, win: int, shifted: bool) -> list[int]:
    """Window starts along one axis of `size` tokens, windows of `win` (official `_make_hw_starts`): the candidates
    k·win - shift (shift = win // 2 on shifted blocks), k = 0 .. ceil(size / win) + 1, clamped to [0, size - win]
    and deduplicated; then, in one pass over that list, every interior start whose neighbours already cover it
    (next <= previous + win) is dropped."""
    if size <= win:
        return [0]
    shift = win // 2 if shifted else 0
    n = -(-size // win) + 2
    s = sorted({min(max(k * win - shift, 0), size - win) for k in range(n)})
    if len(s) <= 2:
        return s
    interior = [s[i] for i in range(1, len(s) - 1) if s[i + 1] > s[i - 1] + win]  # judged on s, not as dropped
    return [s[0], *interior, s[-1]]


def _cover(starts: list[int], win: int, size: int, last: bool) -> list[int]:
    """For each coordinate 0..size-1, the index of the first (or last) start whose window covers it."""
    out = []
    for y in range(size):
        covering = [i for i, s in enumerate(starts) if s <= y < s + win]
        out.append(covering[-1] if last else covering[0])
    return out


@functools.lru_cache(maxsize=64)
def window_layout(T: int, H: int, W: int, wh: int, ww: int, shifted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the windows gather from and where each token's output comes from, on the CPU (cached per shape).

    Windows are the product of the h and w starts, numbered ih · n_w + iw; inside a window tokens run t, dy, dx.
    -> gather (N_w · L_w,) token index of each window slot, L_w = T · wh · ww; owner (T·H·W,) the slot whose
    output each token keeps: the lowest-numbered covering window on plain blocks, the highest on shifted ones
    (per axis the first or last covering start, the window number being lexicographic in (ih, iw))."""
    hs, ws = axis_starts(H, wh, shifted), axis_starts(W, ww, shifted)
    t = torch.arange(T)[:, None, None]
    dy = torch.arange(wh)[None, :, None]
    dx = torch.arange(ww)[None, None, :]
    gather = torch.stack([(t * H + h0 + dy) * W + w0 + dx for h0 in hs for w0 in ws]).reshape(-1)  # (Nw·Lw,)
    ih = torch.tensor(_cover(hs, wh, H, shifted))  # (H,)
    iw = torch.tensor(_cover(ws, ww, W, shifted))  # (W,)
    y, x = torch.arange(H)[:, None], torch.arange(W)[None, :]
    win = ih[:, None] * len(ws) + iw[None, :]  # (H, W) owning window
    local = (y - torch.tensor(hs)[ih][:, None]) * ww + (x - torch.tensor(ws)[iw][None, :])  # (H, W) slot in a frame
    owner = win[None] * (T * wh * ww) + t[:, :, 0, None] * (wh * ww) + local[None]  # (T, H, W)
    return gather, owner.reshape(-1)


# --- RoPE ------------------------------------------------------------------------------------------------------

def axis_rotations(positions: torch.Tensor, dim: int, max_len: int, dtype: torch.dtype,
                   theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of one RoPE axis for integer positions, as the official table gives them. positions (N,) int64
    >= 0 -> cos, sin (N, dim / 2) in `dtype`, one per pair of channels.

    Rows below max_len are diffusers' `get_1d_rotary_pos_embed` table (angles p · theta^(-2j/dim) in float64, stored
    float32, then cast to the model dtype with the model). A position past the table takes the official extension
    (`streaming/dit.py:_ensure_rope_cache_len`): angle = angle_0 + p · atan2 of the rotation from row 0 to row 1,
    in float64 from the stored (rounded) rows; row 0 is (1, 0), so that is p · atan2(sin_1, cos_1)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))  # (dim/2,)
    angles = torch.outer(positions.to(torch.float64), inv)  # (N, dim/2)
    cos, sin = angles.cos().float().to(dtype), angles.sin().float().to(dtype)  # (N, dim/2) the stored table
    beyond = positions >= max_len
    if bool(beyond.any()):
        c1, s1 = inv.cos().float().to(dtype).double(), inv.sin().float().to(dtype).double()  # (dim/2,) row 1
        step = torch.atan2(s1, c1)  # (dim/2,)
        ext = positions[beyond].to(torch.float64)[:, None] * step  # (n, dim/2)
        cos[beyond], sin[beyond] = ext.cos().to(dtype), ext.sin().to(dtype)
    return cos, sin


def rope_tables(p: SwiftVRParams, grid: tuple[int, int, int], t_off: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (N, head_dim / 2) for a (T, H, W) token grid in sequence order (t, y, x), time positions starting
    at t_off, h and w at 0."""
    T, H, W = grid
    # Built on the CPU, as the official table is, then moved: small, and no device sync for the extension's test
    # (nor a meta device's refusal of it when the planner counts the model there).
    parts = [tuple(t.to(device) for t in axis_rotations(torch.arange(n) + off, d, p.rope_max_seq_len, dtype))
             for n, off, d in zip(grid, (t_off, 0, 0), p.rope_dims)]
    cos = torch.cat([parts[0][0][:, None, None].expand(T, H, W, -1), parts[1][0][None, :, None].expand(T, H, W, -1),
                     parts[2][0][None, None].expand(T, H, W, -1)], dim=-1).reshape(T * H * W, -1)  # (N, Dh/2)
    sin = torch.cat([parts[0][1][:, None, None].expand(T, H, W, -1), parts[1][1][None, :, None].expand(T, H, W, -1),
                     parts[2][1][None, None].expand(T, H, W, -1)], dim=-1).reshape(T * H * W, -1)  # (N, Dh/2)
    return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x_2j, x_2j+1) in x's dtype. x (N, H, Dh); cos, sin (N, Dh/2) -> (N, H, Dh).

    Rounded where the official in-place rotation (`_apply_rotary_emb_inplace`) rounds: the even output subtracts
    x_odd·sin from the rounded x_even·cos in one addcmul, the odd one adds two rounded products."""
    xe, xo = x[..., 0::2], x[..., 1::2]  # (N, H, Dh/2)
    c, s = cos[:, None], sin[:, None]  # (N, 1, Dh/2)
    even = torch.addcmul(xe * c, xo, s, value=-1)  # (N, H, Dh/2)
    return torch.stack([even, xo * c + xe * s], dim=-1).flatten(-2)  # (N, H, Dh)


# --- layers ----------------------------------------------------------------------------------------------------

class Attention(nn.Module):
    """q, k, v, out projections with RMSNorm over all heads on q and k (diffusers `WanAttention` keys: to_q, to_k,
    to_v, to_out.0, norm_q, norm_k)."""

    def __init__(self, p: SwiftVRParams):
        super().__init__()
        d = p.dim
        self.heads = p.num_heads
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.to_out = nn.ModuleList([nn.Linear(d, d)])
        # torch's RMSNorm, as the official module: it scales by the weight before rounding to a low-precision dtype,
        # where Wan's own RMSNorm (wan-s2v's) rounds first.
        self.norm_q, self.norm_k = nn.RMSNorm(d, eps=p.eps), nn.RMSNorm(d, eps=p.eps)

    def window_self(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], gather: torch.Tensor,
                    owner: torch.Tensor, n_windows: int) -> torch.Tensor:
        """Window self-attention of one sequence. x (N, D); gather (N_w · L_w,) and owner (N,) from
        `window_layout`. -> (N, D)."""
        N, D = x.shape
        q = self.norm_q(self.to_q(x)).view(N, self.heads, -1)  # (N, H, Dh)
        k = self.norm_k(self.to_k(x)).view(N, self.heads, -1)  # (N, H, Dh)
        v = self.to_v(x).view(N, self.heads, -1)  # (N, H, Dh)
        q, k = rotate(q, *rope), rotate(k, *rope)  # (N, H, Dh) global positions, before the windows

        def windows(t: torch.Tensor) -> torch.Tensor:
            return t[gather].view(n_windows, -1, self.heads, t.shape[-1]).transpose(1, 2)  # (Nw, H, Lw, Dh)

        o = F.scaled_dot_product_attention(windows(q), windows(k), windows(v))  # (Nw, H, Lw, Dh)
        o = o.transpose(1, 2).reshape(-1, D)  # (Nw·Lw, D) slot order
        return self.to_out[0](o[owner])  # (N, D)

    def cross(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """Unmasked attention of x (N, D) over the embedded prompt ctx (L, D), no RoPE. -> (N, D)."""
        q = self.norm_q(self.to_q(x)).view(x.shape[0], self.heads, -1).transpose(0, 1)  # (H, N, Dh)
        k = self.norm_k(self.to_k(ctx)).view(ctx.shape[0], self.heads, -1).transpose(0, 1)  # (H, L, Dh)
        v = self.to_v(ctx).view(ctx.shape[0], self.heads, -1).transpose(0, 1)  # (H, L, Dh)
        o = F.scaled_dot_product_attention(q, k, v)  # (H, N, Dh)
        return self.to_out[0](o.transpose(0, 1).reshape(x.shape[0], -1))  # (N, D)


class _GeluProj(nn.Module):
    """diffusers' GELU(approximate="tanh") module: a Linear (`proj`) then the activation."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """diffusers FeedForward keys: net.0.proj (in, with tanh GELU), net.1 (dropout, no weights), net.2 (out)."""

    def __init__(self, d: int, inner: int):
        super().__init__()
        self.net = nn.ModuleList([_GeluProj(d, inner), nn.Identity(), nn.Linear(inner, d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class Block(nn.Module):
    """Modulated window self-attention, cross-attention over the prompt, modulated FFN (diffusers
    `WanTransformerBlock`)."""

    def __init__(self, p: SwiftVRParams):
        super().__init__()
        d = p.dim
        self.norm1 = FP32LayerNorm(d, p.eps, elementwise_affine=False)
        self.attn1 = Attention(p)
        self.attn2 = Attention(p)
        self.norm2 = FP32LayerNorm(d, p.eps, elementwise_affine=True) if p.cross_attn_norm else nn.Identity()
        self.ffn = FeedForward(d, p.ffn_dim)
        self.norm3 = FP32LayerNorm(d, p.eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6, d))

    def forward(self, x: torch.Tensor, tp: torch.Tensor, ctx: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                layout: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
        """x (N, D); tp (6, D) time projection; ctx (L, D) embedded prompt. -> (N, D)."""
        mods = (self.scale_shift_table[0] + tp.float()).to(x.dtype)  # (6, D) added in fp32, rounded
        shift, scale, gate, c_shift, c_scale, c_gate = mods.unbind(0)  # (D,) each
        # The gated residuals are one addcmul each (one rounding in a low-precision dtype), as the official block's.
        x = torch.addcmul(x, self.attn1.window_self(self.norm1(x) * (1 + scale) + shift, rope, *layout), gate)  # (N, D)
        x = x + self.attn2.cross(self.norm2(x), ctx)  # (N, D)
        return torch.addcmul(x, self.ffn(self.norm3(x) * (1 + c_scale) + c_shift), c_gate)  # (N, D)


class TimeEmbedding(nn.Module):
    """diffusers TimestepEmbedding keys: linear_1, SiLU, linear_2."""

    def __init__(self, d_in: int, d: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(d_in, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TextProjection(nn.Module):
    """diffusers PixArtAlphaTextProjection keys: linear_1, tanh GELU, linear_2."""

    def __init__(self, d_in: int, d: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(d_in, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


class ConditionEmbedder(nn.Module):
    """Keys time_embedder.*, time_proj, text_embedder.* (diffusers `WanTimeTextImageEmbedding` without images)."""

    def __init__(self, p: SwiftVRParams):
        super().__init__()
        self.freq_dim = p.freq_dim
        self.time_embedder = TimeEmbedding(p.freq_dim, p.dim)
        self.time_proj = nn.Linear(p.dim, 6 * p.dim)
        self.text_embedder = TextProjection(p.text_dim, p.dim)


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """diffusers `get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)`, in fp32 as it
    computes it: [cos | sin] of t · exp(-ln(10000) · i / half). t (B,) -> (B, dim) float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)  # (half,)
    arg = t[:, None].float() * freqs[None]  # (B, half)
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1)  # (B, dim)


@dataclass(frozen=True)
class Conditioning:
    """What every chunk's pass shares: computed once per stream (official `StreamingDiT._get_cached_condition`)."""

    temb: torch.Tensor  # (D,) time embedding of t = 1000, for the head
    tp: torch.Tensor  # (6, D) the blocks' time projection
    ctx: torch.Tensor  # (L, D) embedded prompt


class SwiftVRDiT(nn.Module):
    """The SwiftVR transformer; state_dict keys and shapes equal the release's (adapter.py)."""

    def __init__(self, p: SwiftVRParams):
        super().__init__()
        self.params = p
        d = p.dim
        self.patch_embedding = nn.Conv3d(p.in_channels, d, kernel_size=p.patch_size, stride=p.patch_size)
        self.condition_embedder = ConditionEmbedder(p)
        self.blocks = nn.ModuleList([Block(p) for _ in range(p.num_layers)])
        self.norm_out = FP32LayerNorm(d, p.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(d, p.out_channels * math.prod(p.patch_size))
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 2, d))

    def conditioning(self, prompt: torch.Tensor, t: float = TIMESTEP) -> Conditioning:
        """prompt (L, text_dim) the release's prompt embedding, in the model dtype -> the shared conditioning."""
        ce = self.condition_embedder
        dt = ce.time_embedder.linear_1.weight.dtype
        sin = timestep_sinusoid(torch.tensor([t], device=prompt.device), ce.freq_dim).to(dt)  # (1, freq_dim)
        temb = ce.time_embedder(sin).to(prompt.dtype)  # (1, D)
        tp = ce.time_proj(F.silu(temb)).view(6, -1)  # (6, D)
        return Conditioning(temb[0], tp, ce.text_embedder(prompt))

    def forward(self, z: torch.Tensor, cond: Conditioning, t_off: int = 0) -> torch.Tensor:
        """z (C, F, h, w) latents of one chunk, time positions from t_off -> prediction (C_out, F, h, w) in the
        model dtype (the restored latents are z - prediction)."""
        p = self.params
        pt, ph, pw = p.patch_size
        x = self.patch_embedding(z[None].to(self.patch_embedding.weight.dtype))  # (1, D, T, H, W)
        grid = tuple(x.shape[2:])
        T, H, W = grid
        x = x.flatten(2)[0].transpose(0, 1)  # (N, D) token n = t·H·W + y·W + x
        rope = rope_tables(p, grid, t_off, x.dtype, x.device)  # (N, Dh/2) x 2
        wh, ww = min(p.window_hw[0], H), min(p.window_hw[1], W)
        layouts = []
        for shifted in (False, True):
            gather, owner = window_layout(T, H, W, wh, ww, shifted)
            layouts.append((gather.to(x.device), owner.to(x.device), gather.numel() // (T * wh * ww)))
        for i, block in enumerate(self.blocks):
            x = block(x, cond.tp, cond.ctx, rope, layouts[i % 2])  # (N, D) odd blocks shifted
        shift, scale = (self.scale_shift_table[0] + cond.temb).unbind(0)  # (D,) each
        x = (self.norm_out(x.float()) * (1 + scale) + shift).to(x.dtype)  # (N, D) in fp32, rounded
        x = self.proj_out(x)  # (N, pt·ph·pw·C)
        u = x.view(T, H, W, pt, ph, pw, -1).permute(6, 0, 3, 1, 4, 2, 5)  # (C, T, pt, H, ph, W, pw)
        return u.reshape(-1, T * pt, H * ph, W * pw)  # (C, F, h, w)
