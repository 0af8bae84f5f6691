"""A small built-in text encoder: a fixed word vocabulary and two transformer blocks.

Nothing is downloaded. Words outside the vocabulary are ignored, never an error.
"""

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from avatar_cli.families.mini.layers import per_row

DEFAULT_VOCAB = (
    "neutral", "smiling", "smile", "happy", "surprised", "surprise", "shocked",
    "calm", "still", "lively", "energetic", "animated", "talking", "speaking", "person",
)


@dataclass(frozen=True)
class TextParams:
    vocab: tuple[str, ...] = DEFAULT_VOCAB
    dim: int = 128
    heads: int = 2
    depth: int = 2
    max_tokens: int = 16


def tokenize(prompt: str, p: TextParams) -> list[int]:
    """Known words -> ids (1-based; 0 is padding). Unknown words are dropped."""
    index = {w: i + 1 for i, w in enumerate(p.vocab)}
    words = re.findall(r"[a-z]+", prompt.lower())
    return [index[w] for w in words if w in index][: p.max_tokens]


class TextBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = per_row(self.qkv, self.norm1(x))  # (B, N, 3D)
        q, k, v = qkv.unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # (B, H, N, Dh)
        a = F.scaled_dot_product_attention(q, k, v)  # (B, H, N, Dh)
        x = x + per_row(self.proj, a.transpose(1, 2).flatten(2))  # (B, N, D)
        return x + per_row(self.mlp, self.norm2(x))  # (B, N, D)


class TextEncoder(nn.Module):
    def __init__(self, p: TextParams):
        super().__init__()
        self.params = p
        self.embed = nn.Embedding(len(p.vocab) + 1, p.dim)
        self.pos = nn.Parameter(torch.zeros(p.max_tokens, p.dim))
        self.blocks = nn.ModuleList([TextBlock(p.dim, p.heads) for _ in range(p.depth)])
        self.norm = nn.LayerNorm(p.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, N) -> text tokens (B, N, dim)."""
        x = self.embed(ids) + self.pos[: ids.shape[1]]  # (B, N, D)
        for block in self.blocks:
            x = block(x)  # (B, N, D)
        return self.norm(x)
