"""A PEFT LoRA file (LiveAvatar's `liveavatar.safetensors`) read, checked against a model, and merged into its
Linear weights once at load: W <- W + scale · B @ A, before any sharding or quantisation.

LiveAvatar's own loader (`add_lora_to_model`) wraps the model with `peft.get_peft_model`, loads the file with
`load_state_dict(strict=False)` and calls `merge_and_unload()`. Two consequences we do not reproduce:
- any non-LoRA tensor in the file silently overwrites the base weight of that name (`load_lora_weight_only=False`);
  here such a file is refused;
- a key that matches no PEFT parameter (a target the model lacks, a `save_pretrained` spelling without the adapter
  name) is silently ignored; here a missing target is refused and both spellings are merged.

The file carries no alpha (PEFT keeps it in adapter_config.json): the caller passes the rank it expects, and the
scale alpha / rank (LiveAvatar: 64 / 128 = 0.5; PEFT's default, not rsLoRA's alpha / sqrt(rank)).

Only headers are read up front; the merge reads one module's factors at a time, so its extra memory is one A, one
B, one fp32 delta and one fp32 copy of that module's weight (about 0.6 GB for a 14B FFN layer).
"""

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from avatar_cli.errors import InputError
from avatar_cli.modules.module import _names
from avatar_cli.modules.tensor_files import TensorInfo, read_safetensors_header

# LiveAvatar's liveavatar/configs/s2v_causal_sft.yaml.
LIVEAVATAR_RANK = 128
LIVEAVATAR_ALPHA = 64.0
LIVEAVATAR_TARGET_MODULES = ("q", "k", "v", "o", "ffn.0", "ffn.2")

# PEFT's spellings of one factor: `get_peft_model`'s in-memory state dict has the `base_model.model.` prefix and the
# adapter name (`default`); `save_pretrained` / `get_peft_model_state_dict` drop the adapter name; LiveAvatar's
# loader adds the prefix when the file lacks it. Any other adapter name is refused: merging one of several adapters
# found in a file would be a guess.
_FACTOR_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class LoraFactors:
    """One target's factors as stored (names as in the file, shapes known from the header)."""

    a_key: str
    b_key: str
    a: TensorInfo  # (r, in)
    b: TensorInfo  # (out, r)

    @property
    def num_params(self) -> int:
        return self.a.numel + self.b.numel


@dataclass(frozen=True)
class LoraFile:
    """A checked LoRA file: target module name (the model's spelling, e.g. `blocks.0.self_attn.q`) -> factors."""

    path: Path
    rank: int
    modules: dict[str, LoraFactors]

    @property
    def num_params(self) -> int:
        return sum(f.num_params for f in self.modules.values())


def lora_scale(alpha: float = LIVEAVATAR_ALPHA, rank: int = LIVEAVATAR_RANK) -> float:
    """PEFT's LoRA scaling (use_rslora=False): alpha / rank."""
    return alpha / rank


def peft_targets(model: nn.Module, target_modules: tuple[str, ...] = LIVEAVATAR_TARGET_MODULES) -> list[str]:
    """The Linear modules that `LoraConfig(target_modules=[...])` wraps: PEFT matches a list entry against the whole
    module name or any dotted suffix of it, so `q` also hits `audio_injector.injector.N.q`."""
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t) for t in target_modules)]


def read_lora(path: str | Path, rank: int = LIVEAVATAR_RANK) -> LoraFile:
    """Read a LoRA safetensors' header and check it is nothing but pairs of rank-`rank` factors. Tensor data is
    read later, one module at a time, by `merge_lora`. Every refusal is an InputError naming the key(s)."""
    path = Path(path)
    where = f"lora: {path}"
    header = read_safetensors_header(path)
    if not header:
        raise InputError(f"{where}: holds no tensors")

    stray = [k for k in header if not _FACTOR_KEY.fullmatch(k)]
    if stray:
        raise InputError(f"{where}: {len(stray)} tensor(s) are not LoRA factors (only <module>.lora_A/lora_B"
                         f"[.default].weight are merged; LiveAvatar's loader would overwrite base weights with "
                         f"them): {_names(sorted(stray))}")

    found: dict[str, dict[str, str]] = {}  # module -> {"A": key, "B": key}
    for key in header:
        m = _FACTOR_KEY.fullmatch(key)
        slot = found.setdefault(m["module"], {})
        if m["ab"] in slot:
            raise InputError(f"{where}: {slot[m['ab']]} and {key} are the same factor of {m['module']} "
                             "(two spellings in one file)")
        slot[m["ab"]] = key

    unpaired = [f"{next(iter(s.values()))} (no lora_{'B' if 'A' in s else 'A'})" for s in found.values() if len(s) < 2]
    if unpaired:
        raise InputError(f"{where}: factor(s) without their partner: {_names(sorted(unpaired))}")

    modules: dict[str, LoraFactors] = {}
    for module, slot in found.items():
        f = LoraFactors(slot["A"], slot["B"], header[slot["A"]], header[slot["B"]])
        for key, info in ((f.a_key, f.a), (f.b_key, f.b)):
            if len(info.shape) != 2 or info.dtype not in _FLOAT_DTYPES:
                raise InputError(f"{where}: {key} is {info.dtype} {list(info.shape)}; a LoRA factor is a 2-D "
                                 "float matrix")
        if f.a.shape[0] != f.b.shape[1]:
            raise InputError(f"{where}: rank mismatch: {f.a_key} has {f.a.shape[0]} rows but {f.b_key} has "
                             f"{f.b.shape[1]} columns")
        if f.a.shape[0] != rank:
            raise InputError(f"{where}: rank mismatch: {f.a_key} {list(f.a.shape)} is rank {f.a.shape[0]}, the "
                             f"configured rank is {rank}")
        modules[module] = f
    return LoraFile(path, rank, modules)


def check_lora(model: nn.Module, lora: LoraFile) -> dict[str, nn.Linear]:
    """The model's Linear for each target, refusing (InputError, by name) a target the model lacks or whose weight
    the factors do not fit: A (r, in), B (out, r) for W (out, in). Reads no tensor data; works on a meta model."""
    where = f"lora: {lora.path}"
    layers, missing = {}, []
    for name in lora.modules:
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            layer = None
        if isinstance(layer, nn.Linear):
            layers[name] = layer
        else:
            missing.append(name if layer is None else f"{name} (a {type(layer).__name__}, not a Linear)")
    if missing:
        raise InputError(f"{where}: {len(missing)} target(s) not in the base model: {_names(sorted(missing))}")
    for name, layer in layers.items():
        f = lora.modules[name]
        out_f, in_f = layer.weight.shape
        if f.a.shape[1] != in_f or f.b.shape[0] != out_f:
            raise InputError(f"{where}: {f.a_key} {list(f.a.shape)} and {f.b_key} {list(f.b.shape)} do not fit "
                             f"{name}.weight [{out_f}, {in_f}] (A is [rank, in], B is [out, rank])")
    return layers


def merge_lora(model: nn.Module, lora: LoraFile, scale: float) -> int:
    """W <- W + scale · B @ A for every target, in float32 then cast back to W's dtype (one rounding, which is
    what PEFT's merge_and_unload gives with its fp32 adapters), in place. Everything is checked before the first
    weight changes; only non-finite factors are found mid-way (the model is then partly merged: discard it).
    Runs once, on loaded plain weights (not meta, not sharded). Returns the number of merged modules."""
    layers = check_lora(model, lora)
    for name, layer in layers.items():
        w = layer.weight
        if w.is_meta or isinstance(w, DTensor) or w.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"merge_lora: {name}.weight is {'meta' if w.is_meta else type(w).__name__} "
                             f"{w.dtype}; merge into loaded, unsharded float weights (before sharding/quantising)")
    with torch.no_grad(), safe_open(str(lora.path), framework="pt", device="cpu") as fh:
        for name, layer in layers.items():
            f, w = lora.modules[name], layer.weight
            # copy=True: a fresh, aligned buffer even when the file is already fp32 (safetensors' views sit at
            # arbitrary byte offsets, and unaligned BLAS paths round differently).
            a = fh.get_tensor(f.a_key).to(w.device, torch.float32, copy=True)  # (r, in)
            b = fh.get_tensor(f.b_key).to(w.device, torch.float32, copy=True)  # (out, r)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise InputError(f"lora: {lora.path}: {f.a_key} or {f.b_key} holds NaN or inf")
            delta = (b @ a) * scale  # (out, in) fp32, PEFT's get_delta_weight order
            w.copy_((w.float() + delta).to(w.dtype))  # (out, in)
            del a, b, delta
    return len(layers)
