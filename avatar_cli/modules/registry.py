"""Where models come from: the shipped family by name, or any model directory a user brings.

A model directory is either
- mini's: `config.json` (a FamilyConfig) plus one safetensors file per component, or
- a Wan2.2-S2V release (the wan-s2v family), in its official layout, recognised by its file names.
"""

import dataclasses
import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

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
    config: Any  # the family's own description: mini's FamilyConfig, wan-s2v's WanS2VConfig
    path: Path | None  # None: no weights on disk, a seeded random init stands in
    # A LoRA merged into the DiT at load (wan-s2v's lora.LoraMerge: the checked file and its scale), from the job
    lora: Any = None
    mode: str = "clip"  # wan-s2v: "clip" (the official clip loop) or "streaming" (LiveAvatar's blocks)

    @property
    def trained(self) -> bool:
        return self.path is not None

    @property
    def location(self) -> str:
        return str(self.path) if self.path else f"built in (random init, seed {RANDOM_SEED}; no weights shipped yet)"

    @property
    def family_name(self) -> str:
        return "mini" if isinstance(self.config, FamilyConfig) else "wan-s2v"

    @cached_property
    def config_family(self) -> Family:
        from avatar_cli.families.wan_s2v.live import family_for_mode

        return family_for_mode(self.config, self.mode)

    @cached_property
    def family(self) -> Family:
        """The family that knows these models (one object per source: it may cache its tokenizer)."""
        return MiniFamily(self.config) if isinstance(self.config, FamilyConfig) else self.config_family

    def weight_files(self) -> list[Path]:
        """The files a render reads weights from (the resume fingerprint hashes their size, mtime, header)."""
        if self.path is None:
            return []
        if isinstance(self.config, FamilyConfig):
            return [self.path / filename for filename, _ in COMPONENTS.values()]
        return self.config.weight_files()

    @property
    def fingerprint(self) -> str:
        """Names the weights a render runs with: jobs of a batch that share it share one load."""
        base = str(self.path) if self.path else f"{self.name}:random:{RANDOM_SEED}"
        return base if self.lora is None else f"{base}+lora:{self.lora.path}:{self.lora.scale!r}"


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
    """A shipped name, else a directory (relative paths resolve against the job file's folder): a Wan2.2-S2V
    release when its files say so, else mini's format."""
    if model in SHIPPED:
        directory = WEIGHTS_DIR / model
        if (directory / "config.json").is_file():
            return ModelSource(model, read_config(directory), directory)
        return ModelSource(model, SIZES[SHIPPED[model]], None)
    directory = (base_dir / model).expanduser()
    if not directory.is_dir():
        names = ", ".join(sorted(SHIPPED))
        raise InputError(f"model: '{model}' is neither a shipped model ({names}) nor a directory ({directory})")
    from avatar_cli.families.wan_s2v import files as wan_files  # file names only: no transformers import

    if wan_files.looks_like(directory):
        from avatar_cli.families.wan_s2v import model_dir as wan

        return ModelSource(str(directory), wan.read_config(directory), directory)
    return ModelSource(str(directory), read_config(directory), directory)


def with_lora(source: ModelSource, path: Path, rank: int, scale: float | None) -> ModelSource:
    """The source with the job's LoRA, checked against its DiT from headers only (InputError naming the problem)."""
    if source.family_name != "wan-s2v":
        raise InputError(f"lora: the {source.family_name} family takes no LoRA (only wan-s2v does: LiveAvatar's)")
    from avatar_cli.families.wan_s2v.lora import checked_lora

    return dataclasses.replace(source, lora=checked_lora(source.config.dit, path, rank, scale))


def with_mode(source: ModelSource, mode: str) -> ModelSource:
    """The source rendering in the job's generation mode (InputError for a mode its family lacks)."""
    if mode == source.mode:
        return source
    if source.family_name != "wan-s2v":
        raise InputError(f"mode: '{mode}': the {source.family_name} family renders in clip mode only")
    if mode not in ("clip", "streaming"):
        raise InputError(f"mode: '{mode}': the wan-s2v family renders in clip or streaming mode")
    return dataclasses.replace(source, mode=mode)


def family_defaults(model: str, base_dir: Path, mode: str = "clip") -> tuple[str, dict[str, Any]] | None:
    """(family name, its job defaults) for the job spec, or None: mini (whose defaults are the schema's)
    or a model or mode that does not resolve (prepare() reports that)."""
    try:
        source = with_mode(resolve_model(model, base_dir), mode)
    except InputError:
        return None
    values = source.family.job_defaults()
    return (source.family.name, values) if values else None


def check_model(source: ModelSource) -> None:
    """Strict name/shape check of every checkpoint against the config, reading headers only."""
    if source.path is None:
        return
    if not isinstance(source.config, FamilyConfig):
        from avatar_cli.families.wan_s2v import model_dir as wan

        wan.check_or_fail(source.config)
        return
    for comp, (filename, cls) in COMPONENTS.items():
        check_checkpoint(source.path / filename, build_meta(cls, getattr(source.config, comp)))


def load_modules(source: ModelSource, skip: Collection[str] = ()) -> dict[str, Module]:
    """skip: components not to load (the text encoder of a job whose prompt is in the text cache)."""
    if not isinstance(source.config, FamilyConfig):
        from avatar_cli.families.wan_s2v import model_dir as wan

        if not skip:
            modules = wan.load_components(source.config)
        else:
            loaders = {"text": wan.load_text, "audio": wan.load_audio, "dit": wan.load_dit, "vae": wan.load_vae}
            modules = {name: load(source.config) for name, load in loaders.items() if name not in skip}
        if source.lora is not None and "dit" in modules:
            modules["dit"].after_load = source.lora  # placement merges it once the weights are loaded
        return modules
    modules = {}
    for i, (comp, (filename, cls)) in enumerate(COMPONENTS.items()):
        if comp in skip:
            continue  # after enumerate: the other components keep their random-init seeds
        params = getattr(source.config, comp)
        if source.path is None:
            modules[comp] = random_module(comp, cls, params, seed=RANDOM_SEED + i)
        else:
            modules[comp] = load_module(comp, cls, params, source.path / filename)
    return modules


FAMILIES = ("mini", "wan-s2v")


def init_family_dir(directory: Path, size: str, seed: int = 0, family: str = "mini") -> ModelSource:
    """Write a randomly initialised model directory in the family's real format (`avatar models init`)."""
    if family not in FAMILIES:
        raise InputError(f"unknown family '{family}' (choose from {', '.join(FAMILIES)})")
    if family == "wan-s2v":
        from avatar_cli.families.wan_s2v import model_dir as wan

        return ModelSource(str(directory), wan.init_dir(directory, size, seed), directory)
    init_model_dir(directory, size, seed)
    return ModelSource(str(directory), SIZES[size], directory)


def init_model_dir(directory: Path, size: str, seed: int = 0) -> dict[str, Module]:
    """Write a randomly initialised mini model directory in the real format."""
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


def param_count(source: ModelSource) -> int:
    """Parameters of every component, counted on the meta device (nothing is read or allocated)."""
    if isinstance(source.config, FamilyConfig):
        cfg = source.config
        return sum(sum(p.numel() for p in build_meta(cls, getattr(cfg, comp)).parameters())
                   for comp, (_, cls) in COMPONENTS.items())
    from avatar_cli.modules.tensor_files import read_header

    return sum(info.numel for comp in source.config.files.values() if comp.weights is not None
               for info in read_header(comp.weights).values())


def check_directory(directory: Path) -> dict:
    """`avatar models check`: a report (dict) of a model directory, from headers only."""
    from avatar_cli.families.wan_s2v import files as wan_files
    from avatar_cli.families.wan_s2v import model_dir as wan
    from avatar_cli.modules.tensor_files import CheckpointFormatError

    directory = directory.expanduser()
    if not directory.is_dir():
        raise InputError(f"models check: {directory}: not a directory")
    if wan_files.looks_like(directory):
        try:
            r = wan.check_path(directory)
        except CheckpointFormatError as e:
            raise InputError(f"models check: {e}") from None
        comps = {name: {"tensors": c.tensors, "params": c.params, "bytes": c.nbytes, "dtypes": c.dtypes,
                        "checked": c.expected_from is not None, "missing": c.missing, "unexpected": c.unexpected,
                        "mis_shaped": [[n, list(f), list(e)] for n, f, e in c.mis_shaped],
                        "wrong_dtype": [list(x) for x in c.wrong_dtype], "problems": c.problems, "ok": c.ok}
                 for name, c in r.components.items()}
        bad = [name for name, c in r.components.items() if not c.ok]
        return {"path": str(directory), "family": "wan-s2v", "layout": r.layout, "ok": r.ok,
                "components": comps, "lines": r.lines(),
                "summary": "ok" if r.ok else "problems in " + ", ".join(bad) + " (see the report above)"}
    source = ModelSource(str(directory), read_config(directory), directory)
    try:
        check_model(source)
        ok, problem = True, ""
    except InputError as e:
        ok, problem = False, str(e)
    lines = [f"{directory} (mini)", f"params: {param_count(source):,}" if ok else problem]
    return {"path": str(directory), "family": "mini", "layout": "mini", "ok": ok, "components": {},
            "lines": lines + (["ok"] if ok else []), "summary": "ok" if ok else problem}
