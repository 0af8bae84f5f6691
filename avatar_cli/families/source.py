"""What the registry knows of a family (`FamilySpec`), and a model it resolved (`ModelSource`).

A family folder defines one FamilySpec (mini: families/mini/model_dir.py, wan-s2v: families/wan_s2v/spec.py) and
families/registry.py registers it by name, as torchtitan's ModelSpec or FLUX's configs do: nothing outside the
family folder and the registry's one line names a family. Everything about the family's model directory goes
through its spec: recognising one, reading and checking it, loading it (skipping components), writing a random
one (`avatar models init`), counting its parameters, reporting `avatar models check`, the prompt-cache identity
of its text encoder, its generation modes and whether it takes a LoRA.
"""

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from avatar_cli.families.base import Family
from avatar_cli.modules.module import Module

RANDOM_SEED = 0  # the seeded random init that stands in for a shipped model without weights


@dataclass(frozen=True, eq=False)
class FamilySpec:
    """One model family, as the registry knows it. Every function raises InputError naming the problem.

    name: the family's name (`models init --family`, reports, the text cache's key).
    modes: the generation modes it renders, the first the default (`mode:` in a job).
    sizes: the sizes `models init --size` writes, the first the default.
    family: (config, mode) -> the Family object that renders in that mode.
    recognises: whether a directory is this family's (cheap: file names, a small JSON file).
    read: a directory -> its config, consistency checked: the family's own description, with a `size` (named in
      `avatar models`) and `to_json()` (the resume fingerprint hashes it).
    check: a strict name/shape check of every checkpoint of a source, reading headers only.
    load: (source, components to skip) -> the loaded Modules (a source without a path: a seeded random init).
    init: (directory, size, seed) -> the config of the random model directory it wrote there.
    param_count: parameters of every component of a source, without reading tensor data.
    report: `avatar models check` of a directory: a dict (path, family, layout, ok, components, lines, summary).
    weight_files: the files a render reads weights from (the resume fingerprint hashes them).
    prompt_identity: source -> (text encoder digest, tokenizer digest, negative prompt): what makes its prompt
      encodings equal, the text cache's key; None: the family's prompts are not cached (a render says so).
    lora: (source, path, rank, scale) -> the checked LoRA the DiT merges at load; None: the family takes none.
    dit_file: (source, path, runtime.weights) -> its config with the DiT read from that one file (a job's `dit:`);
      None: the family reads its DiT from the model directory only.
    shipped: shipped model name -> its size (weights under avatar_cli/weights/<name>, else a random init).
    presets: sizes a job may name without weights (`model: wan-s2v-14b`), name -> a function giving the config:
      `avatar plan` counts them on the meta device; a render refuses them (it needs the weights).
    budget: (config, mode, (width, height), dtype, steps, guidance, weights, vae_dtype) -> runtime.budget.Budget,
      the family's work counted on meta (`avatar plan`; `runtime.weights`, the VAE's dtype); None: it has none.
    """

    name: str
    family: Callable[[Any, str], Family]
    recognises: Callable[[Path], bool]
    read: Callable[[Path], Any]
    check: Callable[["ModelSource"], None]
    load: Callable[["ModelSource", Collection[str]], dict[str, Module]]
    init: Callable[[Path, str, int], Any]
    param_count: Callable[["ModelSource"], int]
    report: Callable[[Path], dict]
    weight_files: Callable[["ModelSource"], list[Path]]
    sizes: tuple[str, ...]
    modes: tuple[str, ...] = ("clip",)
    prompt_identity: Callable[["ModelSource"], tuple[str, str, str]] | None = None
    lora: Callable[["ModelSource", Path, int, float | None], Any] | None = None
    dit_file: Callable[["ModelSource", Path, str], Any] | None = None
    shipped: Mapping[str, Any] = field(default_factory=dict)
    presets: Mapping[str, Callable[[], Any]] = field(default_factory=dict)
    budget: Callable[..., Any] | None = None

    @property
    def takes_lora(self) -> bool:
        return self.lora is not None


@dataclass(frozen=True, eq=False)
class ModelSource:
    """A model a job names, resolved: its family's spec, its config, where its weights are, how it renders."""

    spec: FamilySpec
    name: str
    config: Any  # the family's own description: mini's FamilyConfig, wan-s2v's WanS2VConfig, ...
    path: Path | None  # None: no weights on disk, a seeded random init stands in
    lora: Any = None  # the LoRA merged into the DiT at load (the family's checked LoRA), from the job
    mode: str = "clip"  # the generation mode, one of spec.modes
    preset: bool = False  # a size named without weights (FamilySpec.presets): `avatar plan` only
    dit: Path | None = None  # the job's DiT file, read instead of the directory's (spec.dit_file)

    @property
    def trained(self) -> bool:
        return self.path is not None

    @property
    def location(self) -> str:
        return str(self.path) if self.path else f"built in (random init, seed {RANDOM_SEED}; no weights shipped yet)"

    @property
    def family_name(self) -> str:
        return self.spec.name

    @cached_property
    def family(self) -> Family:
        """The family that knows these models, in this source's mode (one object per source: it may cache its
        tokenizer)."""
        return self.spec.family(self.config, self.mode)

    def weight_files(self) -> list[Path]:
        """The files a render reads weights from (the resume fingerprint hashes their size, mtime, header)."""
        return [] if self.path is None else self.spec.weight_files(self)

    @property
    def fingerprint(self) -> str:
        """Names the weights a render runs with: jobs of a batch that share it share one load."""
        base = str(self.path) if self.path else f"{self.name}:random:{RANDOM_SEED}"
        base += "" if self.dit is None else f"+dit:{self.dit}"
        return base if self.lora is None else f"{base}+lora:{self.lora.path}:{self.lora.scale!r}"
