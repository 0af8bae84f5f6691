"""Small layers shared by the mini family. Pure tensor code: no I/O, no devices, no distributed calls."""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm that normalises a lower-precision input in its weight's dtype, then casts back.

    Under training's bf16 autocast the input is bf16 and the weight fp32; torch's rms_norm then takes its
    unfused fallback and warns "Mismatch dtype between input and weight" on every run. That fallback upcasts
    to fp32 and rounds the result to the input's dtype, which is exactly what this does, so the numbers
    are unchanged; when the dtypes already match (inference in fp32 or bf16) this is plain nn.RMSNorm.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is None or x.dtype == w.dtype:
            return super().forward(x)
        return F.rms_norm(x.to(w.dtype), self.normalized_shape, w, self.eps).to(x.dtype)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """Sinusoidal embedding of flow time t in [0, 1] (scaled to [0, 1000] like DiT)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = 1000.0 * t.float()[..., None] * freqs  # (..., half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (..., dim)


# Row counts whose float32 CPU GEMM (oneDNN's, behind F.linear) sums a row in an order that depends on the torch
# thread count: 5-7 and 9-11 rows give other bits on 2, 6 or 8 threads than on 1 (3 and 4 match 1); 1-4, 8 and 12
# on (to 2,000) do not, on AVX2 and AVX-512 kernels alike, for every Linear shape of the model. bf16 is the same on
# any count.
THREAD_VARIANT_ROWS = frozenset({5, 6, 7, 9, 10, 11})


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a row-wise fn (Linears, activations) over x (..., K), with the result's bits independent of the
    thread count: a float32 CPU input of THREAD_VARIANT_ROWS rows is zero-padded to the next multiple of 4.

    Per-frame Linears see these counts on a short last chunk (5 to 11 frames with the motion frames), and a
    render's frames must not depend on how many threads the loop held at the time: the decode thread borrows one
    (runtime.decode, docs/decode-worker.md)."""
    m = x.numel() // x.shape[-1]
    if x.dtype != torch.float32 or x.device.type != "cpu" or m not in THREAD_VARIANT_ROWS:
        return fn(x)
    rows = x.reshape(m, x.shape[-1])  # (M, K)
    padded = torch.cat([rows, rows.new_zeros(-m % 4, rows.shape[1])])  # (M rounded up to 4, K)
    out = fn(padded)[:m]  # (M, N)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return per_row(lambda r: self.fc2(F.silu(self.fc1(r))), x)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 + scale) + shift in one pass over x (addcmul), not two."""
    return torch.addcmul(shift, x, 1 + scale)


def rope_freqs(positions: torch.Tensor, dim: int, theta: float = 10_000.0) -> torch.Tensor:
    """Rotary angles for integer positions. positions (N,) -> angles (N, dim // 2)."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    return positions.float()[:, None] * freqs[None, :]  # (N, dim/2)


def rope_3d(t: torch.Tensor, h: torch.Tensor, w: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for 3-axis RoPE; the head dim is split t:h:w = 2:1:1 (time gets most bands).

    t, h, w: (N,) integer positions -> cos, sin: (N, head_dim // 2)
    """
    dt = head_dim // 2
    dh = dw = head_dim // 4
    angles = torch.cat([rope_freqs(t, dt), rope_freqs(h, dh), rope_freqs(w, dw)], dim=-1)  # (N, head_dim/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, Dh); cos/sin (N, Dh/2). Rotates consecutive pairs: (x1 + i x2) (cos + i sin), one complex
    multiply in float32 (one pass over x, where the real-valued form wrote six half-size temporaries)."""
    xc = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))  # (B, H, N, Dh/2) complex
    out = torch.view_as_real(xc * torch.complex(cos, sin))  # (B, H, N, Dh/2, 2)
    return out.flatten(-2).to(x.dtype)  # (B, H, N, Dh)


def _fast_path(layer: nn.Module, x: torch.Tensor) -> bool:
    """Inference on a CPU tensor with oneDNN: the fused and rewritten layers below apply.

    Training (autograd) keeps the plain ops, so the gradients are those of the formula as written.
    """
    w = getattr(layer, "weight", None)
    return (type(w) is nn.Parameter  # not a DTensor (FSDP2), a subclass, or a quantized layer's packed weight
            and x.device.type == "cpu" and not (torch.is_grad_enabled() and w.requires_grad)
            and torch.backends.mkldnn.is_available() and x.dtype == w.dtype
            # bf16 only where oneDNN computes it (an AVX2-only CPU has no bf16 kernels for these fused ops;
            # the plain ops fall back to torch's own, slowly: `runtime.dtype: auto` picks float32 there)
            and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())))


def linear_gelu(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(linear(x)), with the GELU fused into oneDNN's matmul on CPU: torch's own tanh-GELU is the slow
    part of the DiT's MLP input (bench/results.md)."""
    if not _fast_path(linear, x):
        return F.gelu(linear(x), approximate="tanh")
    return torch.ops.mkldnn._linear_pointwise(x, linear.weight, linear.bias, "gelu", [], "tanh")


class GeluMLP(nn.Module):
    """Linear -> tanh-GELU -> Linear, with the state-dict keys of nn.Sequential (0 and 2), fused on CPU."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.add_module("0", nn.Linear(dim, hidden))
        self.add_module("2", nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "2")(linear_gelu(getattr(self, "0"), x))


def conv_silu(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """silu(conv(x)), with the SiLU fused into oneDNN's convolution on CPU (a post-op: the output is written
    once, not re-read; bench/cpu_levers.py measures the gain)."""
    if not _fast_path(conv, x):
        return F.silu(conv(x))
    return torch.ops.mkldnn._convolution_pointwise(x, conv.weight, conv.bias, list(conv.padding), list(conv.stride),
                                                   list(conv.dilation), conv.groups, "swish", [], "")


def _two_taps(w: torch.Tensor, dim: int, phase: int) -> torch.Tensor:
    """The 3 taps of a 3x3 kernel along `dim` as seen by output phase 0 or 1 of a nearest 2x upsampling:
    phase 0 reads input rows (i-1, i, i) -> taps (w0, w1 + w2) at (i-1, i); phase 1 reads (i, i, i+1) -> (w0 + w1, w2)."""
    w0, w1, w2 = w.unbind(dim)
    return torch.stack([w0, w1 + w2] if phase == 0 else [w0 + w1, w2], dim)


def upsample_conv(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """conv(nearest 2x upsampling of x) for a 3x3, padding-1 conv. x (T, I, H, W) -> (T, O, 2H, 2W).

    On the CPU fast path it runs as its sub-pixel equivalent: each of the 4 output phases is a 2x2 conv of
    x itself, so 16 instead of 36 multiply-adds per output and input channel, and no upsampled copy of x.
    Equal to the plain form up to float rounding (the taps are summed before, not after, the products).
    """
    if not _fast_path(conv, x):
        return conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
    T, _, H, W = x.shape
    O = conv.out_channels
    w = torch.cat([_two_taps(_two_taps(conv.weight, 2, a), 3, b) for a in (0, 1) for b in (0, 1)])  # (4O, I, 2, 2)
    w = w.contiguous(memory_format=torch.channels_last)
    b = conv.bias.repeat(4) if conv.bias is not None else None  # (4O,)
    y = F.conv2d(F.pad(x, (1, 1, 1, 1)), w, b).permute(0, 2, 3, 1)  # (T, H+1, W+1, 4O)
    out = x.new_empty(T, H, 2, W, 2, O)  # the channels-last layout of (T, O, 2H, 2W)
    for a in (0, 1):
        for c in (0, 1):
            k = 2 * a + c
            out[:, :, a, :, c, :] = y[:, a:a + H, c:c + W, k * O:(k + 1) * O]  # phase (a, c) starts at (a, c)
    return out.view(T, 2 * H, 2 * W, O).permute(0, 3, 1, 2)  # (T, O, 2H, 2W), channels last


class ResBlock2d(nn.Module):
    """GroupNorm-free residual conv block: cheap on CPU and safe for per-frame, chunked decoding."""

    def __init__(self, ch: int):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(conv_silu(self.conv1, F.silu(x)))
