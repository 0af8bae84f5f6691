"""Where models come from: the shipped family by name, or any model directory a user brings.

A model directory is `config.json` (a FamilyConfig) plus one safetensors file per component.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from avatar_cli.errors import InputError
from avatar_cli.families.base import Family
from avatar_cli.families.mini.config import COMPONENTS, SIZES, FamilyConfig
from avatar_cli.families.mini.family import MiniFamily
from avatar_cli.modules.module import Module, build_meta, check_checkpoint, load_module, random_module

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
SHIPPED = {"mini": "mini"}  # shipped model name -> size in SIZES
RANDOM_SEED = 0  # the seeded random init that stands in for a shipped model without weights


@dataclass(frozen=True)
class ModelSource:
    name: str
    config: FamilyConfig
    path: Path | None  # None: no weights on disk, a seeded random init stands in

    @property
    def trained(self) -> bool:
        return self.path is not None

    @property
    def location(self) -> str:
        return str(self.path) if self.path else f"built in (random init, seed {RANDOM_SEED}; no weights shipped yet)"

    @property
    def family(self) -> Family:
        """The family that knows these models (the only one shipped today: mini)."""
        return MiniFamily(self.config)

    @property
    def fingerprint(self) -> str:
        return str(self.path) if self.path else f"{self.name}:random:{RANDOM_SEED}"


def read_config(directory: Path) -> FamilyConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise InputError(f"model: {directory}: no config.json (a model directory holds config.json and safetensors files)")
    try:
        cfg = FamilyConfig.from_dict(json.loads(path.read_text()))
        cfg.check()
    except (ValueError, TypeError) as e:
        raise InputError(f"model: {path}: invalid config ({e})") from None
    return cfg


def resolve_model(model: str, base_dir: Path) -> ModelSource:
    """A shipped name, else a directory (relative paths resolve against the job file's folder)."""
    if model in SHIPPED:
        directory = WEIGHTS_DIR / model
        if (directory / "config.json").is_file():
            return ModelSource(model, read_config(directory), directory)
        return ModelSource(model, SIZES[SHIPPED[model]], None)
    directory = (base_dir / model).expanduser()
    if not directory.is_dir():
        names = ", ".join(sorted(SHIPPED))
        raise InputError(f"model: '{model}' is neither a shipped model ({names}) nor a directory ({directory})")
    return ModelSource(str(directory), read_config(directory), directory)


def check_model(source: ModelSource) -> None:
    """Strict name/shape check of every checkpoint against the config, reading headers only."""
    if source.path is None:
        return
    for comp, (filename, cls) in COMPONENTS.items():
        check_checkpoint(source.path / filename, build_meta(cls, getattr(source.config, comp)))


def load_modules(source: ModelSource) -> dict[str, Module]:
    modules = {}
    for i, (comp, (filename, cls)) in enumerate(COMPONENTS.items()):
        params = getattr(source.config, comp)
        if source.path is None:
            modules[comp] = random_module(comp, cls, params, seed=RANDOM_SEED + i)
        else:
            modules[comp] = load_module(comp, cls, params, source.path / filename)
    return modules


def init_model_dir(directory: Path, size: str, seed: int = 0) -> dict[str, Module]:
    """Write a randomly initialised model directory in the real format."""
    if size not in SIZES:
        raise InputError(f"unknown size '{size}' (choose from {', '.join(SIZES)})")
    if directory.exists() and any(directory.iterdir()):
        raise InputError(f"{directory}: exists and is not empty; refusing to overwrite")
    cfg = SIZES[size]
    directory.mkdir(parents=True, exist_ok=True)
    modules = {}
    for i, (comp, (filename, cls)) in enumerate(COMPONENTS.items()):
        modules[comp] = random_module(comp, cls, getattr(cfg, comp), seed=seed + i)
        modules[comp].save(directory / filename)
    (directory / "config.json").write_text(cfg.to_json() + "\n")
    return modules


def param_count(cfg: FamilyConfig) -> int:
    return sum(sum(p.numel() for p in build_meta(cls, getattr(cfg, comp)).parameters())
               for comp, (_, cls) in COMPONENTS.items())
