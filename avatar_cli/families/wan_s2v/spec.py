"""The wan-s2v family as the registry knows it (`WAN_S2V`): a Wan2.2-S2V release directory in either layout,
recognised by its file names, rendered in clip mode (the official loop) or streaming mode (LiveAvatar's, with
its LoRA).

model_dir (transformers' config classes) and the family's modules are imported when a wan-s2v directory is
actually read, so that a job of another family never pays for them.
"""

import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

from avatar_cli.errors import InputError
from avatar_cli.families.base import Family
from avatar_cli.families.source import FamilySpec, ModelSource
from avatar_cli.families.wan_s2v import files as wan_files  # file names only: no transformers import
from avatar_cli.modules.digest import file_digest, folder_digest, text_digest
from avatar_cli.modules.module import Module
from avatar_cli.modules.tensor_files import CheckpointFormatError, read_header

MODES = ("clip", "streaming")


def read_config(directory: Path) -> Any:
    from avatar_cli.families.wan_s2v import model_dir

    return model_dir.read_config(directory)


def family(config: Any, mode: str) -> Family:
    from avatar_cli.families.wan_s2v.live import family_for_mode

    return family_for_mode(config, mode)


def check_model(source: ModelSource) -> None:
    from avatar_cli.families.wan_s2v import model_dir

    model_dir.check_or_fail(source.config)


def load_modules(source: ModelSource, skip: Collection[str] = ()) -> dict[str, Module]:
    from avatar_cli.families.wan_s2v import model_dir as wan
    from avatar_cli.families.wan_s2v.family import QUANTIZED

    # A scaled-FP8 DiT file keeps its FP8 Linears where runtime.weights would quantize, except under a LoRA,
    # which merges into float weights.
    keep_fp8 = dict(QUANTIZED)["dit"] if source.lora is None else ()
    loaders = {"text": wan.load_text, "audio": wan.load_audio, "dit": lambda cfg: wan.load_dit(cfg, keep_fp8),
               "vae": wan.load_vae}
    modules = {name: load(source.config) for name, load in loaders.items() if name not in skip}
    if source.lora is not None and "dit" in modules:
        modules["dit"].after_load = source.lora  # placement merges it once the weights are loaded
    return modules


def init_dir(directory: Path, size: str, seed: int = 0) -> Any:
    from avatar_cli.families.wan_s2v import model_dir

    return model_dir.init_dir(directory, size, seed)


def param_count(source: ModelSource) -> int:
    """From the headers: every tensor of every component file (a `dit:` file's through dit_file.inspect)."""
    total = 0
    for name, comp in source.config.files.items():
        if comp.weights is None:
            continue
        if name == "dit" and source.config.dit_file is not None:
            from avatar_cli.families.wan_s2v.dit_file import inspect

            total += sum(math.prod(s) for s in inspect(comp.weights).shapes.values())
        else:
            total += sum(info.numel for info in read_header(comp.weights).values())
    return total


def weight_files(source: ModelSource) -> list[Path]:
    return source.config.weight_files()


def report(directory: Path) -> dict:
    """`avatar models check` of a release directory, from headers only."""
    from avatar_cli.families.wan_s2v import model_dir

    try:
        r = model_dir.check_path(directory)
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


def dit_file(source: ModelSource, path: Path, weights: str) -> Any:
    """The config with its DiT from one file (a job's `dit:`), checked from the file's header against the job's
    `runtime.weights`."""
    from avatar_cli.families.wan_s2v import model_dir

    return model_dir.with_dit_file(source.config, path, weights)


def recognises(path: Path) -> bool:
    """A release directory in either layout (file names only), or a single-file DiT (`avatar models check`)."""
    return wan_files.looks_like(path) or (path.is_file() and path.suffix in (".safetensors", ".gguf"))


def prompt_identity(source: ModelSource) -> tuple[str, str, str]:
    """umT5's weights (the index and each shard of a sharded Diffusers text_encoder/, and its config.json), the
    tokenizer folder, and the S2V negative prompt encoded with every prompt."""
    from avatar_cli.families.wan_s2v.text import S2V_NEGATIVE_PROMPT

    files = source.config.files
    weights = files["t5"].weights
    if weights.name.endswith(".index.json"):  # Diffusers' sharded text_encoder/: the index and each shard
        shards = sorted(set(json.loads(weights.read_text())["weight_map"].values()))
        encoder = text_digest(file_digest(weights) + "".join(file_digest(weights.parent / s) for s in shards))
    else:
        encoder = file_digest(weights)
    config = files["t5"].config  # Diffusers' text_encoder/config.json; the official .pth has none
    if config is not None and config.is_file():
        encoder = text_digest(encoder + config.read_text())
    return encoder, folder_digest(files["tokenizer"].root), S2V_NEGATIVE_PROMPT


def lora(source: ModelSource, path: Path, rank: int, scale: float | None) -> Any:
    """LiveAvatar's LoRA, checked against the DiT from headers only."""
    from avatar_cli.families.wan_s2v.lora import checked_lora

    dit = source.config.dit_file
    if dit is not None and Path(dit).suffix == ".gguf":
        raise InputError(f"lora: {path}: a GGUF DiT ({dit}) keeps its weights quantized, so no LoRA can be "
                         "merged into them; use the bf16 or FP8-scaled DiT with a LoRA")

    return checked_lora(source.config.dit, path, rank, scale)


def release_config() -> Any:
    """The released Wan2.2-S2V-14B's sizes (its DiT config.json, the official umT5-XXL and VAE), without files: what
    `avatar plan` counts for a job naming `model: wan-s2v-14b`."""
    from avatar_cli.families.wan_s2v import model_dir
    from avatar_cli.families.wan_s2v.dit import WanDiTParams

    return model_dir.WanS2VConfig(Path("wan-s2v-14b"), wan_files.OFFICIAL, WanDiTParams.full(),
                                  model_dir.VAE_PRESETS["release"], model_dir.T5_PRESETS["release"], "release", "release")


def budget(config: Any, mode: str, size: tuple[int, int], dtype: Any, steps: int, guidance: float,
           weights: str = "bf16", vae_dtype: Any = None) -> Any:
    import torch

    from avatar_cli.families.wan_s2v.budget import budget as count

    return count(config, mode, size, dtype, steps, guidance, weights, vae_dtype or torch.float32)


WAN_S2V = FamilySpec(
    name="wan-s2v", family=family, recognises=recognises, read=read_config, check=check_model,
    load=load_modules, init=init_dir, param_count=param_count, report=report, weight_files=weight_files,
    sizes=("tiny",), modes=MODES, prompt_identity=prompt_identity, lora=lora, dit_file=dit_file,
    presets={"wan-s2v-14b": release_config}, budget=budget)
