"""The DiT as one file: ComfyUI's single-file repackagings (bf16, or FP8-scaled) and GGUF quantizations.

What a file is, from its header alone (`inspect`): its format (safetensors or GGUF), the prefix before the official
names, whether it is scaled FP8, its tensor types, and whether it is a Wan2.2-S2V DiT at all: ComfyUI tells the S2V
model from the other Wan DiTs by `casual_audio_encoder.encoder.final_linear.weight` (comfy/model_detection.py), and
a Wan DiT by `head.modulation`; a file without them is named as another model's.

Loading (`load`): the bf16/fp16/fp32 safetensors file lazily, exactly as the official shards (each rank reads its own
rows; the names mapped by adapter_dit); the FP8-scaled file whole, its FP8 Linears of the blocks and audio injectors
(the ones `runtime.weights: fp8` would quantize) kept as they are stored, FP8 with their per-tensor scale, as
runtime/quantize.py's fp8 weights (dequantized per layer in each forward), every other FP8 tensor dequantized at load
(fp8 x scale_weight, as ComfyUI's own fallback computes it); a GGUF file whole, its quantized weights left quantized
and dequantized per layer at run time (modules/gguf_weights.py).

These weights are quantized already, so a job reading them keeps `runtime.weights: bf16` (a file's FP8 or GGUF
weights are not quantized a second time); with a LoRA, the FP8 file is dequantized whole at load, for the LoRA to
merge into float weights, and a GGUF file is refused (`families/wan_s2v/spec.py`).
"""

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from avatar_cli.errors import InputError
from avatar_cli.families.wan_s2v import adapter_dit
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.modules.loading import TensorIndex, mismatch_problems
from avatar_cli.modules.module import Module, build_meta, lazy_module
from avatar_cli.modules.tensor_files import CheckpointFormatError, read_header

SUFFIXES = (".safetensors", ".gguf")
S2V_MARKER = "casual_audio_encoder.encoder.final_linear.weight"
WAN_MARKER = "head.modulation"
GGUF_ARCH = "wan"  # general.architecture of ComfyUI-GGUF's Wan files (tools/convert.py ModelWan)


@dataclass
class DitFile:
    """A single-file DiT as its header describes it."""

    path: Path
    format: str  # "comfy" (safetensors, bf16/fp16/fp32), "comfy-fp8" (scaled FP8) or "gguf"
    prefix: str  # before the official names: "" or "model.diffusion_model."
    shapes: dict[str, tuple[int, ...]]  # official name -> shape
    types: Counter = field(default_factory=Counter)  # dtype or GGML type name -> tensor count
    nbytes: int = 0
    problems: list[str] = field(default_factory=list)  # why it cannot be read as a Wan2.2-S2V DiT
    # official name -> bytes it holds once loaded as stored, for each tensor a load can keep quantized: a GGUF
    # quantized tensor (its bytes), a float8_e4m3fn weight (a byte a value, and its scale in float32)
    quantized: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        kind = {"comfy": "single-file safetensors", "comfy-fp8": "single-file scaled FP8 safetensors",
                "gguf": "GGUF"}[self.format]
        return f"{kind} ({', '.join(f'{k} x{v}' for k, v in self.types.most_common())})"


def looks_like(path: Path) -> bool:
    return path.is_file() and path.suffix in SUFFIXES


def _model_problem(names) -> str | None:
    if S2V_MARKER in names and "audio_injector.injector.0.q.weight" in names:
        return None
    if WAN_MARKER in names:
        return "a Wan DiT of another model (no S2V audio encoder or injectors: T2V, I2V, ...), not Wan2.2-S2V"
    if "condition_embedder.causal_audio_encoder.weighted_avg.weights" in names:
        return ("diffusers' WanS2VTransformer3DModel names: name its Diffusers directory (model_index.json, "
                "transformer/, ...) in model: instead")
    return "not a Wan DiT (no head.modulation)"


def inspect(path: str | Path) -> DitFile:
    """The file's format, names and shapes from its header; `problems` says why it is not a readable S2V DiT."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: no such file")
    if path.suffix == ".gguf":
        return _inspect_gguf(path)
    if path.suffix != ".safetensors":
        raise CheckpointFormatError(f"{path}: a DiT file is a .safetensors or .gguf file")
    header = read_header(path)
    prefix = adapter_dit.comfy_prefix(header)
    fp8 = any(info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for info in header.values())
    shapes, types, nbytes, quantized = {}, Counter(), 0, {}
    for name, info in header.items():
        nbytes += info.nbytes
        official = adapter_dit.comfy_to_official_key(name, prefix)
        if official is None:
            continue
        shapes[official] = info.shape
        types[str(info.dtype).removeprefix("torch.")] += 1
        if info.dtype == torch.float8_e4m3fn and len(info.shape) == 2:
            scale = adapter_dit.scale_name(name, header)
            quantized[official] = info.nbytes + 4 * (header[scale].numel if scale is not None else 1)
    f = DitFile(path, "comfy-fp8" if fp8 else "comfy", prefix, shapes, types, nbytes, quantized=quantized)
    problem = _model_problem(shapes)
    if problem:
        f.problems.append(f"{path.name}: {problem}")
    formats = _comfy_quant_formats(path, [n for n in header if n.endswith(adapter_dit.QUANT_CONFIG)])
    bad = sorted(set(formats) - set(adapter_dit.QUANT_FORMATS_READ))
    if bad:
        f.problems.append(f"{path.name}: ComfyUI quantization format(s) {', '.join(bad)} cannot be read here "
                          f"(readable: {', '.join(adapter_dit.QUANT_FORMATS_READ)} and scaled_fp8 files)")
    return f


def _comfy_quant_formats(path: Path, names: list[str]) -> list[str]:
    """The "format" of each `<layer>.comfy_quant` blob (a few bytes each: read, unlike the weights)."""
    if not names:
        return []
    import json

    from safetensors import safe_open

    out = []
    with safe_open(str(path), framework="pt", device="cpu") as st:
        for n in names:
            try:
                conf = json.loads(bytes(st.get_tensor(n).to(torch.uint8).tolist()).decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                conf = None
            out.append(conf.get("format", "unknown") if isinstance(conf, dict) else str(conf))
    return out


def _inspect_gguf(path: Path) -> DitFile:
    from avatar_cli.modules.gguf_weights import GGUFFile, supported

    g = GGUFFile(path)
    prefix = adapter_dit.comfy_prefix(g.tensors)
    shapes, types, nbytes, quantized = {}, Counter(), 0, {}
    for name, t in g.tensors.items():
        nbytes += t.nbytes
        if prefix and not name.startswith(prefix):
            continue
        shapes[name[len(prefix):]] = t.shape
        types[t.qtype] += 1
        if t.quantized:
            quantized[name[len(prefix):]] = t.nbytes
    f = DitFile(path, "gguf", prefix, shapes, types, nbytes, quantized=quantized)
    arch = g.field("general.architecture")
    if arch is not None and arch != GGUF_ARCH:
        f.problems.append(f"{path.name}: GGUF architecture {arch!r}, not a Wan DiT ({GGUF_ARCH!r})")
    else:
        problem = _model_problem(shapes)
        if problem:
            f.problems.append(f"{path.name}: {problem}")
    bad = sorted(q for q in types if not supported(q))
    if bad:
        f.problems.append(f"{path.name}: GGUF tensor type(s) {', '.join(bad)} cannot be dequantized here "
                          "(readable: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K and the types gguf dequantizes)")
    return f


@torch.no_grad()
def expected_shapes(params: WanDiTParams) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in build_meta(WanS2VDiT, params).state_dict().items()}


def params_of(f: DitFile, presets: dict[str, WanDiTParams]) -> tuple[str, WanDiTParams]:
    """The preset whose names and shapes the file holds exactly, else the one sharing most (name, shape) pairs
    with it (to compare a damaged or foreign file with what it is closest to); (name, params)."""
    found = set(f.shapes.items())
    score = {name: len(found & set(expected_shapes(p).items())) for name, p in presets.items()}
    best = max(score, key=score.get)
    return best, presets[best]


def problems_against(f: DitFile, params: WanDiTParams) -> list[str]:
    """The file's missing, unexpected and mis-shaped names against the DiT of `params`, in words."""
    return mismatch_problems(expected_shapes(params), f.shapes)


def check_or_fail(f: DitFile, params: WanDiTParams) -> None:
    problems = f.problems or problems_against(f, params)
    if problems:
        raise InputError(f"dit: {f.path}: the file does not fit the wan-s2v DiT: " + "; ".join(problems))


def load(f: DitFile, params: WanDiTParams, keep_fp8: tuple[str, ...] = ()) -> Module:
    """The DiT from one file (see the module's docstring for what each format costs). keep_fp8: the module paths
    under which a scaled-FP8 file's Linears stay FP8 (the family's `ParallelPlan.quantized` ones); () dequantizes
    everything at load (for a LoRA to merge into)."""
    check_or_fail(f, params)
    if f.format == "comfy":
        prefix = f.prefix
        index = TensorIndex.from_safetensors(f.path, rename=lambda n: adapter_dit.comfy_to_official_key(n, prefix))
        return lazy_module("dit", WanS2VDiT, params, index)
    if f.format == "comfy-fp8":
        return _load_fp8(f, params, keep_fp8)
    return _load_gguf(f, params)


def quantized_already(f: DitFile) -> str | None:
    """What makes a file's weights quantized already ("scaled FP8", "GGUF Q4_K, Q6_K"), None for float files."""
    if f.format == "comfy-fp8":
        return "scaled FP8"
    if f.format == "gguf":
        quantized = [t for t in f.types if t not in ("F32", "F16", "BF16")]
        return f"GGUF {', '.join(sorted(quantized))}" if quantized else None
    return None


def held_quantized(f: DitFile, fp8_kept: Collection[str], dtype: torch.dtype) -> dict[str, int]:
    """official name -> bytes, from the header alone, of each tensor `load` keeps as the file stores it, in a DiT
    running in `dtype`: a GGUF file's quantized tensors (and the `dtype` scalar each one's dequantization holds,
    gguf_weights.Dequantize); a scaled-FP8 file's float8_e4m3fn weights named in fp8_kept (the weights of the
    Linears under `load`'s keep_fp8). Every other tensor is held in the runtime dtype."""
    if f.format == "gguf":
        return {k: n + dtype.itemsize for k, n in f.quantized.items()}
    if f.format == "comfy-fp8":
        return {k: n for k, n in f.quantized.items() if k in fp8_kept}
    return {}


def _fp8_in_runtime_dtype(model: nn.Module) -> None:
    """After-load step of a DiT holding FP8 weights: placement gave its float weights the runtime dtype; each FP8
    weight now reports (and dequantizes to) that dtype too, its stored bytes and scale unchanged."""
    from avatar_cli.runtime.quantize import fp8_weight, is_quantized

    dtype = model.patch_embedding.weight.dtype
    for m in model.modules():
        if isinstance(m, nn.Linear) and is_quantized(m.weight) and m.weight.dtype != dtype:
            w = m.weight
            m.weight = nn.Parameter(fp8_weight(w.qdata, w.scale, dtype), requires_grad=False)


def _load_fp8(f: DitFile, params: WanDiTParams, keep: tuple[str, ...]) -> Module:
    from safetensors import safe_open

    from avatar_cli.runtime.quantize import fp8_weight, linears_under

    model = build_meta(WanS2VDiT, params)
    kept = {name + ".weight": layer for name, layer in linears_under(model, keep).items()} if keep else {}
    stored = {}  # official name -> (fp8 data, scale): the weights kept as stored
    with safe_open(str(f.path), framework="pt", device="cpu") as st:
        names = set(st.keys())
        plain = [n for n in st.keys() if adapter_dit.comfy_to_official_key(n, f.prefix) is not None]
        # The dtype the weights have where they are not FP8 (bf16 in the release's repackaging).
        floats = Counter(st.get_slice(n).get_dtype() for n in plain)
        other = next((d for d, _ in floats.most_common() if not d.startswith("F8")), "BF16")
        dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(other, torch.bfloat16)
        state = {}
        for name in plain:
            t = st.get_tensor(name)
            official = adapter_dit.comfy_to_official_key(name, f.prefix)
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                scale_key = adapter_dit.scale_name(name, names)
                scale = st.get_tensor(scale_key) if scale_key is not None else torch.ones(())
                if official in kept and t.dtype == torch.float8_e4m3fn:
                    stored[official] = (t, scale)
                    t = torch.empty(t.shape, dtype=dtype, device="meta")  # (out, in) placeholder, replaced below
                else:
                    t = adapter_dit.dequantize_scaled_fp8(t, scale, dtype)
            state[official] = t
    model.load_state_dict(state, strict=True, assign=True)
    for name, (data, scale) in stored.items():
        layer = kept[name]
        # Reported as float32 until placement has given the float weights their dtype (_fp8_in_runtime_dtype).
        layer.weight = nn.Parameter(fp8_weight(data, scale, torch.float32), requires_grad=False)
    return Module("dit", model, str(f.path), after_load=_fp8_in_runtime_dtype if stored else None,
                  stored_quantized=bool(stored))


def _load_gguf(f: DitFile, params: WanDiTParams) -> Module:
    from avatar_cli.modules.gguf_weights import GGUFFile, fill_from_gguf

    model = build_meta(WanS2VDiT, params)
    names = {k: f.prefix + k for k in model.state_dict()}
    fill_from_gguf(model, GGUFFile(f.path), names, torch.float32)
    quantized = any(p.dtype == torch.uint8 for p in model.parameters())
    return Module("dit", model, str(f.path), stored_quantized=quantized)
