"""The toy family's directory format (`toy.json` + net.safetensors + text.safetensors) and its FamilySpec."""

import json
from collections.abc import Collection
from pathlib import Path

from avatar_cli.errors import InputError
from avatar_cli.families.source import RANDOM_SEED, FamilySpec, ModelSource
from avatar_cli.modules.digest import file_digest, text_digest
from avatar_cli.modules.module import Module, build_meta, check_checkpoint, load_module, random_module
from tests.toy_family.family import ToyFamily
from tests.toy_family.model import ToyNet, ToyParams, ToyText

FILES = {"net": ("net.safetensors", ToyNet), "text": ("text.safetensors", ToyText)}
SIZES = {"tiny": ToyParams()}


def recognises(directory: Path) -> bool:
    return (directory / "toy.json").is_file()


def read(directory: Path) -> ToyParams:
    try:
        return ToyParams(**json.loads((directory / "toy.json").read_text()))
    except (ValueError, TypeError) as e:
        raise InputError(f"model: {directory / 'toy.json'}: {e}") from None


def family(config: ToyParams, mode: str) -> ToyFamily:
    return ToyFamily(config)


def check(source: ModelSource) -> None:
    for filename, cls in FILES.values():
        check_checkpoint(source.path / filename, build_meta(cls, source.config))


def load(source: ModelSource, skip: Collection[str] = ()) -> dict[str, Module]:
    out = {}
    for i, (name, (filename, cls)) in enumerate(FILES.items()):
        if name in skip:
            continue
        out[name] = (random_module(name, cls, source.config, RANDOM_SEED + i) if source.path is None
                     else load_module(name, cls, source.config, source.path / filename))
    return out


def init(directory: Path, size: str, seed: int) -> ToyParams:
    if size not in SIZES:
        raise InputError(f"unknown size '{size}' of toy (choose from {', '.join(SIZES)})")
    if directory.exists() and any(directory.iterdir()):
        raise InputError(f"{directory}: exists and is not empty; refusing to overwrite")
    directory.mkdir(parents=True, exist_ok=True)
    params = SIZES[size]
    for i, (name, (filename, cls)) in enumerate(FILES.items()):
        random_module(name, cls, params, seed + i).save(directory / filename)
    (directory / "toy.json").write_text(params.to_json() + "\n")
    return params


def param_count(source: ModelSource) -> int:
    return sum(p.numel() for _, cls in FILES.values() for p in build_meta(cls, source.config).parameters())


def report(directory: Path) -> dict:
    source = ModelSource(TOY, str(directory), read(directory), directory)
    try:
        check(source)
        ok, problem = True, ""
    except InputError as e:
        ok, problem = False, str(e)
    lines = [f"{directory} (toy)", f"params: {param_count(source):,}" if ok else problem]
    return {"path": str(directory), "family": "toy", "layout": "toy", "ok": ok, "components": {},
            "lines": lines + (["ok"] if ok else []), "summary": "ok" if ok else problem}


def weight_files(source: ModelSource) -> list[Path]:
    return [source.path / filename for filename, _ in FILES.values()]


def prompt_identity(source: ModelSource) -> tuple[str, str, str]:
    return file_digest(source.path / FILES["text"][0]), text_digest("toy word hashing"), ""


TOY = FamilySpec(name="toy", family=family, recognises=recognises, read=read, check=check, load=load, init=init,
                 param_count=param_count, report=report, weight_files=weight_files, sizes=("tiny",),
                 prompt_identity=prompt_identity)
