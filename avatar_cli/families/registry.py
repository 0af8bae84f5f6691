"""Where models come from: the families by name, one FamilySpec each (families/source.py), and a job's model
resolved through them: a shipped model by name, or any model directory a user brings, whose family is the first
registered one (newest first) that recognises it.

A family joins with one line, `register(SPEC)`: the built-in ones below, a test's toy family from its own folder.
"""

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

from avatar_cli.errors import InputError
from avatar_cli.families.mini.model_dir import MINI
from avatar_cli.families.source import RANDOM_SEED, FamilySpec, ModelSource
from avatar_cli.families.wan_s2v.spec import WAN_S2V
from avatar_cli.modules.module import Module

__all__ = ["RANDOM_SEED", "FamilySpec", "ModelSource", "register", "get", "names", "resolve_model", "with_mode",
           "with_lora", "with_dit", "model_for_spec", "check_model", "load_modules", "init_family_dir",
           "param_count", "check_directory", "shipped_names", "preset_names"]

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
FAMILIES: dict[str, FamilySpec] = {}


def register(spec: FamilySpec) -> FamilySpec:
    """Add (or replace) a family by its name. Directories are offered to the newest registration first."""
    FAMILIES.pop(spec.name, None)
    FAMILIES[spec.name] = spec
    return spec


register(MINI)  # first: mini reads any directory no other family recognises (and says what it lacks)
register(WAN_S2V)


def get(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise InputError(f"unknown family '{name}' (choose from {', '.join(FAMILIES)})")
    return FAMILIES[name]


def names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def shipped_names() -> set[str]:
    return {name for spec in FAMILIES.values() for name in spec.shipped}


def preset_names() -> set[str]:
    """Sizes a job may name without weights, for `avatar plan` (FamilySpec.presets)."""
    return {name for spec in FAMILIES.values() for name in spec.presets}


def detect(directory: Path) -> FamilySpec:
    """The family of a model directory: the newest registered one that recognises it, else the first registered
    (mini), whose reader then says what the directory lacks."""
    for spec in reversed(FAMILIES.values()):
        if spec.recognises(directory):
            return spec
    return next(iter(FAMILIES.values()))


def resolve_model(model: str, base_dir: Path) -> ModelSource:
    """A shipped name, else a directory (relative paths resolve against the job file's folder), read by the
    family that recognises it."""
    for spec in FAMILIES.values():
        if model in spec.shipped:
            directory = WEIGHTS_DIR / model
            if spec.recognises(directory):
                return ModelSource(spec, model, spec.read(directory), directory)
            return ModelSource(spec, model, spec.shipped[model], None)
        if model in spec.presets:
            return ModelSource(spec, model, spec.presets[model](), None, preset=True)
    directory = (base_dir / model).expanduser()
    if not directory.is_dir():
        names_ = ", ".join(sorted(shipped_names()))
        raise InputError(f"model: '{model}' is neither a shipped model ({names_}) nor a directory ({directory})")
    spec = detect(directory)
    return ModelSource(spec, str(directory), spec.read(directory), directory)


def with_lora(source: ModelSource, path: Path, rank: int, scale: float | None) -> ModelSource:
    """The source with the job's LoRA, checked against its DiT from headers only (InputError naming the problem)."""
    if not source.spec.takes_lora:
        takers = [s.name for s in FAMILIES.values() if s.takes_lora]
        raise InputError(f"lora: the {source.family_name} family takes no LoRA (only {', '.join(takers)} does: "
                         "LiveAvatar's)" if takers else f"lora: the {source.family_name} family takes no LoRA")
    return dataclasses.replace(source, lora=source.spec.lora(source, path, rank, scale))


def with_dit(source: ModelSource, path: Path, weights: str = "bf16") -> ModelSource:
    """The source with its DiT read from one file (a job's `dit:`), checked from the file's header (and against
    `runtime.weights`, for a file whose weights are quantized already). A size named without weights takes one too:
    `avatar plan` counts the file against it (check_model refuses it a render)."""
    if source.spec.dit_file is None or (source.path is None and not source.preset):
        raise InputError(f"dit: the {source.family_name} family reads its DiT from its model directory only")
    return dataclasses.replace(source, config=source.spec.dit_file(source, path, weights), dit=path)


def with_mode(source: ModelSource, mode: str) -> ModelSource:
    """The source rendering in the job's generation mode (InputError for a mode its family lacks)."""
    mode = getattr(mode, "value", mode)
    if mode == source.mode:
        return source
    modes = source.spec.modes
    if mode not in modes:
        if len(modes) == 1:
            raise InputError(f"mode: '{mode}': the {source.family_name} family renders in {modes[0]} mode only")
        raise InputError(f"mode: '{mode}': the {source.family_name} family renders in {' or '.join(modes)} mode")
    return dataclasses.replace(source, mode=mode)


def model_for_spec(model: str, base_dir: Path, mode: str = "clip") -> ModelSource | None:
    """The job's model in its mode, resolved while the spec loads (its family's job defaults sit under the job
    file), or None when it does not resolve (job.resolve_source then says why, with exit 2)."""
    try:
        return with_mode(resolve_model(model, base_dir), mode)
    except InputError:
        return None


def check_model(source: ModelSource) -> None:
    """Strict name/shape check of every checkpoint against the config, reading headers only; a preset (a size named
    without weights) is refused: it can be planned, not rendered."""
    if source.preset:
        raise InputError(f"model: '{source.name}' names the {source.family_name} release's size, which `avatar plan` "
                         "counts without weights; a render needs the model directory")
    if source.path is not None:
        source.spec.check(source)


def load_modules(source: ModelSource, skip: Collection[str] = ()) -> dict[str, Module]:
    """skip: components not to load (the text encoder of a job whose prompt is in the text cache)."""
    return source.spec.load(source, skip)


def init_family_dir(directory: Path, size: str | None = None, seed: int = 0, family: str = "mini") -> ModelSource:
    """Write a randomly initialised model directory in the family's real format (`avatar models init`); size None:
    the family's default size."""
    spec = get(family)
    config = spec.init(directory, size or spec.sizes[0], seed)
    return ModelSource(spec, str(directory), config, directory)


def param_count(source: ModelSource) -> int:
    """Parameters of every component, from headers or meta builds (no tensor data is read or allocated)."""
    return source.spec.param_count(source)


def check_directory(directory: Path) -> dict:
    """`avatar models check`: a report (dict) of a model directory, from headers only."""
    directory = directory.expanduser()
    if directory.is_file():  # a single-file DiT (wan-s2v: ComfyUI safetensors, GGUF)
        spec = next((s for s in reversed(FAMILIES.values()) if s.dit_file is not None and s.recognises(directory)),
                    None)
        if spec is None:
            raise InputError(f"models check: {directory}: not a model directory nor a DiT file (.safetensors, .gguf)")
        return spec.report(directory)
    if not directory.is_dir():
        raise InputError(f"models check: {directory}: not a directory")
    return detect(directory).report(directory)
