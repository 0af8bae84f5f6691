"""A mini model directory: `config.json` (a FamilyConfig) plus one safetensors file per component; its check, its
load, `avatar models init` of a random one, and the family's spec for the registry (`MINI`)."""

import inspect
import json
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path

import torch

from avatar_cli.errors import InputError
from avatar_cli.families.mini.config import COMPONENTS, SIZES, FamilyConfig
from avatar_cli.families.mini.family import MiniFamily
from avatar_cli.families.mini import text as text_module
from avatar_cli.families.mini.layers import per_row
from avatar_cli.families.mini.text import tokenize
from avatar_cli.families.source import RANDOM_SEED, FamilySpec, ModelSource
from avatar_cli.modules.digest import file_digest, text_digest
from avatar_cli.modules.module import Module, build_meta, check_checkpoint, load_module, random_module


def recognises(directory: Path) -> bool:
    return (directory / "config.json").is_file()


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


def family(config: FamilyConfig, mode: str) -> MiniFamily:
    if mode != "clip":
        raise ValueError(f"mode: '{mode}': the mini family renders in clip mode only")
    return MiniFamily(config)


def check_model(source: ModelSource) -> None:
    """Strict name/shape check of every checkpoint against the config, reading headers only."""
    if source.path is None:
        return
    for comp, (filename, cls) in COMPONENTS.items():
        check_checkpoint(source.path / filename, build_meta(cls, getattr(source.config, comp)))


def load_modules(source: ModelSource, skip: Collection[str] = ()) -> dict[str, Module]:
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


def init_dir(directory: Path, size: str, seed: int = 0) -> FamilyConfig:
    init_model_dir(directory, size, seed)
    return SIZES[size]


def param_count(source: ModelSource) -> int:
    """Parameters of every component, counted on the meta device (nothing is read or allocated)."""
    cfg = source.config
    return sum(sum(p.numel() for p in build_meta(cls, getattr(cfg, comp)).parameters())
               for comp, (_, cls) in COMPONENTS.items())


def weight_files(source: ModelSource) -> list[Path]:
    return [source.path / filename for filename, _ in COMPONENTS.values()]


def report(directory: Path) -> dict:
    """`avatar models check` of a mini directory: its config read, every checkpoint checked from its header."""
    source = ModelSource(MINI, str(directory), read_config(directory), directory)
    try:
        check_model(source)
        ok, problem = True, ""
    except InputError as e:
        ok, problem = False, str(e)
    lines = [f"{directory} (mini)", f"params: {param_count(source):,}" if ok else problem]
    return {"path": str(directory), "family": "mini", "layout": "mini", "ok": ok, "components": {},
            "lines": lines + (["ok"] if ok else []), "summary": "ok" if ok else problem}


def prompt_identity(source: ModelSource) -> tuple[str, str, str]:
    """The text encoder's weights (for a random init: its config, seed and torch's generator) with its code (a
    change to how it computes, such as layers.per_row's padding, makes other bits from the same weights), and the
    tokenizer, which is code too: its rule, its vocabulary and its length limit. No negative prompt."""
    p = source.config.text
    if source.path is None:
        weights = text_digest(f"{source.fingerprint}:{RANDOM_SEED}:{json.dumps(asdict(p))}:{torch.__version__}")
    else:
        weights = file_digest(source.path / COMPONENTS["text"][0])
    encoder = text_digest(weights + inspect.getsource(text_module) + inspect.getsource(per_row))
    tokenizer = text_digest(inspect.getsource(tokenize) + json.dumps([list(p.vocab), p.max_tokens]))
    return encoder, tokenizer, ""


MINI = FamilySpec(
    name="mini", family=family, recognises=recognises, read=read_config, check=check_model, load=load_modules,
    init=init_dir, param_count=param_count, report=report, weight_files=weight_files, sizes=("mini", "tiny"),
    modes=("clip",), prompt_identity=prompt_identity, shipped={"mini": SIZES["mini"]})
