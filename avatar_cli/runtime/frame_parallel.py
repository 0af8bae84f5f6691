"""Frame parallelism for a per-frame model (the super-resolution net): the ranks split a stretch's frames.

Nothing in such a model mixes frames (2-D convolutions over each frame, the reference broadcast to
every frame), so each rank running its share and all-gathering the results gives what one rank would,
in 1/world of the time. Every rank gets the whole result: the decode that follows runs as before.
"""

import math

import torch
import torch.distributed as dist
from torch import nn


class FrameParallel(nn.Module):
    """model(x (T, ...), *rest) -> (T, ...); rank r computes frames [r*n, (r+1)*n), n = ceil(T / world)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.model = model
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        n = math.ceil(T / self.world)
        mine = x[self.rank * n:(self.rank + 1) * n]  # (<= n, ...) the last ranks may get fewer, or none
        if mine.shape[0] < n:  # pad with copies of frame 0 so every rank gathers the same shape
            mine = torch.cat([mine, x[:1].expand(n - mine.shape[0], *x.shape[1:])])
        y = self.model(mine.contiguous(memory_format=_layout(x)), *rest)  # (n, ...)
        dense = y.contiguous()  # collectives take plain contiguous tensors
        parts = [torch.empty_like(dense) for _ in range(self.world)]
        dist.all_gather(parts, dense, group=self.group)
        return torch.cat(parts)[:T].contiguous(memory_format=_layout(y))  # (T, ...)


def _layout(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
        and not t.is_contiguous() else torch.contiguous_format
