"""One-step super-resolution in latent space: low-res latent -> high-res latent, reference in view.

The high-res reference latent is concatenated with the upsampled low-res latent, so the face
and mouth details it predicts stay those of the reference identity.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from avatar_cli.families.mini.layers import ResBlock2d


@dataclass(frozen=True)
class SRParams:
    latent_channels: int = 8
    width: int = 64
    blocks: int = 3
    scale: int = 2


class SuperRes(nn.Module):
    def __init__(self, p: SRParams):
        super().__init__()
        self.params = p
        self.conv_in = nn.Conv2d(2 * p.latent_channels, p.width, 3, padding=1)
        self.blocks = nn.Sequential(*[ResBlock2d(p.width) for _ in range(p.blocks)])
        self.conv_out = nn.Conv2d(p.width, p.latent_channels, 3, padding=1)

    def forward(self, z_lo: torch.Tensor, ref_hi: torch.Tensor) -> torch.Tensor:
        """z_lo (T, C, h, w), ref_hi (1, C, s*h, s*w) -> z_hi (T, C, s*h, s*w)."""
        up = F.interpolate(z_lo, scale_factor=float(self.params.scale), mode="bilinear", align_corners=False)
        ref = ref_hi.expand(up.shape[0], -1, -1, -1)  # (T, C, sh, sw)
        h = self.blocks(self.conv_in(torch.cat([up, ref], dim=1)))  # (T, width, sh, sw)
        return up + self.conv_out(F.silu(h))  # (T, C, sh, sw)
