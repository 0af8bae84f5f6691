"""Where a streaming family's key/value rings live (`runtime.rings`): a placement decision, made once per job
(render/setup.py place_rings) and held by the Placement, which the Pipeline hands to the denoising step.

- device: the rings are allocated on the compute device beside the model;
- host: in host memory, pinned where there is a GPU to copy them to layer by layer;
- disk: in a memory-mapped scratch file in `folder`: the page cache holds what it can and the kernel writes the
  rest back to the file, so a host with less memory than the rings still holds them.

The scratch memory comes from here, not from the model files: a family asks the store for zeros (`zeros`) and hands
it the tensors of a resumed state (`adopt`); it does no file I/O of its own.
"""

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

RingsAt = Literal["device", "host", "disk"]
PLACES = ("device", "host", "disk")


@dataclass(frozen=True)
class RingStore:
    """Where the rings live, and where their scratch file goes (disk). Frozen and hashable: it is part of the
    model cache's key (two jobs that place their rings differently do not share a placement)."""

    at: RingsAt = "device"
    folder: Path | None = None  # disk: the folder of the scratch file (on the output's disk, not a RAM-backed /tmp)

    def __post_init__(self):
        if self.at not in PLACES:
            raise ValueError(f"RingStore.at={self.at!r}: one of {', '.join(PLACES)}")
        if self.at == "disk" and self.folder is None:
            raise ValueError("RingStore: rings on disk need a folder for their scratch file")

    @property
    def on_device(self) -> bool:
        return self.at == "device"

    def _pin(self) -> bool:
        return self.at == "host" and torch.cuda.is_available()  # pinned: copied to a GPU layer by layer

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A zero ring of `shape` where this store keeps rings; `device` the compute device (rings: device)."""
        if self.at == "disk":
            return mapped_zeros(shape, dtype, self.folder)
        if self.at == "host":
            return torch.zeros(shape, dtype=dtype, pin_memory=self._pin())
        return torch.zeros(shape, dtype=dtype, device=device)

    def adopt(self, t: torch.Tensor, ring: bool = True) -> torch.Tensor:
        """A cache tensor of a resumed state, read onto the compute device, moved to where this store keeps it:
        a ring into the scratch file (disk), anything else into (pinned) host memory. Unchanged where it already
        is: on the device for rings on the device, in host memory otherwise."""
        if self.on_device or t.device.type == "cpu":
            return t
        if self.at == "disk" and ring:
            return mapped_copy(t, self.folder)
        return t.cpu().pin_memory() if self._pin() else t.cpu()


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype, folder: Path) -> torch.Tensor:
    """A zero CPU tensor backed by a scratch file in `folder`, mapped shared: the page cache holds what it can and
    the kernel writes the rest back to the file. The file's name is removed at once (nothing is left behind); its
    blocks are freed when the tensor is."""
    fd, name = tempfile.mkstemp(prefix=".avatar-rings-", dir=folder)
    try:
        n = math.prod(shape)
        os.ftruncate(fd, n * torch.empty(0, dtype=dtype).element_size())  # sparse: zeros, no disk written yet
        return torch.from_file(name, shared=True, size=n, dtype=dtype).view(shape)
    finally:
        os.close(fd)
        os.unlink(name)


def mapped_copy(x: torch.Tensor, folder: Path) -> torch.Tensor:
    """x in a scratch file in `folder` (mapped_zeros), e.g. resumed rings."""
    out = mapped_zeros(tuple(x.shape), x.dtype, folder)
    out.copy_(x)
    return out
