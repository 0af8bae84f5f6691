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

Only headers are read up front (`checked_lora`, when a job is prepared); the merge reads one module's factors at a
time, so its extra memory is one A, one B, one fp32 delta and one fp32 copy of that module's weight (about 0.6 GB
for a 14B FFN layer). A render merges at load (`LoraMerge`, the DiT's `Module.after_load`): in one process into
the whole weights; under FSDP2 each rank into its own rows of each weight, right after it read them, before any
all-gather, so no rank ever holds a whole weight for it.
"""

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from avatar_cli.errors import InputError
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.modules.module import _names, build_meta
from avatar_cli.modules.tensor_files import CheckpointFormatError, TensorInfo, read_safetensors_header

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
    Runs once, on loaded plain weights (not meta, not sharded: see merge_lora_sharded). Returns the number of
    merged modules."""
    layers = check_lora(model, lora)
    for name, layer in layers.items():
        w = layer.weight
        if w.is_meta or isinstance(w, DTensor) or w.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"merge_lora: {name}.weight is {'meta' if w.is_meta else type(w).__name__} "
                             f"{w.dtype}; merge into loaded, unsharded float weights (before sharding/quantising)")
    with torch.no_grad(), safe_open(str(lora.path), framework="pt", device="cpu") as fh:
        for name, layer in layers.items():
            _add_delta(fh, lora, lora.modules[name], layer.weight, 0, scale)
    return len(layers)


def merge_lora_sharded(model: nn.Module, lora: LoraFile, scale: float) -> int:
    """merge_lora on a model FSDP2 has sharded (every target weight a DTensor, Shard(0) over a 1-D mesh) and
    this rank has materialised: only this rank's rows change, W[rows] <- W[rows] + scale · B[rows] @ A, with the
    arithmetic of merge_lora, so the ranks' rows together are the whole merged weight bit for bit. The rows are
    DTensor's split of dim 0 (what loading.materialize reads into the shard); FSDP2's padding rows stay zero.
    Every rank reads the whole of A and B (a 14B FFN's B is 3.5 MB in bf16), so a non-finite factor is refused
    on every rank alike. Returns the number of merged modules."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    layers = check_lora(model, lora)
    rows: dict[str, int] = {}  # target -> its first row on this rank
    for name, layer in layers.items():
        w = layer.weight
        if not isinstance(w, DTensor) or tuple(w.placements) != (Shard(0),) or w.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"merge_lora_sharded: {name}.weight is {type(w).__name__} "
                             f"{getattr(w, 'placements', '')} {w.dtype}; expected FSDP2's Shard(0) DTensor of floats")
        local_shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
        if tuple(local_shape) != tuple(w.to_local().shape) or w.to_local().is_meta:
            raise ValueError(f"merge_lora_sharded: {name}.weight: local shard {list(w.to_local().shape)} on "
                             f"{w.to_local().device} is not this rank's materialised rows {list(local_shape)}")
        rows[name] = offset[0]
    with torch.no_grad(), safe_open(str(lora.path), framework="pt", device="cpu") as fh:
        for name, layer in layers.items():
            # to_local(): a view of the storage FSDP2 all-gathers from, so the merge is what every forward sees
            _add_delta(fh, lora, lora.modules[name], layer.weight.to_local(), rows[name], scale)
    return len(layers)


def _add_delta(fh, lora: LoraFile, f: LoraFactors, w: torch.Tensor, row0: int, scale: float) -> None:
    """w (rows, in), rows [row0, row0 + rows) of a target's weight, in place: += scale · B[rows] @ A, computed
    in float32 and rounded once to w's dtype."""
    # copy=True: fresh, aligned buffers even when the file is already fp32 (safetensors' views sit at arbitrary
    # byte offsets, and unaligned BLAS paths round differently).
    a = fh.get_tensor(f.a_key).to(w.device, torch.float32, copy=True)  # (r, in)
    b = fh.get_tensor(f.b_key).to(w.device, torch.float32, copy=True)  # (out, r)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise InputError(f"lora: {lora.path}: {f.a_key} or {f.b_key} holds NaN or inf")
    if w.shape[0] != b.shape[0]:
        b = b[row0:row0 + w.shape[0]].clone()  # (rows, r) this rank's rows, in a fresh aligned buffer
    delta = (b @ a) * scale  # (rows, in) fp32, PEFT's get_delta_weight order
    w.copy_((w.float() + delta).to(w.dtype))  # (rows, in)


@dataclass(frozen=True)
class LoraMerge:
    """A LoRA to merge into the DiT once its weights are loaded (`Module.after_load`): whole in one process, or
    this rank's FSDP2 rows under several. Checked against the model (headers only) by `checked_lora`."""

    lora: LoraFile
    scale: float

    @property
    def path(self) -> Path:
        return self.lora.path

    def __call__(self, model: nn.Module) -> None:
        sharded = any(isinstance(layer.weight, DTensor) for layer in check_lora(model, self.lora).values())
        (merge_lora_sharded if sharded else merge_lora)(model, self.lora, self.scale)

    def part(self, prefix: str, exclude: tuple[str, ...] = ()) -> "LoraMerge":
        """The merge of the targets under `prefix` (a submodule's name and a dot, "" for the whole model), named
        from that submodule, leaving out those under `exclude`: a model read a part at a time (runtime/quantize.py
        load_quantized) merges each part right after reading it. Same arithmetic per target as the whole merge."""
        modules = {n[len(prefix):]: f for n, f in self.lora.modules.items()
                   if n.startswith(prefix) and not n.startswith(tuple(exclude))}
        return LoraMerge(dataclasses.replace(self.lora, modules=modules), self.scale)


def checked_lora(dit: WanDiTParams, path: str | Path, rank: int = LIVEAVATAR_RANK,
                 scale: float | None = None) -> LoraMerge:
    """The job's LoRA read (headers only) and checked against the DiT `dit` describes, built on meta: cheap at
    14B. scale None: LiveAvatar's alpha / rank, 0.5, which only a rank-128 LoRA may assume (the file carries no
    alpha). Every refusal is an InputError naming the key or tensor."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"lora: {path}: no such file")
    if scale is None and rank != LIVEAVATAR_RANK:
        raise InputError(f"lora_scale: not set for a rank-{rank} LoRA; give its alpha / rank (the default, "
                         f"{lora_scale():g}, is LiveAvatar's alpha {LIVEAVATAR_ALPHA:g} / rank {LIVEAVATAR_RANK})")
    try:
        lora = read_lora(path, rank)
    except CheckpointFormatError as e:
        raise InputError(f"lora: {e}") from None
    check_lora(build_meta(WanS2VDiT, dit), lora)
    return LoraMerge(lora, lora_scale() if scale is None else scale)
