"""A test double of the SwiftVR package (avatar_cli.sr.swiftvr), for the SR stage's plumbing tests.

It has the package's interface (load_sr, output_size, SRStream, model_dir.recognise / check / init_tiny) and its
streaming shape: chunks of 28 input frames, then 24; a group is processed only once a later frame shows it is not
the last chunk (so the output lags the input), and the last chunk takes whatever remains. The model is a bilinear
x2 (or x4) upscale followed by a per-pixel channel mix (one Linear, under `blocks`, so `runtime.weights` has a
Linear to quantize), with a carried state: each chunk's output is shifted by the previous chunk's mean colour, so a
stream resumed without its state differs from one that kept it.

`install(monkeypatch)` makes it the package a job resolves.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from avatar_cli.errors import InputError

FIRST, NEXT = 28, 24  # input frames of the first chunk and of each one after
SCALES = (2, 4)
PICKLES = (".pth", ".pt", ".bin", ".ckpt", ".pkl")


class ToyDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (T, 3, H, W)
        y = self.blocks[0](x.permute(0, 2, 3, 1).to(self.blocks[0].bias.dtype))  # (T, H, W, 3)
        return y.permute(0, 3, 1, 2)  # (T, 3, H, W)


@dataclass
class SRModels:
    reae: nn.Module
    dit: nn.Module
    prompt: torch.Tensor


def output_size(lq_hw: tuple[int, int], scale: int) -> tuple[int, int]:
    """(h, w) -> (H, W): scale times, rounded up to a multiple of 8."""
    if scale not in SCALES:
        raise ValueError(f"this model upscales x{' or x'.join(map(str, SCALES))}, not x{scale}")
    return tuple(-(-n * scale // 8) * 8 for n in lq_hw)


def load_sr(model_dir: Path, device, dtype) -> SRModels:
    dit = ToyDiT()
    dit.load_state_dict(load_file(str(Path(model_dir) / "dit.safetensors")), strict=True)
    return SRModels(nn.Identity(), dit.to(device, dtype), torch.zeros(1, device=device, dtype=dtype))


class SRStream:
    def __init__(self, models: SRModels, lq_hw: tuple[int, int], scale: int, device, dtype):
        self.models, self.lq_hw, self.scale, self.device, self.dtype = models, lq_hw, scale, device, dtype
        self.out_hw = output_size(lq_hw, scale)
        self.pending = torch.zeros(0, 3, *lq_hw, device=device)  # (held, 3, h, w) input frames not yet out
        self.carry = torch.full((3,), 0.5, device=device)  # the last chunk's mean colour
        self.chunks = 0

    @property
    def held(self) -> int:
        return len(self.pending)

    def _run(self, x: torch.Tensor) -> torch.Tensor:  # x (T, 3, h, w) in [0, 1]
        up = F.interpolate(x, size=self.out_hw, mode="bilinear", align_corners=False)  # (T, 3, H, W)
        y = self.models.dit(up.to(self.dtype)).float() + 0.1 * (self.carry - 0.5).view(1, 3, 1, 1)  # (T, 3, H, W)
        y = y.clamp(0, 1)
        self.carry = y.mean(dim=(0, 2, 3))  # (3,)
        self.chunks += 1
        return y

    def push(self, frames: torch.Tensor) -> torch.Tensor:
        self.pending = torch.cat([self.pending, frames.float()])  # (held + T, 3, h, w)
        out = []
        while True:
            n = FIRST if self.chunks == 0 else NEXT
            if len(self.pending) <= n:  # not yet known not to be the last chunk
                break
            out.append(self._run(self.pending[:n]))
            self.pending = self.pending[n:]
        return torch.cat(out) if out else torch.zeros(0, 3, *self.out_hw, device=self.device)

    def finish(self) -> torch.Tensor:
        if not len(self.pending):
            return torch.zeros(0, 3, *self.out_hw, device=self.device)
        y, self.pending = self._run(self.pending), self.pending[:0]
        return y

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"pending": self.pending, "carry": self.carry, "chunks": torch.tensor([self.chunks])}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self.pending, self.carry, self.chunks = d["pending"].float(), d["carry"].float(), int(d["chunks"][0])


def _config(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None


def recognise(folder: Path) -> bool:
    config = _config(Path(folder))
    return isinstance(config, dict) and config.get("model") == "swiftvr"


def check(folder: Path) -> None:
    folder = Path(folder)
    pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLES]
    if pickles:
        raise InputError(f"sr.model: {folder}: {pickles[0]} is a pickle; SwiftVR weights are read from "
                         "safetensors only")
    path = folder / "dit.safetensors"
    if not path.is_file():
        raise InputError(f"sr.model: {folder}: dit.safetensors is missing")
    want = set(ToyDiT().state_dict())
    got = set(load_file(str(path)))
    if got != want:
        raise InputError(f"sr.model: {path}: a transformer of another model (keys {sorted(got - want)[:2]} ...)")


def init_tiny(folder: Path, seed: int) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    dit = ToyDiT()
    with torch.no_grad():  # near the identity: the frames stay recognisable
        dit.blocks[0].weight.copy_(torch.eye(3) + 0.05 * torch.randn(3, 3))
        dit.blocks[0].bias.copy_(0.02 * torch.randn(3))
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(folder / "dit.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model": "swiftvr"}))
    return folder


def install(monkeypatch) -> None:
    """Make this module the SR package a job resolves (stages/sr.py PACKAGE); a decode worker imports it by name."""
    monkeypatch.setattr("avatar_cli.stages.sr.PACKAGE", __name__)


model_dir = sys.modules[__name__]  # the package's model_dir functions are this module's
