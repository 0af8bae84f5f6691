"""Layers of the Wan2.x DiT family as Wan2.2-S2V uses them. Pure tensor code: no I/O, no devices, no distributed calls.

Precision follows what the official code gets on CUDA under bf16 autocast with its fp32 autocast islands (the
`amp.autocast(dtype=torch.float32)` blocks of wan/modules/s2v/model_s2v.py), written out so that no autocast is
needed: a Linear or conv runs in its weight's dtype (the input is cast to it), except the islands that the official
code runs in fp32 (time embedding, modulation, head, audio encoder), which upcast their weights; LayerNorm and
RMSNorm compute in fp32; RoPE rotates in float64. With fp32 weights every cast is a no-op and the arithmetic is the
official fp32 arithmetic.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from avatar_cli.modules.norms import FP32LayerNorm  # noqa: F401 -- shared with sr/swiftvr; imported from here

# q, k, v (B, H, N, Dh) -> (B, H, N, Dh). Sequence parallelism swaps in its own (e.g. a Ulysses all-to-all around SDPA).
AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

WAV2VEC_LAYERS = 25  # the official CausalAudioEncoder fixes num_layers=25 (embedding output + 24 layers)


F32_BLOCK_BYTES = 32 << 20  # the most fp32 weight a fp32 island upcasts at once


def linear_f32(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A Linear in fp32 whatever its weight dtype: the official fp32 autocast islands.

    A low-precision weight is upcast F32_BLOCK_BYTES of output rows at a time, not whole: the time projection's
    (5120 -> 30720 at 14B) would otherwise be a 629 MB fp32 copy on every forward. Each output is the same dot
    product over the same inputs either way; the inputs these islands get are a few rows (the timesteps)."""
    w, x = layer.weight, x.float()
    if w.dtype == torch.float32:
        return F.linear(x, w, layer.bias)
    rows = max(1, F32_BLOCK_BYTES // (4 * w.shape[1]))
    bias = layer.bias
    return torch.cat([F.linear(x, w[r:r + rows].float(), None if bias is None else bias[r:r + rows].float())
                      for r in range(0, w.shape[0], rows)], dim=-1)  # (..., out)


def sequential_f32(seq: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """Run an nn.Sequential of Linears and activations with every Linear in fp32."""
    for m in seq:
        x = linear_f32(m, x) if isinstance(m, nn.Linear) else m(x)
    return x


def as_weight_dtype(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    # A weight held quantized behind a parametrization (a GGUF file's, modules/gguf_weights.py) is dequantized on
    # every read of `layer.weight`: its parametrization names the dtype instead, so the matmul's read is the only one.
    plist = getattr(layer, "parametrizations", None)
    if plist is not None and "weight" in plist and hasattr(plist.weight[-1], "dtype"):
        return x.to(plist.weight[-1].dtype)
    return x.to(layer.weight.dtype)


class RMSNorm(nn.Module):
    """Wan's RMSNorm: normalise in fp32, round to the input dtype, then scale. Holds `weight` like WanRMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (..., D)
        return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[cos | sin] timestep embedding in float64, frequencies 10000^(-i/half). t (B,) -> (B, dim) float64."""
    half = dim // 2
    pos = t.to(torch.float64)  # (B,) an int64 timestep converts exactly
    freqs = torch.pow(10000, -torch.arange(half, dtype=torch.float64, device=t.device).div(half))  # (half,)
    sinusoid = torch.outer(pos, freqs)  # (B, half)
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)  # (B, dim)


def rope_pairs(head_dim: int) -> tuple[int, int, int]:
    """How the head_dim // 2 complex pairs split between the t, h and w axes: [22, 21, 21] at head_dim 128."""
    c = head_dim // 2
    return c - 2 * (c // 3), c // 3, c // 3


def rope_freqs(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Per-token rotations for 3-axis RoPE: a pure function of the (t, h, w) positions, so a sequence-parallel rank
    can compute its own shard's table.

    positions (N, 3) int64 -> (N, head_dim // 2) complex128. Pair j of an axis with d = 2 * pairs turns by
    position * theta^(-2j/d); a negative position uses the conjugate of the entry at its absolute value, exactly as
    the official 1024-row table lookup does (the official code builds the same numbers with torch.polar in float64).
    """
    out = []
    for axis, n in enumerate(rope_pairs(head_dim)):
        d = 2 * n
        inv = 1.0 / torch.pow(theta, torch.arange(0, d, 2, dtype=torch.float64, device=positions.device).div(d))  # (n,)
        p = positions[:, axis]  # (N,)
        angles = torch.outer(p.abs().to(torch.float64), inv)  # (N, n)
        f = torch.polar(torch.ones_like(angles), angles)  # (N, n) complex128
        out.append(torch.where((p < 0)[:, None], f.conj(), f))  # (N, n)
    return torch.cat(out, dim=1)  # (N, head_dim // 2)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... in float64. x (B, H, N, Dh), freqs (N, Dh/2) complex128.

    The official code returns fp32 here and its attention then casts to the value dtype; returning x's dtype
    (the dtype of v) is the same thing."""
    xc = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2))  # (B, H, N, Dh/2)
    return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)  # (B, H, N, Dh)


class _QKVO(nn.Module):
    """The q, k, v, o projections and the q/k RMSNorms over all heads that Wan's attentions share (their keys)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()


class SelfAttention(_QKVO):
    """Full (non-causal) self-attention with RMSNorm over all heads on q and k, and RoPE. Keys q, k, v, o, norm_q,
    norm_k as WanSelfAttention. The attention itself is `self.attn_op`, swappable for sequence parallelism."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float):
        super().__init__(dim, num_heads, qk_norm, eps)
        self.attn_op: AttentionOp = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """x (B, N, D); freqs (N, Dh/2) complex128 -> (B, N, D) in the weight dtype."""
        B, N, _ = x.shape
        x = as_weight_dtype(x, self.q)  # (B, N, D)
        q = self.norm_q(self.q(x)).view(B, N, self.num_heads, -1).transpose(1, 2)  # (B, H, N, Dh)
        k = self.norm_k(self.k(x)).view(B, N, self.num_heads, -1).transpose(1, 2)  # (B, H, N, Dh)
        v = self.v(x).view(B, N, self.num_heads, -1).transpose(1, 2)  # (B, H, N, Dh)
        a = self.attn_op(apply_rope(q, freqs), apply_rope(k, freqs), v)  # (B, H, N, Dh)
        return self.o(a.transpose(1, 2).flatten(2))  # (B, N, D)


class CrossAttention(_QKVO):
    """Unmasked cross-attention with RMSNorm on q and k, no RoPE (WanCrossAttention). Keys as SelfAttention."""

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """x (B, L, D); context (B, M, D) -> (B, L, D) in the weight dtype."""
        B, H = x.shape[0], self.num_heads
        x = as_weight_dtype(x, self.q)  # (B, L, D)
        context = as_weight_dtype(context, self.k)  # (B, M, D)
        q = self.norm_q(self.q(x)).view(B, -1, H, x.shape[-1] // H).transpose(1, 2)  # (B, H, L, Dh)
        k = self.norm_k(self.k(context)).view(B, -1, H, q.shape[-1]).transpose(1, 2)  # (B, H, M, Dh)
        v = self.v(context).view(B, -1, H, q.shape[-1]).transpose(1, 2)  # (B, H, M, Dh)
        a = F.scaled_dot_product_attention(q, k, v)  # (B, H, L, Dh)
        return self.o(a.transpose(1, 2).flatten(2))  # (B, L, D)


class CausalConv1d(nn.Module):
    """Conv1d over time with k - 1 replicated frames on the left (causal). Runs in the input's dtype: the audio
    encoder is an fp32 island. Holds `conv` like the official CausalConv1d."""

    def __init__(self, chan_in: int, chan_out: int, kernel_size: int = 3, stride: int = 1):
        super().__init__()
        self.left_pad = kernel_size - 1
        self.conv = nn.Conv1d(chan_in, chan_out, kernel_size, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, T) -> (B, C_out, T_out)."""
        x = F.pad(x, (self.left_pad, 0), mode="replicate")  # (B, C, T + k - 1)
        w, b = self.conv.weight.to(x.dtype), self.conv.bias.to(x.dtype)
        return F.conv1d(x, w, b, stride=self.conv.stride)  # (B, C_out, T_out)


def _ln_silu(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm (no affine) over channels of a (B, C, T) tensor, then SiLU. -> (B, T, C)."""
    x = x.transpose(1, 2)  # (B, T, C)
    return F.silu(F.layer_norm(x, x.shape[-1:], eps=eps))  # (B, T, C)


class AudioConvs(nn.Module):
    """The two causal conv paths of the audio encoder (official MotionEncoder_tc with need_global=True).

    Local: conv1_local splits into num_token heads of dim / 4 channels, each then goes through conv2 and conv3
    (stride 2 each, shared with the global path), giving num_token tokens per step, plus the learned padding token.
    Global: conv1_global, the same conv2 and conv3, then final_linear: one token per step (drives the AdaIN)."""

    def __init__(self, in_dim: int, dim: int, num_token: int):
        super().__init__()
        self.num_token = num_token
        self.conv1_local = CausalConv1d(in_dim, dim // 4 * num_token, 3, stride=1)
        self.conv1_global = CausalConv1d(in_dim, dim // 4, 3, stride=1)
        self.conv2 = CausalConv1d(dim // 4, dim // 2, 3, stride=2)
        self.conv3 = CausalConv1d(dim // 2, dim, 3, stride=2)
        self.final_linear = nn.Linear(dim, dim)
        self.padding_tokens = nn.Parameter(torch.zeros(1, 1, 1, dim))

    def _down(self, x: torch.Tensor) -> torch.Tensor:
        """(B', dim/4, T) after conv1 -> (B', T', dim): LN+SiLU, conv2, LN+SiLU, conv3, LN+SiLU."""
        x = _ln_silu(x).transpose(1, 2)  # (B', dim/4, T)
        x = _ln_silu(self.conv2(x)).transpose(1, 2)  # (B', dim/2, T/2)
        return _ln_silu(self.conv3(x))  # (B', T', dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, C_a, T) fp32 -> local (B, T', num_token + 1, dim), global (B, T', 1, dim)."""
        B = x.shape[0]
        loc = self.conv1_local(x)  # (B, num_token * dim/4, T)
        loc = loc.unflatten(1, (self.num_token, -1)).flatten(0, 1)  # (B * num_token, dim/4, T)
        loc = self._down(loc).unflatten(0, (B, self.num_token)).transpose(1, 2)  # (B, T', num_token, dim)
        pad = self.padding_tokens.to(loc.dtype).expand(B, loc.shape[1], 1, -1)  # (B, T', 1, dim)
        loc = torch.cat([loc, pad], dim=2)  # (B, T', num_token + 1, dim)
        glob = self._down(self.conv1_global(x))  # (B, T', dim)
        glob = linear_f32(self.final_linear, glob)  # (B, T', dim)
        return loc, glob[:, :, None]  # (B, T', n+1, dim), (B, T', 1, dim)


class CausalAudioEncoder(nn.Module):
    """wav2vec2 hidden states of 25 layers -> per-step audio tokens. The official module name is
    `casual_audio_encoder` (sic); keys `weights` (layer-mixing logits) and `encoder.*`. Runs in fp32 (an official
    fp32 island) whatever the weight dtype."""

    def __init__(self, audio_dim: int, dim: int, num_token: int):
        super().__init__()
        self.weights = nn.Parameter(torch.full((1, WAV2VEC_LAYERS, 1, 1), 0.01))
        self.encoder = AudioConvs(audio_dim, dim, num_token)

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feats (B, 25, C_a, T) -> local (B, T', num_token + 1, dim), global (B, T', 1, dim), both fp32;
        T' = ceil(ceil(T / 2) / 2) by the two stride-2 causal convs."""
        w = F.silu(self.weights.float())  # (1, 25, 1, 1)
        mixed = ((feats.float() * w) / w.sum(dim=1, keepdim=True)).sum(dim=1)  # (B, C_a, T) a softmax-free mix
        return self.encoder(mixed)


class AudioAdaLN(nn.Module):
    """AdaIN of the audio injector (diffusers AdaLayerNorm with chunk_dim=1): LN(x) (eps 1e-5, no affine)
    * (1 + scale) + shift, with [shift, scale] = Linear(SiLU(global audio token)), shift first. Holds `linear`."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """x (B, L, D); temb (B, D) -> (B, L, D) fp32."""
        mod = self.linear(as_weight_dtype(F.silu(temb), self.linear))  # (B, 2D)
        shift, scale = mod.chunk(2, dim=1)  # (B, D) each
        h = F.layer_norm(x.float(), x.shape[-1:], eps=1e-5)  # (B, L, D)
        return h * (1 + scale[:, None]) + shift[:, None]  # (B, L, D)


class FramePack(nn.Module):
    """FramePack motion tokens (official FramePackMotioner): the newest 19 motion latents, left-padded with zeros,
    split oldest to newest into buckets of 16 | 2 | 1 latents, patchified at 4x / 2x / 1x coarser kernels, emitted
    newest first: [post (1 latent, 1x2x2), 2x (2 latents, 2x4x4), 4x (16 latents, 4x8x8)]. The official class
    hard-codes 16 input channels and these kernels, independent of the DiT's patch size."""

    CHANNELS = 16
    BUCKETS = (1, 2, 16)  # newest first

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Conv3d(self.CHANNELS, dim, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.proj_2x = nn.Conv3d(self.CHANNELS, dim, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        self.proj_4x = nn.Conv3d(self.CHANNELS, dim, kernel_size=(4, 8, 8), stride=(4, 8, 8))

    @staticmethod
    def kept_buckets(keep: int, drop_mode: str) -> tuple[bool, bool, bool]:
        """Which of (post, 2x, 4x) emit tokens. keep = add_last_motion (0, 1, 2): in "drop" mode a value below 2
        removes the post tokens and below 1 the 2x tokens too; in "padd" mode every bucket stays (see forward)."""
        if drop_mode == "drop":
            return keep >= 2, keep >= 1, True
        return True, True, True

    def forward(self, motion: torch.Tensor, keep: int, drop_mode: str) -> torch.Tensor:
        """motion (16, T_m, h, w) -> tokens (1, N_m, D) in the weight dtype."""
        total = sum(self.BUCKETS)
        C, T_m, h, w = motion.shape
        lat = motion.new_zeros(C, total, h, w).to(self.proj.weight.dtype)  # (16, 19, h, w) zeros for missing history
        n = min(total, T_m)
        if n > 0:
            lat[:, total - n:] = motion[:, T_m - n:].to(lat.dtype)
        if keep < 2 and drop_mode != "drop":
            zero = sum(self.BUCKETS[: len(self.BUCKETS) - keep - 1])  # "padd": blank the newest 1 (keep=1) or 3 latents
            lat[:, total - zero:] = 0
        lat = lat[None]  # (1, 16, 19, h, w)
        b4, b2, b1 = lat.split(list(self.BUCKETS[::-1]), dim=2)  # (1, 16, 16|2|1, h, w)
        post = self.proj(b1).flatten(2).transpose(1, 2)  # (1, h/2 * w/2, D)
        x2 = self.proj_2x(b2).flatten(2).transpose(1, 2)  # (1, h/4 * w/4, D)
        x4 = self.proj_4x(b4).flatten(2).transpose(1, 2)  # (1, 4 * h/8 * w/8, D)
        use_post, use_2x, _ = self.kept_buckets(keep, drop_mode)
        parts = ([post] if use_post else []) + ([x2] if use_2x else []) + [x4]
        return torch.cat(parts, dim=1)  # (1, N_m, D)
