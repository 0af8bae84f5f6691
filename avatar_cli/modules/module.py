"""Module: one model plus its safetensors checkpoint.

Models are built on the meta device (no memory, no init cost) and the checkpoint's tensors are
assigned in place after a strict check of names and shapes. Never pickle: safetensors only.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from avatar_cli.errors import InputError


@dataclass
class Module:
    name: str
    model: nn.Module
    source: str  # checkpoint path, or a note such as "random init (seed 0)"

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "Module":
        self.model.to(device=device, dtype=dtype)
        # Conv stacks run several times faster channels-last on CPU (oneDNN) and on tensor cores.
        if any(isinstance(m, nn.Conv2d) for m in self.model.modules()):
            self.model.to(memory_format=torch.channels_last)
        return self

    def save(self, path: Path) -> None:
        state = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        save_safetensors(state, path)


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask can only set it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # set-and-restore: briefly process-wide, hence only the fallback
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                     metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, leaving the file with the mode a plain open() would give (0644 under umask 022).

    save_file writes a private temp file and renames it, so every weights file came out 0600 next to a 0644
    config.json: other accounts on a shared file system could read the config but not the model.
    """
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def build_meta(model_cls: type[nn.Module], params: object) -> nn.Module:
    with torch.device("meta"):
        return model_cls(params).eval()


def check_checkpoint(path: Path, model: nn.Module) -> None:
    """Compare a checkpoint's header (names, shapes) with a model's state dict; tensors are not read."""
    if not path.is_file():
        raise InputError(f"model: missing weights file {path}")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for a corrupt header
        raise InputError(f"model: {path}: not a readable safetensors file ({e})") from None
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mismatched = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    problems = []
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_names(unexpected)}")
    if mismatched:
        problems.append("shape mismatch: " + _names([f"{k} (file {list(found[k])}, config {list(expected[k])})"
                                                     for k in mismatched]))
    if problems:
        raise InputError(f"model: {path}: weights don't match the config: " + "; ".join(problems))


def load_module(name: str, model_cls: type[nn.Module], params: object, path: Path) -> Module:
    """Build on meta, check strictly, then assign the checkpoint's tensors (no copy, no random init)."""
    model = build_meta(model_cls, params)
    check_checkpoint(path, model)
    # safetensors hands out tensors at the file's byte offsets, often not 64-byte aligned; BLAS then takes
    # slower unaligned paths whose sums round differently from an aligned copy of the same weights (a
    # render changed with where its weights happened to sit). One aligned copy each, once.
    state = {k: v if v.data_ptr() % 64 == 0 else v.clone() for k, v in load_file(str(path), device="cpu").items()}
    model.load_state_dict(state, strict=True, assign=True)
    return Module(name, model, str(path))


def random_module(name: str, model_cls: type[nn.Module], params: object, seed: int) -> Module:
    """A seeded random init of the real architecture (tests, `models init`, and mini until trained)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(params).eval()
        init = getattr(model, "init_weights", None)
        if init is not None:
            init()
    return Module(name, model, f"random init (seed {seed})")


def _names(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
