"""What names a model's prompt encodings: its identity (encoder and tokenizer digests, negative prompt), the dtype
its encoder runs in and the format its weights are held in (`runtime.weights`), and the components only the prompt
step uses."""

import torch

from avatar_cli.families.base import Family
from avatar_cli.families.source import ModelSource
from avatar_cli.prompts.entry import EntryKey
from avatar_cli.runtime.quantize import check_weights


def identity(source: ModelSource) -> tuple[str, str, str] | None:
    """What makes the source's prompt encodings equal (encoder digest, tokenizer digest, negative prompt): its
    family spec's prompt identity; None when the family declares none (its prompts are then never cached)."""
    of = source.spec.prompt_identity
    return of(source) if of is not None else None


def prompt_components(family: Family) -> tuple[str, ...]:
    """The components only the prompt step uses: what a job whose prompt is cached need not load."""
    others = {n for step, names in family.needs.items() if step != "prompt" for n in names}
    return tuple(n for n in family.needs.get("prompt", ()) if n not in others)


def encoder_dtype(family: Family, dtype: torch.dtype) -> torch.dtype:
    """The dtype the prompt step's components run in (placement keeps the family's float32 ones float32)."""
    names = family.needs.get("prompt", ())
    return torch.float32 if names and all(n in family.parallel.float32 for n in names) else dtype


def encoder_weights(family: Family, weights: str) -> str:
    """The `runtime.weights` format the prompt step's components are held in under the job's `weights`: the job's
    when the family quantizes one of them (ParallelPlan.quantized: wan-s2v's umT5), else bf16 (as loaded)."""
    check_weights(weights)
    names = family.needs.get("prompt", ())
    quantized = any(family.parallel.quantized_paths(n) is not None for n in names)
    return weights if quantized else "bf16"


def encoder_label(dtype: torch.dtype, weights: str) -> str:
    """The key's `dtype` field: the dtype the encoder runs in, and the format of its quantized weights if any
    ("bfloat16", "bfloat16+int8", "float32+fp8"). bf16 adds nothing, so entries written before quantized encoders
    existed keep their keys."""
    name = str(dtype).removeprefix("torch.")
    return name if weights == "bf16" else f"{name}+{weights}"


def entry_key(family: Family, ident: tuple[str, str, str], prompt: str, dtype: torch.dtype,
              weights: str) -> EntryKey:
    """The cache key of `prompt` encoded by a model of this identity, its encoder running in `dtype` with the job's
    `runtime.weights` (which the key names only when the family quantizes its encoder: encoder_weights)."""
    encoder, tokenizer, negative = ident
    return EntryKey(family.name, encoder, tokenizer, prompt, negative,
                    encoder_label(dtype, encoder_weights(family, weights)))
