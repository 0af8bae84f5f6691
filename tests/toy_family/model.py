"""The toy family's models: pure nn.Module code and one params dataclass."""

import json
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ToyParams:
    size: str = "tiny"
    channels: int = 4  # latent channels
    latent: int = 4  # latent side; frames are 4x that
    vocab: int = 64  # the text encoder's hashed-word buckets
    dim: int = 8

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class ToyText(nn.Module):
    """Words -> (1, N, dim) by hashed buckets."""

    def __init__(self, p: ToyParams):
        super().__init__()
        self.params = p
        self.embed = nn.Embedding(p.vocab, p.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)  # (1, N, dim)


class ToyNet(nn.Module):
    """Denoises latents (T, C, h, w) conditioned on a text vector and per-frame loudness; decodes them to frames."""

    def __init__(self, p: ToyParams):
        super().__init__()
        self.params = p
        self.cond = nn.Linear(p.dim + 1, p.channels)
        self.denoise = nn.Conv2d(p.channels, p.channels, 3, padding=1)
        self.decode = nn.Conv2d(p.channels, 3, 3, padding=1)

    def forward(self, z: torch.Tensor, text: torch.Tensor, loud: torch.Tensor) -> torch.Tensor:
        c = self.cond(torch.cat([text.expand(z.shape[0], -1), loud[:, None]], dim=1))  # (T, C)
        return z + self.denoise(z) + c[:, :, None, None]  # (T, C, h, w)

    def frames(self, z: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.decode(z))  # (T, 3, h, w)
        return nn.functional.interpolate(x, scale_factor=4, mode="nearest")  # (T, 3, 4h, 4w)
