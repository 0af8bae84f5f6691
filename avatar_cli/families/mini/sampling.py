"""Euler sampling of a flow-matching model: t = 0 is noise, t = 1 is data, v = data - noise."""

from collections.abc import Callable

import torch


def timesteps(steps: int, shift: float) -> list[float]:
    """Uniform in noise level, then shifted toward the noisy end (as in SD3 / FLUX)."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return (1.0 - sigmas).tolist()


def sample(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
           cond: torch.Tensor, mask: torch.Tensor, ts: list[float]) -> torch.Tensor:
    """noise, cond (B, L, C, h, w); mask (B, L) bool: frames given clean. Returns the sample, same shape.

    Conditioning frames are re-imposed before every step and at the end, so the model's
    prediction at those positions never leaks into the output.
    """
    given = mask[:, :, None, None, None]  # (B, L, 1, 1, 1)
    x = noise
    for t_curr, t_next in zip(ts[:-1], ts[1:]):
        x = torch.where(given, cond, x)  # (B, L, C, h, w)
        t = torch.where(mask, 1.0, t_curr).to(torch.float32)  # (B, L) per-frame flow time
        x = x + (t_next - t_curr) * velocity(x, t)  # (B, L, C, h, w)
    return torch.where(given, cond, x)
