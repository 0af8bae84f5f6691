"""Module: one model plus its safetensors checkpoint.

Models are built on the meta device (no memory, no init cost) and the checkpoint's tensors are
assigned in place after a strict check of names and shapes. Never pickle: safetensors only.

Small models are loaded whole at once (`load_module`). Big ones stay lazy (`lazy_module`): the model
waits on meta beside the index of its files, and placement fills it where it will run, each rank
reading only the rows of its FSDP2 shard (modules/loading.py).
"""

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from avatar_cli.errors import InputError
from avatar_cli.modules.loading import TensorIndex, materialize, mismatch_problems
from avatar_cli.modules.loading import _names  # noqa: F401 -- families word their key lists with it, from here
from avatar_cli.modules.tensor_files import aligned


@dataclass
class Module:
    name: str
    model: nn.Module
    source: str  # checkpoint path, or a note such as "random init (seed 0)"
    # Set for a lazy module: `model` waits on the meta device until `materialize` reads these files.
    index: TensorIndex | None = None
    # Run once by placement when the weights are where they run (whole, or this rank's FSDP2 shard) and before
    # any forward: e.g. a LoRA merged into them. Placement knows no family; the family's loader sets this.
    after_load: Callable[[nn.Module], None] | None = None
    # Weights the checkpoint stores quantized and that stay so (a GGUF file's, a scaled-FP8 file's): FSDP2 cannot
    # shard them, so placement replicates this module as it does one `runtime.weights` quantized.
    stored_quantized: bool = False

    @property
    def is_lazy(self) -> bool:
        """Parameters still on the meta device, to be read from `index`."""
        return self.index is not None and any(p.device.type == "meta" for p in self.model.parameters())

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype; for a lazy module the file's (what `materialize` without a dtype gives)."""
        if self.is_lazy:
            name = next(name for name, _ in self.model.named_parameters())
            return self.index[name].dtype
        return next(self.model.parameters()).dtype

    def materialize(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "Module":
        """Read a lazy module's weights whole onto `device` (None dtype: the file's); then as `to`."""
        if self.index is None:
            raise ValueError(f"{self.name}: not a lazy module (it has no checkpoint index to read)")
        materialize(self.model, self.index, device, dtype)
        return self.to(device, dtype)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "Module":
        if self.is_lazy:  # nothing to move yet: read the weights straight to where they are asked for
            return self.materialize(device or "cpu", dtype)
        self.model.to(device=device, dtype=dtype)
        # Conv stacks run several times faster channels-last on CPU (oneDNN) and on tensor cores.
        # Only the 2-D convs' weights: Module.to(memory_format=...) would fail on a model that also holds
        # 5-D (Conv3d) or 3-D (Conv1d) weights, as wan-s2v's VAE and wav2vec2 do.
        for m in self.model.modules():
            if isinstance(m, nn.Conv2d):
                m.to(memory_format=torch.channels_last)
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


def save_sharded_safetensors(folder: str | Path, sizes: Mapping[str, int], make: Callable[[str], torch.Tensor],
                             shards: int, prefix: str = "diffusion_pytorch_model") -> Path:
    """Write tensors in the HF sharded layout (`{prefix}-0000i-of-0000n.safetensors` + `{prefix}.safetensors.index
    .json`, as the Wan releases ship), one shard in memory at a time; returns the index's path.

    sizes: name -> bytes, in the order to store them (split into `shards` consecutive runs of about equal bytes);
    make(name): the tensor, built only while its shard is written (a 3 GB random checkpoint needs no 3 GB).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(sizes)
    if len(names) < shards:
        raise ValueError(f"{len(names)} tensors cannot fill {shards} shards")
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = g = 0
    for i, name in enumerate(names):
        # The run a tensor joins is where its first byte falls in the whole checkpoint, held to one run further
        # than the last tensor's and late enough to leave a tensor for each run after it: no shard is empty.
        want = done * shards // max(total, 1)
        g = max(g, shards - (len(names) - i), min(want, g + (1 if i else 0), shards - 1))
        groups[g].append(name)
        done += sizes[name]
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        file = f"{prefix}-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_safetensors({name: make(name).contiguous() for name in group}, folder / file)
        weight_map.update(dict.fromkeys(group, file))
    index = folder / f"{prefix}.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return index


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "zeros_", "ones_", "xavier_uniform_",
                   "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


def build_meta(model_cls: type[nn.Module], params: object) -> nn.Module:
    """The model on the meta device. Its layers' random init is skipped: on meta it writes nothing, yet
    torch runs it through its Python reference ops, whose first use imports torch._dynamo (~0.8 s of every
    `avatar` process's start)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            return model_cls(params).eval()
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


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
    problems = mismatch_problems(expected, found)
    if problems:
        raise InputError(f"model: {path}: weights don't match the config: " + "; ".join(problems))


def load_module(name: str, model_cls: type[nn.Module], params: object, path: Path) -> Module:
    """Build on meta, check strictly, then assign the checkpoint's tensors (no copy, no random init)."""
    model = build_meta(model_cls, params)
    check_checkpoint(path, model)
    state = aligned(load_file(str(path), device="cpu"))  # unaligned views round differently (tensor_files.aligned)
    model.load_state_dict(state, strict=True, assign=True)
    return Module(name, model, str(path))


def lazy_module(name: str, model_cls: type[nn.Module], params: object, index: TensorIndex) -> Module:
    """Build on meta and check names and shapes against the files' headers; no tensor data is read until
    `Module.materialize` (or placement) puts the weights where they run."""
    model = build_meta(model_cls, params)
    index.check(model)
    return Module(name, model, index.source, index=index)


def random_module(name: str, model_cls: type[nn.Module], params: object, seed: int) -> Module:
    """A seeded random init of the real architecture (tests, `models init`, and mini until trained)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(params).eval()
        init = getattr(model, "init_weights", None)
        if init is not None:
            init()
    return Module(name, model, f"random init (seed {seed})")



class _NotLoaded(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.component = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"component '{self.component}' is not loaded on this rank")


def not_loaded(name: str) -> Module:
    """A stand-in for a component this rank never runs (the timestep pipeline's decode rank holds no DiT): the
    stages that name it can be built; calling it raises, naming it."""
    return Module(name, _NotLoaded(name), "not loaded on this rank")
