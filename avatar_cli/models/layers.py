"""Small layers shared by the mini family. Pure tensor code: no I/O, no devices, no distributed calls."""

import math

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


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


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
    """x (B, H, N, Dh); cos/sin (N, Dh/2). Rotates consecutive pairs."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (B, H, N, Dh/2) each
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # (B, H, N, Dh/2, 2)
    return out.flatten(-2).to(x.dtype)  # (B, H, N, Dh)


class ResBlock2d(nn.Module):
    """GroupNorm-free residual conv block: cheap on CPU and safe for per-frame, chunked decoding."""

    def __init__(self, ch: int):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.silu(self.conv1(F.silu(x))))
