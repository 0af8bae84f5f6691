"""Shared by the torchrun helper scripts: the tiny DiT with every path live, and fixed inputs."""

import torch

from avatar_cli.families.mini.dit import DiT, DiTParams
from avatar_cli.families.mini.config import SIZES


def tiny_dit(seed: int = 0, params: DiTParams | None = None) -> DiT:
    """The tiny DiT with all weights ~N(0, 0.2): adaLN gates and output are non-zero, so every path matters."""
    g = torch.Generator().manual_seed(seed)
    model = DiT(params or SIZES["tiny"].dit).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def inputs(p: DiTParams, frames: int, text_tokens: int = 3, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """x, t, mask, audio, ref_lo, ref_hi, text for one chunk (B = 1); identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    c, s = p.latent_channels, p.latent_size
    x = torch.randn(1, frames, c, s, s, generator=g)  # (B, L, C, h, w)
    t = torch.rand(1, frames, generator=g)  # (B, L)
    mask = torch.zeros(1, frames, dtype=torch.bool)  # (B, L)
    mask[:, 0] = True
    audio = torch.randn(1, frames, p.audio_dim, generator=g)  # (B, L, A)
    ref_lo = torch.randn(1, c, s, s, generator=g)  # (B, C, h, w)
    ref_hi = torch.randn(1, c, 2 * s, 2 * s, generator=g)  # (B, C, 2h, 2w)
    text = torch.randn(1, text_tokens, p.text_dim, generator=g)  # (B, Nt, T)
    return x, t, mask, audio, ref_lo, ref_hi, text


def exit_now(code: int) -> None:
    """Leave like an avatar torchrun worker does (see avatar_cli.cli.main): no C++ teardown at exit."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
