"""Weight-only quantization of a model's big Linears at load (`runtime.weights: bf16 | fp8 | int8`), applied from
outside the model through torchao.

- bf16: nothing changes; every weight stays in the runtime dtype (bfloat16 on GPUs, float32 on CPUs without it).
- int8: torchao's `Int8WeightOnlyConfig`: each chosen Linear's weight becomes int8 with one float32 scale per
  output channel (symmetric; torchao also keeps an int8 zero point per channel, always 0).
- fp8: torchao's `Float8WeightOnlyConfig`: float8_e4m3fn with one float32 scale per output channel.

Both are weight-only: activations stay in the runtime dtype, and every forward dequantizes the layer's weight to
it (weight x scale) and runs the ordinary matmul. So the weights stay 1 byte per parameter in memory on any device,
FP8 units or not (a CPU, a GPU below compute capability 8.9): only memory and the bytes moved shrink, not the
arithmetic. torchao's quantized weights are tensor subclasses that report the runtime dtype as their `dtype`, so the
model code that casts its input to `layer.weight.dtype` (ours, and transformers' T5 feed-forward) runs unchanged.

Which Linears: the family names them, per component (`ParallelPlan.quantized`: attribute paths from the component's
root, e.g. the DiT's `blocks`); every nn.Linear under those paths is quantized, nothing else. In practice these are
the transformer blocks' projections, which hold nearly all parameters. Norms, embeddings, the time embedding and
modulation, the head and anything the official code runs as an fp32 island stay in the runtime dtype: they are
small, and their error would act on every token at once (a modulation scales the whole residual stream).

At load (`load_quantized`, which placement calls) a lazily read model is read and quantized a block at a time, each
block's LoRA merged into its float weights first, so neither the whole model in bf16 nor a rounded LoRA ever exists.
`fp8_weight` installs a weight a checkpoint already holds in FP8 with its scales, as the same kind of tensor.
"""

from collections.abc import Iterable, Mapping

import torch
from torch import nn

WEIGHT_FORMATS = ("bf16", "fp8", "int8")


def check_weights(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"runtime.weights must be one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")


def check_setting(weights: str, family: str, quantized: tuple) -> None:
    """`runtime.weights` for a job, before any model loads: ValueError naming what is missing (torchao, or a family
    that names nothing to quantize; its ParallelPlan.quantized)."""
    check_weights(weights)
    if weights == "bf16":
        return
    if not quantized:
        raise ValueError(f"runtime.weights: {weights}: the {family} family has no weights to quantize; use bf16")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ValueError(f"runtime.weights: {weights} needs torchao: pip install 'avatar-cli[quant]'") from None


def _config(weights: str):
    """torchao's config for a format (torchao is imported only where a model is quantized or counted)."""
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, PerRow

    # set_inductor_config=False: quantizing must not change torch.compile's global settings for the whole process.
    if weights == "int8":
        return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
    if weights == "fp8":
        return Float8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
    raise ValueError(f"no quantization for runtime.weights {weights!r}")


def linears_under(model: nn.Module, under: Iterable[str]) -> dict[str, nn.Linear]:
    """name (as model.named_modules spells it) -> every nn.Linear inside the submodules at the attribute paths
    `under`: "" is the model itself, "*" stands for every child (e.g. "blocks.*.attn"), and a path may go through a
    property (UMT5Text.blocks). A path that names nothing is a ValueError: a family's list must fit its model."""
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, nn.Linear] = {}
    for path in under:
        roots = [model]
        for part in filter(None, path.split(".")):
            roots = [c for r in roots for c in (r.children() if part == "*" else [getattr(r, part, None)])
                     if c is not None]
        if not roots:
            raise ValueError(f"{type(model).__name__} has no {path!r} to quantize")
        for root in roots:
            for m in root.modules():
                if isinstance(m, nn.Linear) and id(m) in names:
                    out[names[id(m)]] = m
    return out


def is_quantized(t: torch.Tensor) -> bool:
    """A torchao quantized weight (a tensor subclass over its quantized data and scales)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t) and hasattr(t, "qdata")


def format_of(t: torch.Tensor) -> str:
    """The runtime.weights format a weight is held in: fp8, int8, or bf16 (not quantized: the runtime dtype)."""
    if not is_quantized(t):
        return "bf16"
    return "fp8" if t.qdata.dtype == torch.float8_e4m3fn else "int8"


def quantize_linears(model: nn.Module, weights: str, under: Iterable[str]) -> int:
    """Quantize, in place, every nn.Linear under the paths `under` to `weights` (fp8 | int8); bf16 leaves the model
    as it is. The weights must be loaded (or on meta, for counting), in the dtype the activations will have, and
    any LoRA already merged. A weight already in that format (e.g. installed from an FP8 checkpoint with
    `fp8_weight`) is kept as it is; one in another format is a ValueError. Returns the number of Linears quantized."""
    check_weights(weights)
    layers = linears_under(model, under)
    other = [n for n, m in layers.items() if is_quantized(m.weight) and format_of(m.weight) != weights]
    if other:
        raise ValueError(f"runtime.weights: {weights}, but {len(other)} Linear(s) hold weights already quantized to "
                         f"{format_of(layers[other[0]].weight)} ({other[0]}, ...)")
    return _quantize_chosen(model, weights, {id(m) for m in layers.values()})


def load_quantized(model: nn.Module, index, dtype: torch.dtype, weights: str, under: Iterable[str],
                   after_load=None, work: torch.device | str = "cpu") -> int:
    """Read a model waiting on the meta device (modules.module.lazy_module) from its files into host memory, quantizing
    as it goes: each of `model.blocks` is read in `dtype` and its chosen Linears quantized before the next block is
    read, then the rest of the model. The host then holds at most the quantized blocks plus the rest in `dtype`
    (18.6 GB for the 14B DiT), never the whole model in `dtype` (32.6 GB in bf16). index: the
    modules.loading.TensorIndex of its files.

    after_load: the module's after-load step (a LoRA merge), run on each part right after it is read and before it
    is quantized; it must offer `part(prefix, exclude)` (families/wan_s2v/lora.py LoraMerge does). work: where each
    part is read and quantized (a GPU quantizes many times faster than a host); the quantized part then moves to the
    host. Returns the number of Linears quantized."""
    from avatar_cli.modules.loading import TensorIndex, materialize

    check_weights(weights)
    chosen = {id(m) for m in linears_under(model, under).values()}
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = tuple(names[id(b)] + "." for b in model.blocks)
    n = 0
    for block, prefix in zip(model.blocks, prefixes):
        own = TensorIndex({k[len(prefix):]: v for k, v in index.tensors.items() if k.startswith(prefix)}, index.source)
        materialize(block, own, work, dtype)
        if after_load is not None:
            after_load.part(prefix)(block)
        n += _quantize_chosen(block, weights, chosen)
        block.to("cpu")
    materialize(model, index, work, dtype)  # the rest: the blocks' tensors are no longer on meta
    if after_load is not None:
        after_load.part("", exclude=prefixes)(model)
    n += _quantize_chosen(model, weights, chosen)
    model.to("cpu")
    return n


def _quantize_chosen(model: nn.Module, weights: str, chosen: set[int]) -> int:
    """Quantize the Linears in `model` whose id is in `chosen` and that are not quantized yet."""
    todo = {id(m) for m in model.modules() if id(m) in chosen and not is_quantized(m.weight)}
    if weights == "bf16" or not todo:
        return 0
    from torchao.quantization import quantize_

    with torch.no_grad():
        quantize_(model, _config(weights), filter_fn=lambda m, fqn: id(m) in todo)
    return len(todo)


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a (possibly nested) tensor subclass is made of; a plain tensor is its own."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in _inner(getattr(t, n))]


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a quantized weight's data plus its scales (and zero points)."""
    return sum(x.numel() * x.element_size() for x in _inner(t))


_QUANT_CACHE: dict[tuple, int] = {}


def _quantized_weight_bytes(shape: tuple[int, int], dtype: torch.dtype, weights: str) -> int:
    """Bytes of one Linear weight of `shape` once torchao quantizes it, found by quantizing a meta Linear of that
    shape (no memory, no arithmetic): the count is torchao's own layout, scales included."""
    key = (shape, dtype, weights)
    if key not in _QUANT_CACHE:
        with torch.device("meta"):
            layer = nn.Linear(shape[1], shape[0], bias=False, dtype=dtype)
        quantize_linears(layer, weights, ("",))
        _QUANT_CACHE[key] = stored_bytes(layer.weight)
    return _QUANT_CACHE[key]


def tensor_bytes(model: nn.Module, weights: str, under: Iterable[str] = ("blocks",),
                 dtype: torch.dtype | None = None) -> dict[str, int]:
    """state-dict name -> bytes of every parameter and persistent buffer of `model` once loaded with `runtime.weights`
    = `weights`: the Linears under `under` quantized (their weight; a bias stays in the runtime dtype), the rest in
    `dtype` (floating-point tensors; None: each tensor's own dtype). Works on a model built on the meta device (no
    memory): the counts come from the module tree and torchao's layout, not from a table. A weight that is already
    quantized counts what it holds. Tied tensors are listed once."""
    check_weights(weights)
    quantized = {id(m.weight) for m in linears_under(model, under).values()} if weights != "bf16" else set()
    out: dict[str, int] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        dot = prefix + "." if prefix else ""
        tensors = [(n, t, False) for n, t in module._parameters.items()]
        tensors += [(n, t, True) for n, t in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for name, t, _ in tensors:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            if is_quantized(t):
                out[dot + name] = stored_bytes(t)
            elif id(t) in quantized:
                out[dot + name] = _quantized_weight_bytes(tuple(t.shape), dtype or t.dtype, weights)
            else:
                want = dtype if dtype is not None and t.is_floating_point() else t.dtype
                out[dot + name] = t.numel() * want.itemsize
    return out


def quantized_bytes(model: nn.Module, weights: str, under: Iterable[str] = ("blocks",),
                    dtype: torch.dtype | None = None) -> int:
    """Bytes of `model`'s parameters and persistent buffers under `runtime.weights` = `weights` (see tensor_bytes);
    for a model on the meta device this is what it will take once loaded."""
    return sum(tensor_bytes(model, weights, under, dtype).values())


def component_bytes(model: nn.Module, paths: Iterable[str] | None, weights: str,
                    dtype: torch.dtype | None = None) -> int:
    """quantized_bytes of one component of a family with the paths the family quantizes in it
    (`ParallelPlan.quantized_paths(name)`); None (a component the family keeps whole) counts it all in `dtype`."""
    return quantized_bytes(model, weights if paths is not None else "bf16", paths or (), dtype)


def fp8_weight(qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float8_e4m3fn weight that already exists (e.g. a checkpoint stored in FP8 with its scales) as the fp8
    quantized weight this module makes, without a round trip through `dtype`: weight = qdata * scale.

    qdata (out, in) float8_e4m3fn; scale: one float32 per output channel (out,) / (out, 1), or one per tensor
    (a 0-d or 1-element tensor); dtype: the activations' (what the weight reports and dequantizes to).
    Install it as `layer.weight = nn.Parameter(fp8_weight(...), requires_grad=False)`."""
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    if qdata.dim() != 2 or qdata.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_weight: qdata must be a 2-D float8_e4m3fn matrix, got {qdata.dtype} "
                         f"{list(qdata.shape)}")
    out, inp = qdata.shape
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        scale, block = scale.reshape(1, 1), [out, inp]  # per tensor
    elif scale.numel() == out:
        scale, block = scale.reshape(out, 1), [1, inp]  # per output channel (torchao's PerRow)
    else:
        raise ValueError(f"fp8_weight: {scale.numel()} scales for a weight of {out} output channels (one per "
                         "channel, or one for the tensor)")
    return Float8Tensor(qdata, scale.to(qdata.device), block, dtype=dtype)
