"""The released Wan2.2-S2V-14B model directory: its two layouts, and a check of one that reads headers only.

Layouts (the file lists of the two releases named below):
- "official" (Wan-AI/Wan2.2-S2V-14B, flat): config.json + diffusion_pytorch_model-0000{1..4}-of-00004.safetensors
  + their index json (the DiT), models_t5_umt5-xxl-enc-bf16.pth (T5 encoder, bf16), Wan2.1_VAE.pth (fp32),
  google/umt5-xxl/ (tokenizer only), wav2vec2-large-xlsr-53-english/ (HF Wav2Vec2ForCTC).
- "diffusers" (FastVideo/Wan2.2-S2V-14B-Diffusers): model_index.json, transformer/ (the official shards and
  index byte-identical, official tensor names; or, in the repack of diffusers' own Wan2.2-S2V port,
  tolgacangoz/Wan2.2-S2V-14B-Diffusers, `WanS2VTransformer3DModel` with its renamed tensors), text_encoder/ (HF UMT5EncoderModel, possibly sharded, its tied
  embedding stored once or twice), vae/ (AutoencoderKLWan names), tokenizer/, audio_encoder/ (+ audio_processor/
  for the feature extractor). The vae/ and text_encoder/ config.json give their sizes where present.

`check_dir` reports per component (dit, vae, t5, tokenizer, wav2vec2) the files, tensor and parameter counts,
dtypes, bytes, and the missing, unexpected, mis-shaped and wrong-dtype tensors by name. It never reads tensor
data: safetensors headers, and .pth files through torch.load(weights_only=True, mmap=True).

Expected names and shapes come from our own modules built on the meta device (the architecture's params, plus
config.json for the DiT), or from the caller (`expected=`): model_dir.check_path passes the VAE's and T5's,
whose sizes it reads from config files or recognises from the headers.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from avatar_cli.modules.module import build_meta
from avatar_cli.modules.tensor_files import CheckpointFormatError, TensorInfo, read_header

OFFICIAL = "official"
DIFFUSERS = "diffusers"
COMPONENTS = ("dit", "vae", "t5", "tokenizer", "wav2vec2")

# name -> (shape, dtype or None for "any dtype")
Expected = dict[str, tuple[tuple[int, ...], torch.dtype | None]]

DIT_CLASS = "WanModel_S2V"
# diffusers' own class for the S2V DiT (its Wan2.2-S2V pull request): its transformer/ renames every tensor.
DIT_CLASS_DIFFUSERS = "WanS2VTransformer3DModel"
DIT_CLASSES = (DIT_CLASS, DIT_CLASS_DIFFUSERS)
DIT_INDEX = "diffusion_pytorch_model.safetensors.index.json"
DIT_SINGLE = "diffusion_pytorch_model.safetensors"
W2V_EXTRACTOR = "preprocessor_config.json"
# transformers' second name for umT5's embedding, tied to `shared.weight`: save_pretrained stores it once,
# older exports twice. Expected where a file holds it, not missing where it does not.
TIED_T5_KEY = "encoder.embed_tokens.weight"


@dataclass(frozen=True)
class ComponentFiles:
    """Where one component lives in a model directory."""

    name: str
    root: Path
    weights: Path | None  # the file whose header lists the tensors (index json, safetensors, .pth); None: no tensors
    config: Path | None = None
    # Each entry is a group of alternatives, one of which must exist (paths relative to root).
    required: tuple[tuple[str, ...], ...] = ()
    config_optional: bool = False  # the sizes can also be recognised from the header (not reported missing)


@dataclass(frozen=True)
class ModelDir:
    path: Path
    layout: str  # OFFICIAL or DIFFUSERS
    components: dict[str, ComponentFiles]


def _first(root: Path, *names: str) -> Path:
    """The first of `names` that exists under root, else the first name (reported missing later)."""
    for n in names:
        if (root / n).exists():
            return root / n
    return root / names[0]


_TOKENIZER_FILES = (("tokenizer_config.json",), ("tokenizer.json", "spiece.model"))


def find_layout(path: str | Path) -> ModelDir:
    """Recognise the layout of a Wan2.2-S2V model directory and say where each component's files are."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointFormatError(f"{p}: not a directory")
    if (p / "model_index.json").is_file() or (p / "transformer").is_dir():
        w = p / "audio_encoder"
        return ModelDir(p, DIFFUSERS, {
            "dit": ComponentFiles("dit", p / "transformer", _first(p / "transformer", DIT_INDEX, DIT_SINGLE),
                                  p / "transformer" / "config.json"),
            "vae": ComponentFiles("vae", p / "vae", p / "vae" / DIT_SINGLE, p / "vae" / "config.json",
                                  config_optional=True),
            "t5": ComponentFiles("t5", p / "text_encoder",
                                 _first(p / "text_encoder", "model.safetensors.index.json", "model.safetensors"),
                                 p / "text_encoder" / "config.json", config_optional=True),
            "tokenizer": ComponentFiles("tokenizer", p / "tokenizer", None, required=_TOKENIZER_FILES),
            "wav2vec2": ComponentFiles("wav2vec2", w, _first(w, "model.safetensors", "pytorch_model.bin"),
                                       w / "config.json", ((W2V_EXTRACTOR, f"../audio_processor/{W2V_EXTRACTOR}"),)),
        })
    if (p / DIT_INDEX).is_file() or (p / DIT_SINGLE).is_file() or (p / "Wan2.1_VAE.pth").is_file():
        w = p / "wav2vec2-large-xlsr-53-english"
        return ModelDir(p, OFFICIAL, {
            "dit": ComponentFiles("dit", p, _first(p, DIT_INDEX, DIT_SINGLE), p / "config.json"),
            "vae": ComponentFiles("vae", p, p / "Wan2.1_VAE.pth"),
            "t5": ComponentFiles("t5", p, p / "models_t5_umt5-xxl-enc-bf16.pth"),
            "tokenizer": ComponentFiles("tokenizer", p / "google" / "umt5-xxl", None, required=_TOKENIZER_FILES),
            "wav2vec2": ComponentFiles("wav2vec2", w, _first(w, "model.safetensors", "pytorch_model.bin"),
                                       w / "config.json", ((W2V_EXTRACTOR,),)),
        })
    raise CheckpointFormatError(
        f"{p}: not a Wan2.2-S2V-14B directory: expected the official layout ({DIT_INDEX}, Wan2.1_VAE.pth, ...) "
        "or the Diffusers layout (model_index.json, transformer/, ...)")


def looks_like(path: Path) -> bool:
    """A directory in one of the release's layouts (cheap: file names only)."""
    try:
        find_layout(path)
        return True
    except CheckpointFormatError:
        return False


def expected_from_module_dict(sd: dict[str, torch.Tensor]) -> Expected:
    return {k: (tuple(v.shape), None) for k, v in sd.items()}


def fit_tied(expected: Expected, found) -> Expected:
    """`expected` without the tied umT5 embedding name when `found` (names) lacks it (see TIED_T5_KEY)."""
    if TIED_T5_KEY in expected and TIED_T5_KEY not in found:
        return {k: v for k, v in expected.items() if k != TIED_T5_KEY}
    return expected


def expected_from_module(module: torch.nn.Module) -> Expected:
    """Names and shapes of a module's state dict (build it on the meta device: no memory, no init cost)."""
    return expected_from_module_dict(module.state_dict())


def expected_for(component: str, layout: str, config: dict | None) -> tuple[Expected | None, str]:
    """(expected names and shapes, where they came from) for one component, from our own modules built on the
    meta device; (None, why) when no module of ours describes that component's files in that layout.
    A DiT config.json our params refuse raises CheckpointFormatError naming the field."""
    if component == "dit":  # FastVideo's transformer/ holds the official names; diffusers' class its own
        try:
            from avatar_cli.families.wan_s2v import adapter_dit
            from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
        except ImportError:
            return None, "no DiT module to compare with"
        if config is None:
            return None, "no config.json to build the DiT from"
        try:
            if config.get("_class_name") == DIT_CLASS_DIFFUSERS:
                params = adapter_dit.params_from_diffusers_config(config)
                sd = build_meta(WanS2VDiT, params).state_dict()
                return ({adapter_dit.official_to_diffusers_key(k): (tuple(v.shape), None) for k, v in sd.items()},
                        "WanS2VDiT(config.json) in WanS2VTransformer3DModel's names (adapter_dit)")
            params = WanDiTParams.from_config(config)  # never code defaults: WanModel_S2V.from_pretrained reads it
        except (ValueError, TypeError) as e:
            raise CheckpointFormatError(str(e)) from None
        return expected_from_module(build_meta(WanS2VDiT, params)), "WanS2VDiT(WanDiTParams.from_config(config.json))"
    if component == "vae" and layout == OFFICIAL:
        try:
            from avatar_cli.families.wan_s2v.vae import WanVAE, WanVAEParams
        except ImportError:
            return None, "no VAE module to compare with"
        return expected_from_module(build_meta(WanVAE, WanVAEParams.full())), "WanVAE(WanVAEParams.full())"
    if component == "t5" and layout == OFFICIAL:
        try:  # transformers' UMT5EncoderModel, named back to the release's keys by the adapter
            from avatar_cli.families.wan_s2v.adapter_t5 import hf_to_wan
            from avatar_cli.families.wan_s2v.text import UMT5_XXL, umt5_state_shapes
        except ImportError:
            return None, "no T5 module to compare with"
        official = hf_to_wan(umt5_state_shapes(UMT5_XXL))  # build_text_encoder(UMT5_XXL)'s names, unbuilt
        return ({k: (s, None) for k, s in official.items()},
                "build_text_encoder(UMT5_XXL) (its names, text.umt5_state_shapes) via adapter_t5.hf_to_wan")
    # The Diffusers layout's vae/ and text_encoder/ are compared by model_dir.check_path, which passes their
    # expected names (adapter_vae's renames; transformers' own names) with the sizes from their config.json or
    # headers. wav2vec2 is HF's own format (weight-norm names differ across transformers versions): loading it
    # with transformers is its check.
    return None, "no module of ours describes these files here (model_dir.check_path passes them)"


@dataclass
class ComponentReport:
    name: str
    files: list[Path] = field(default_factory=list)
    holds_tensors: bool = True  # False for the tokenizer: files only
    tensors: int = 0
    params: int = 0
    nbytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype name -> tensor count
    expected_from: str | None = None  # None: nothing to compare with (names/shapes not checked)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mis_shaped: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # found, expected
    wrong_dtype: list[tuple[str, str, str]] = field(default_factory=list)  # name, found, expected
    problems: list[str] = field(default_factory=list)  # missing files, unreadable headers, bad config

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mis_shaped or self.wrong_dtype or self.problems)

    def lines(self, limit: int = 5) -> list[str]:
        """Human-readable summary: one line of figures, then one per kind of fault (first `limit` names)."""
        dt = ", ".join(self.dtypes) or "-"
        if self.holds_tensors:
            head = (f"{self.name}: {self.tensors} tensors, {self.params:,} params, {dt}, {self.nbytes / 1e9:.2f} GB"
                    + ("" if self.expected_from else " (names not checked)"))
        else:
            head = f"{self.name}: {len(self.files)} files"
        head += "; ok" if self.ok else ""
        out = [head]
        for label, items in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("mis-shaped", [f"{n} {list(f)} (expected {list(e)})" for n, f, e in self.mis_shaped]),
                             ("wrong dtype", [f"{n} {f} (expected {e})" for n, f, e in self.wrong_dtype])):
            if items:
                more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
                out.append(f"  {len(items)} {label}: " + ", ".join(items[:limit]) + more)
        out += [f"  {p}" for p in self.problems]
        return out


@dataclass
class DirReport:
    path: Path
    layout: str
    components: dict[str, ComponentReport]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.components.values())

    def lines(self) -> list[str]:
        out = [f"{self.path} ({self.layout} layout)"]
        for c in self.components.values():
            out += c.lines()
        return out


def compare(found: dict[str, TensorInfo], expected: Expected, report: ComponentReport) -> None:
    """Fill the report's missing / unexpected / mis_shaped / wrong_dtype lists (expected order, then found)."""
    for name, (shape, dtype) in expected.items():
        info = found.get(name)
        if info is None:
            report.missing.append(name)
        elif info.shape != tuple(shape):
            report.mis_shaped.append((name, info.shape, tuple(shape)))
        elif dtype is not None and info.dtype != dtype:
            report.wrong_dtype.append((name, _dtype_name(info.dtype), _dtype_name(dtype)))
    report.unexpected = [n for n in found if n not in expected]


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _check_component(files: ComponentFiles, layout: str, expected: Expected | None) -> ComponentReport:
    r = ComponentReport(files.name, holds_tensors=files.weights is not None)
    for group in files.required:
        hits = [files.root / n for n in group if (files.root / n).is_file()]
        if hits:
            r.files.append(hits[0])
        else:
            r.problems.append(f"missing file: {files.root / group[0]}"
                              + (f" (or {', '.join(group[1:])})" if len(group) > 1 else ""))
    config = None
    if files.config is not None:
        try:
            config = json.loads(files.config.read_text())
            r.files.append(files.config)
        except FileNotFoundError:
            if not files.config_optional:
                r.problems.append(f"missing file: {files.config}")
        except (OSError, ValueError) as e:
            r.problems.append(f"{files.config}: unreadable JSON ({e})")
    if files.name == "dit" and config is not None and config.get("_class_name") not in DIT_CLASSES:
        r.problems.append(f"{files.config}: _class_name is {config.get('_class_name')!r}, not "
                          + " or ".join(map(repr, DIT_CLASSES)))
    if files.weights is None:
        return r
    if not files.weights.is_file():
        r.problems.append(f"missing file: {files.weights}")
        return r
    try:
        found = read_header(files.weights)
    except CheckpointFormatError as e:
        r.problems.append(str(e))
        return r
    r.files += [files.weights] + sorted({i.file for i in found.values()} - {files.weights})
    r.tensors = len(found)
    for info in found.values():
        r.params += info.numel
        r.nbytes += info.nbytes
        r.dtypes[_dtype_name(info.dtype)] = r.dtypes.get(_dtype_name(info.dtype), 0) + 1
    if expected is not None:
        r.expected_from = "given"
    else:
        try:
            expected, source = expected_for(files.name, layout, config)
        except CheckpointFormatError as e:  # a config.json our params refuse
            r.problems.append(f"{files.config}: {e}")
            return r
        r.expected_from = source if expected is not None else None
    if expected is not None:
        compare(found, fit_tied(expected, found), r)
    return r


def check_dir(path: str | Path, expected: dict[str, Expected] | None = None) -> DirReport:
    """Check a Wan2.2-S2V model directory from its headers alone. `expected` overrides, per component name,
    the names/shapes (and optionally dtypes) to compare with; otherwise they come from `expected_for`.
    Raises CheckpointFormatError when the directory is not recognisable at all; everything else is reported."""
    d = find_layout(path)
    expected = expected or {}
    return DirReport(d.path, d.layout, {name: _check_component(files, d.layout, expected.get(name))
                                        for name, files in d.components.items()})
