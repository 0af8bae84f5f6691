"""The mini VAE: a per-frame image encoder and a decoder that runs chunk by chunk.

The decoder's first layer is a causal temporal convolution over the latent (kernel 2 in time),
so consecutive chunks decode seamlessly as long as the last latent frame of the previous
chunk is carried over as the cache.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from avatar_cli.families.mini.layers import ResBlock2d, upsample_conv


@dataclass(frozen=True)
class VAEParams:
    latent_channels: int = 8
    # Channels per resolution level, from half resolution down to the latent (one 2x step between levels).
    # Full resolution is reached by a pixel shuffle: small-channel convs at full size are slow on CPU.
    channels: tuple[int, ...] = (32, 64, 128)
    blocks_per_level: int = 1
    # The decoder's own channels, same order (None: `channels`). Thinner than the encoder's where the decode
    # must be fast: the decoder runs on every output frame, the encoder once per job (the reference).
    decoder_channels: tuple[int, ...] | None = None

    @property
    def downsample(self) -> int:
        return 2 ** len(self.channels)


class Encoder(nn.Module):
    def __init__(self, p: VAEParams):
        super().__init__()
        ch = p.channels
        self.conv_in = nn.Conv2d(3 * 4, ch[0], 3, padding=1)
        self.levels = nn.ModuleList()
        for i in range(len(ch) - 1):
            self.levels.append(nn.ModuleDict({
                "blocks": nn.Sequential(*[ResBlock2d(ch[i]) for _ in range(p.blocks_per_level)]),
                "down": nn.Conv2d(ch[i], ch[i + 1], 4, stride=2, padding=1),
            }))
        self.mid = ResBlock2d(ch[-1])
        self.conv_out = nn.Conv2d(ch[-1], 2 * p.latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.conv_in(F.pixel_unshuffle(x, 2))  # (B, c0, H/2, W/2)
        for level in self.levels:
            h = level["down"](level["blocks"](h))  # (B, c_{i+1}, H/2^(i+2), W/2^(i+2))
        h = self.conv_out(F.silu(self.mid(h)))  # (B, 2C, h, w)
        mean, logvar = h.chunk(2, dim=1)  # (B, C, h, w) each
        return mean, logvar.clamp(-20.0, 10.0)


class Decoder(nn.Module):
    def __init__(self, p: VAEParams):
        super().__init__()
        ch = (p.decoder_channels or p.channels)[::-1]
        # Causal temporal conv: sees the current and the previous latent frame.
        self.conv_in = nn.Conv2d(2 * p.latent_channels, ch[0], 3, padding=1)
        self.mid = ResBlock2d(ch[0])
        self.levels = nn.ModuleList()
        for i in range(len(ch) - 1):
            self.levels.append(nn.ModuleDict({
                "up": nn.Conv2d(ch[i], ch[i + 1], 3, padding=1),
                "blocks": nn.Sequential(*[ResBlock2d(ch[i + 1]) for _ in range(p.blocks_per_level)]),
            }))
        self.conv_out = nn.Conv2d(ch[-1], 3 * 4, 3, padding=1)

    def forward(self, z: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """z (T, C, h, w) consecutive latent frames; prev (1, C, h, w) or None at the timeline start.

        Returns frames (T, 3, H, W) in [-1, 1] and the cache for the next call (the last latent frame).
        """
        if prev is None:
            prev = z[:1]  # at the start, the "previous" frame is the first one itself
        z_prev = torch.cat([prev, z[:-1]], dim=0)  # (T, C, h, w), shifted by one frame
        h = self.mid(self.conv_in(torch.cat([z, z_prev], dim=1)))  # (T, c0, h, w)
        for level in self.levels:
            h = level["blocks"](upsample_conv(level["up"], h))  # (T, c_{i+1}, 2h, 2w): nearest 2x, then conv
        x = F.pixel_shuffle(self.conv_out(F.silu(h)), 2)  # (T, 3, H, W)
        return torch.tanh(x), z[-1:]


class VAE(nn.Module):
    def __init__(self, p: VAEParams):
        super().__init__()
        self.params = p
        self.encoder = Encoder(p)
        self.decoder = Decoder(p)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, 3, H, W) in [-1, 1] -> latent mean (B, C, H/f, W/f)."""
        return self.encoder(x)[0]

    def decode(self, z: torch.Tensor, prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decoder(z, prev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))[0]
