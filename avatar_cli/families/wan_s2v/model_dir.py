"""A Wan2.2-S2V model directory as the renderer uses it: what it holds (read from headers and config files
only), its check, its load into our modules, and `avatar models init` of a random one.

Both released layouts render (files.py says where each component lives):
- official (Wan-AI/Wan2.2-S2V-14B): the VAE and T5 are `.pth` files in the official names;
- Diffusers (FastVideo/Wan2.2-S2V-14B-Diffusers): transformer/ holds the official DiT shards unchanged, vae/ an
  AutoencoderKLWan safetensors (renamed by adapter_vae), text_encoder/ a transformers UMT5EncoderModel
  (its own names: loaded into UMT5Text directly), tokenizer/, and audio_encoder/ (wav2vec2; its feature
  extractor in audio_processor/ when audio_encoder/ has none).

The DiT is built from the directory's own config.json (never from code defaults). The Diffusers vae/ and
text_encoder/ config.json give those sizes too. The official `.pth` files carry no config: there the VAE and T5
sizes are the presets whose names and shapes the file's header matches (the release's, or the tiny ones
`models init --size tiny` writes), and so in the Diffusers layout when a config.json is absent; a header that
matches none is checked against the release's and every difference named.

Pickles: the `.pth` files are read only through `torch.load(weights_only=True, mmap=True)`
(`modules.tensor_files.load_pth`), which refuses anything but a flat dict of tensors, with exit 2.
"""

import dataclasses
import functools
import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
# transformers' modeling classes (a slow import) are imported where a model is built or loaded, so that
# `avatar validate`, `models check` and the --nproc launcher, which read configs and headers only, skip them.
from transformers import UMT5Config, Wav2Vec2Config, Wav2Vec2FeatureExtractor

from avatar_cli.errors import InputError
from avatar_cli.families.wan_s2v import adapter_dit, adapter_vae
from avatar_cli.families.wan_s2v import dit_file as dit_file_mod
from avatar_cli.families.wan_s2v import files as wfiles
from avatar_cli.families.wan_s2v.adapter_t5 import hf_to_wan, load_into
from avatar_cli.families.wan_s2v.components import UMT5Text, Wav2Vec2Audio
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.text import UMT5_XXL, UMT5Params, build_text_encoder, umt5_state_shapes
from avatar_cli.families.wan_s2v.vae import WanVAE, WanVAEParams
from avatar_cli.modules.loading import TensorIndex
from avatar_cli.modules.module import Module, build_meta, lazy_module, save_safetensors
from avatar_cli.modules.tensor_files import CheckpointFormatError, aligned, load_pth, read_header

FAMILY = "wan-s2v"
TINY_TOKENIZER = Path(__file__).resolve().parent / "tiny_tokenizer"

# The tiny size `models init --size tiny` writes: every code path of the release at a size a CPU renders in
# seconds (the text width is the DiT's text_dim, the audio width its audio_dim).
T5_TINY = UMT5Params(vocab_size=128, dim=32, ffn_dim=64, num_heads=4, num_layers=2)
VAE_PRESETS = {"release": WanVAEParams.full(), "tiny": WanVAEParams.tiny()}
T5_PRESETS = {"release": UMT5_XXL, "tiny": T5_TINY}


def tiny_dit() -> WanDiTParams:
    return WanDiTParams.tiny()


@dataclass(frozen=True)
class WanS2VConfig:
    """Everything the family needs to know about a model directory, from headers and config files."""

    path: Path
    layout: str  # files.OFFICIAL or files.DIFFUSERS
    dit: WanDiTParams
    vae: WanVAEParams
    t5: UMT5Params
    # "release" or "tiny"; "unknown" (a header matching no preset: checked against the release's); "config.json"
    # (Diffusers layout: sizes from the component's config.json that equal no preset)
    vae_preset: str
    t5_preset: str
    # The directory's DiT names: "official" (the release, FastVideo's transformer/) or "diffusers" (diffusers'
    # WanS2VTransformer3DModel, renamed by adapter_dit).
    dit_names: str = "official"
    # A job's `dit:` file (ComfyUI single file, scaled FP8, GGUF: dit_file.py), read instead of the directory's DiT.
    dit_file: Path | None = None

    @property
    def files(self) -> dict[str, wfiles.ComponentFiles]:
        comps = dict(wfiles.find_layout(self.path).components)
        if self.dit_file is not None:
            comps["dit"] = wfiles.ComponentFiles("dit", self.dit_file.parent, self.dit_file)
        return comps

    @property
    def size(self) -> str:
        return "full" if self.dit == WanDiTParams.full() else ("tiny" if self.dit == tiny_dit() else "custom")

    def to_json(self) -> str:
        d = {"family": FAMILY, "layout": self.layout, "dit": asdict(self.dit), "vae": asdict(self.vae),
             "t5": asdict(self.t5)}
        if self.dit_file is not None:
            d["dit_file"] = str(self.dit_file)
        return json.dumps(d, sort_keys=True, default=list)

    def weight_files(self) -> list[Path]:
        """Every file whose bytes the render reads (for the resume fingerprint: size, mtime, header)."""
        out = []
        for comp in self.files.values():
            if comp.weights is None:
                continue
            if comp.weights.name.endswith(".index.json"):
                out += sorted(comp.weights.parent.glob(comp.weights.name.replace(".safetensors.index.json", "-*")))
            out.append(comp.weights)
        return out


def _preset(header: dict, presets: dict, expected_of, exact: bool = True) -> str:
    """The preset whose expected names and shapes equal the header's, else "unknown"; with exact=False the one
    sharing the most (name, shape) pairs with it (to compare a damaged file with what it was meant to be)."""
    found = {(k, tuple(v.shape)) for k, v in header.items()}
    expected = {name: wfiles.fit_tied(expected_of(params), header) for name, params in presets.items()}
    score = {name: len(found & {(k, s) for k, (s, _) in exp.items()}) for name, exp in expected.items()}
    best = max(score, key=score.get)
    if not exact:
        return best
    return best if score[best] == len(found) == len(expected[best]) else "unknown"


@functools.cache  # a model dir's check asks for each preset's names more than once; the release VAE is 0.1 s
def _vae_expected(p: WanVAEParams, layout: str = wfiles.OFFICIAL) -> wfiles.Expected:
    """Names and shapes of the VAE file: our module's (= the official names), or AutoencoderKLWan's."""
    sd = build_meta(WanVAE, p).state_dict()
    if layout == wfiles.DIFFUSERS:
        sd = adapter_vae.official_to_diffusers(sd, p.num_res_blocks)
    return wfiles.expected_from_module_dict(sd)


def _t5_expected(p: UMT5Params, layout: str = wfiles.OFFICIAL) -> wfiles.Expected:
    """Names and shapes of the T5 file: the official names, or transformers' own (Diffusers text_encoder/; its
    tied embedding listed, which files.fit_tied drops where a file stores it once)."""
    shapes = umt5_state_shapes(p)  # build_text_encoder(p)'s, without building it
    return {k: (s, None) for k, s in (shapes if layout == wfiles.DIFFUSERS else hf_to_wan(shapes)).items()}


_PRESETS = {"vae": VAE_PRESETS, "t5": T5_PRESETS}
_EXPECTED = {"vae": _vae_expected, "t5": _t5_expected}


def umt5_params(config: Mapping) -> UMT5Params:
    """UMT5Params from a transformers UMT5 config.json (the Diffusers text_encoder/), read as transformers reads
    it (its defaults for absent fields). ValueError naming a field our encoder does not implement."""
    model_type = config.get("model_type", "umt5")
    if model_type != "umt5":  # T5 shares one position table over all layers; umT5 has one per layer
        raise ValueError(f"model_type is {model_type!r}, not 'umt5'")
    c = UMT5Config.from_dict(dict(config))
    if c.feed_forward_proj != "gated-gelu":
        raise ValueError(f"feed_forward_proj is {c.feed_forward_proj!r}, not 'gated-gelu' (umT5-XXL's)")
    if c.d_kv * c.num_heads != c.d_model:
        raise ValueError(f"d_kv {c.d_kv} x num_heads {c.num_heads} != d_model {c.d_model} (umT5-XXL's heads span "
                         "the model width)")
    return UMT5Params(vocab_size=c.vocab_size, dim=c.d_model, ffn_dim=c.d_ff, num_heads=c.num_heads,
                      num_layers=c.num_layers, num_buckets=c.relative_attention_num_buckets,
                      max_distance=c.relative_attention_max_distance, eps=c.layer_norm_epsilon)


def _config_params(d: wfiles.ModelDir, comp: str) -> WanVAEParams | UMT5Params | None:
    """The sizes a Diffusers vae/ or text_encoder/ config.json gives; None when there is none (the official
    layout's .pth files have none). InputError naming the file and what it refuses."""
    path = d.components[comp].config
    if d.layout != wfiles.DIFFUSERS or path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        return adapter_vae.params_from_config(config) if comp == "vae" else umt5_params(config)
    except (OSError, ValueError, TypeError) as e:
        raise InputError(f"model: {path}: {e}") from None


def _header_sizes(d: wfiles.ModelDir, comp: str, exact: bool = True) -> tuple[WanVAEParams | UMT5Params, str]:
    """(sizes, preset name) from the weights' header alone (the release's sizes when it matches no preset)."""
    presets = _PRESETS[comp]
    header = read_header(d.components[comp].weights)
    name = _preset(header, presets, lambda p: _EXPECTED[comp](p, d.layout), exact)
    return presets.get(name, presets["release"]), name


def _dit_params(cfg_path: Path) -> tuple[WanDiTParams, str]:
    """(sizes, names) from the DiT's config.json: the official class's, or diffusers' WanS2VTransformer3DModel's."""
    try:
        config = json.loads(cfg_path.read_text())
        if isinstance(config, dict) and config.get("_class_name") == wfiles.DIT_CLASS_DIFFUSERS:
            return adapter_dit.params_from_diffusers_config(config), "diffusers"
        return WanDiTParams.from_config(config), "official"
    except (ValueError, TypeError, AttributeError) as e:
        raise InputError(f"model: {cfg_path}: {e}") from None


DIT_PRESETS = {"release": WanDiTParams.full(), "tiny": WanDiTParams.tiny()}


def read_config(path: Path, dit_file: Path | None = None) -> WanS2VConfig:
    """The directory's layout and sizes, from the config.json files and the headers of the VAE and T5 files.
    dit_file: a single-file DiT read instead of the directory's (its sizes from the directory's config.json, or,
    where the directory has none, from the file's shapes, which must be the release's or the tiny size's)."""
    try:
        d = wfiles.find_layout(path)
        cfg_path = d.components["dit"].config
        dit_names = "official"
        if cfg_path is not None and cfg_path.is_file():
            dit, dit_names = _dit_params(cfg_path)
        elif dit_file is not None:
            f = dit_file_mod.inspect(dit_file)
            name, dit = dit_file_mod.params_of(f, DIT_PRESETS)
            dit_file_mod.check_or_fail(f, dit)
        else:
            raise InputError(f"model: {path}: no config.json for the DiT ({cfg_path})")
        sizes = {}
        for comp in ("vae", "t5"):
            f = d.components[comp].weights
            if not f.is_file():
                raise InputError(f"model: {path}: missing {f.relative_to(d.path)}")
            params = _config_params(d, comp)
            if params is None:
                sizes[comp] = _header_sizes(d, comp)
            else:
                sizes[comp] = params, next((n for n, p in _PRESETS[comp].items() if p == params), "config.json")
    except CheckpointFormatError as e:
        raise InputError(f"model: {e}") from None
    (vae, vae_preset), (t5, t5_preset) = sizes["vae"], sizes["t5"]
    return WanS2VConfig(Path(path), d.layout, dit, vae, t5, vae_preset, t5_preset, dit_names,
                        Path(dit_file) if dit_file is not None else None)


def with_dit_file(cfg: WanS2VConfig, path: Path, weights: str = "bf16") -> WanS2VConfig:
    """The config with its DiT read from `path` (a job's `dit:`), checked from the file's header: a file of
    another model, of other sizes, or of a GGUF type that cannot be read is an InputError naming it, and so is
    `runtime.weights` (weights: fp8 | int8) asking to quantize weights the file stores quantized already."""
    f = dit_file_mod.inspect(path)
    dit_file_mod.check_or_fail(f, cfg.dit)
    already = dit_file_mod.quantized_already(f)
    if already and weights != "bf16":
        raise InputError(f"runtime.weights: {weights} with dit: {path}: its weights are {already} already; "
                         "runtime.weights: bf16 keeps them as stored (the other weights in the runtime dtype)")
    return dataclasses.replace(cfg, dit_file=Path(path))


def _file_report(f: "dit_file_mod.DitFile", params: WanDiTParams, source: str) -> wfiles.ComponentReport:
    r = wfiles.ComponentReport("dit", files=[f.path], tensors=len(f.shapes),
                               params=sum(math.prod(s) for s in f.shapes.values()), nbytes=f.nbytes,
                               dtypes=dict(f.types.most_common()), expected_from=source)
    r.problems += f.problems
    if not f.problems:
        wfiles.compare({k: _Shape(s) for k, s in f.shapes.items()},
                       {k: (s, None) for k, s in dit_file_mod.expected_shapes(params).items()}, r)
    return r


@dataclass(frozen=True)
class _Shape:
    """What files.compare reads of a found tensor."""

    shape: tuple[int, ...]


def check_file(path: Path) -> wfiles.DirReport:
    """`avatar models check FILE`: a single-file DiT against the release's DiT (or the tiny one it matches)."""
    f = dit_file_mod.inspect(path)
    name, params = dit_file_mod.params_of(f, DIT_PRESETS)
    report = _file_report(f, params, f"WanS2VDiT at the {name} size")
    return wfiles.DirReport(Path(path), f.describe(), {"dit": report})


def check_path(path: Path) -> wfiles.DirReport:
    """`avatar models check`: any layout, headers only. The VAE and T5 are compared, in the layout's own names,
    with the sizes their config.json gives (Diffusers layout), else with the preset their header matches (the
    release's when none does, so every difference is named). A file: check_file."""
    if Path(path).is_file():
        return check_file(Path(path))
    d = wfiles.find_layout(path)
    expected, problems = {}, {}
    for comp in ("vae", "t5"):
        f = d.components[comp].weights
        if f is None or not f.is_file():
            continue  # check_dir reports the missing file
        try:
            params = _config_params(d, comp)
        except InputError as e:  # reported; the header is then compared with its closest preset
            problems[comp], params = str(e).removeprefix("model: "), None
        try:
            if params is None:
                params = _header_sizes(d, comp, exact=False)[0]
        except CheckpointFormatError:
            continue  # check_dir reports the unreadable file
        expected[comp] = _EXPECTED[comp](params, d.layout)
    report = wfiles.check_dir(path, expected)
    for comp, problem in problems.items():
        report.components[comp].problems.append(problem)
    return report


def check(cfg: WanS2VConfig) -> wfiles.DirReport:
    """Headers only: every component's names, shapes (and the DiT's config) against our modules."""
    expected = {"vae": _vae_expected(cfg.vae, cfg.layout), "t5": _t5_expected(cfg.t5, cfg.layout)}
    report = wfiles.check_dir(cfg.path, expected)
    if cfg.dit_file is not None:
        report.components["dit"] = _file_report(dit_file_mod.inspect(cfg.dit_file), cfg.dit, "the job's dit file")
    return report


def check_or_fail(cfg: WanS2VConfig) -> None:
    report = check(cfg)
    if not report.ok:
        bad = [line for line in report.lines() if "missing" in line or "unexpected" in line or "mis" in line
               or "not found" in line or "wrong" in line]
        raise InputError(f"model: {cfg.path}: the files do not fit the wan-s2v architecture: "
                         + "; ".join(s.strip() for s in (bad or report.lines())[:4])
                         + f" (run `avatar models check {cfg.path}` for the full report)")


def load_dit(cfg: WanS2VConfig, keep_fp8: tuple[str, ...] = ()) -> Module:
    """Lazy: built on meta from config.json with its headers checked; placement reads it onto the device, or
    under FSDP2 each rank only its own rows (modules/loading.py), so 14B is never copied once per rank. A job's
    `dit:` file: dit_file.load (keep_fp8: the paths under which a scaled-FP8 file's Linears stay FP8)."""
    if cfg.dit_file is not None:
        return dit_file_mod.load(dit_file_mod.inspect(cfg.dit_file), cfg.dit, keep_fp8)
    comp = cfg.files["dit"]
    rename = None
    if cfg.dit_names == "diffusers":  # diffusers' names read back to ours; a name it lacks is reported as is
        official = adapter_dit.diffusers_to_official_names(list(dit_file_mod.expected_shapes(cfg.dit)))
        rename = lambda name: official.get(name, name)  # noqa: E731
    return lazy_module("dit", WanS2VDiT, cfg.dit, TensorIndex.from_safetensors(comp.weights, rename))


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a .safetensors file, or of the shards behind an HF index (read_header first refuses an
    index and shards that disagree)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted({info.file for info in read_header(path).values()}):
        out.update(load_file(str(f), device="cpu"))
    return out


def load_vae(cfg: WanS2VConfig) -> Module:
    path = cfg.files["vae"].weights
    model = build_meta(WanVAE, cfg.vae)
    if cfg.layout == wfiles.DIFFUSERS:
        try:
            sd = adapter_vae.diffusers_to_official(_read_safetensors(path), cfg.vae.num_res_blocks)
        except KeyError as e:
            raise InputError(f"model: {path}: {e.args[0]}") from None
    else:
        sd = load_pth(path)
    model.load_state_dict(aligned(sd), strict=True, assign=True)
    return Module("vae", model, str(path))


def load_text(cfg: WanS2VConfig) -> Module:
    path = cfg.files["t5"].weights
    with torch.device("meta"):
        text = UMT5Text(cfg.t5)
    try:
        # Diffusers text_encoder/ holds transformers' own names: read back to the official ones load_into takes
        # (its tied embedding, stored once or twice, becomes the one token_embedding).
        sd = hf_to_wan(_read_safetensors(path)) if cfg.layout == wfiles.DIFFUSERS else load_pth(path)
        load_into(text.model, aligned(sd))
    except KeyError as e:
        raise InputError(f"model: {path}: {e.args[0]}") from None
    except ValueError as e:
        raise InputError(f"model: {path}: {e}") from None
    return Module("text", text.eval(), str(path))


def _wav2vec2_split(folder: Path, extractor_folder: Path) -> Wav2Vec2Audio:
    """wav2vec2 whose feature extractor lives in another folder (the Diffusers audio_processor/): the CTC model's
    encoder as load_wav2vec2 takes it, wrapped without building a second random encoder (meta)."""
    from transformers import Wav2Vec2ForCTC

    ctc = Wav2Vec2ForCTC.from_pretrained(str(folder), local_files_only=True)
    extractor = Wav2Vec2FeatureExtractor.from_pretrained(str(extractor_folder), local_files_only=True)
    with torch.device("meta"):
        audio = Wav2Vec2Audio(ctc.config, extractor)
    audio.model = ctc.wav2vec2.eval().requires_grad_(False)
    return audio


def load_audio(cfg: WanS2VConfig) -> Module:
    folder = cfg.files["wav2vec2"].root
    processor = folder.parent / "audio_processor"
    try:
        if cfg.layout == wfiles.DIFFUSERS and not (folder / wfiles.W2V_EXTRACTOR).is_file():
            audio = _wav2vec2_split(folder, processor)
        else:
            audio = Wav2Vec2Audio.from_folder(folder)
    except (OSError, ValueError) as e:
        raise InputError(f"model: {folder}: cannot load wav2vec2 ({str(e).splitlines()[0]})") from None
    if audio.dim != cfg.dit.audio_dim:
        raise InputError(f"model: {folder}: wav2vec2 hidden_size {audio.dim} != the DiT's audio_dim "
                         f"{cfg.dit.audio_dim}")
    return Module("audio", audio.eval(), str(folder))


def load_components(cfg: WanS2VConfig) -> dict[str, Module]:
    return {"text": load_text(cfg), "audio": load_audio(cfg), "dit": load_dit(cfg), "vae": load_vae(cfg)}


# --- models init --------------------------------------------------------------------------------------------

def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every weight random, the zero-initialised ones included (the official `WanModel_S2V.init_weights` and
    `zero_init_weights`, wan/modules/s2v/model_s2v.py, zero the head and the injector outputs: a random model built
    that way outputs constants and hides every bug downstream)."""
    for name, p in model.named_parameters():
        if p.dim() <= 1 and ("norm" in name or name.endswith(".weight") and p.dim() == 1):
            p.data = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)  # norms/gains stay near one
        else:
            fan_in = max(1, p[0].numel() if p.dim() > 1 else p.numel())
            p.data = torch.randn(p.shape, generator=gen) / fan_in ** 0.5


def _w2v_config(dim: int) -> Wav2Vec2Config:
    """A tiny wav2vec2 of the release's structure (24 layers -> 25 hidden states, stable layer norm)."""
    return Wav2Vec2Config(hidden_size=dim, num_hidden_layers=24, num_attention_heads=2, intermediate_size=2 * dim,
                          conv_dim=(8,) * 7, conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_kernel=(10, 3, 3, 3, 3, 2, 2),
                          num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, do_stable_layer_norm=True,
                          feat_extract_norm="layer", vocab_size=33, architectures=["Wav2Vec2ForCTC"])


LAYOUTS = (wfiles.OFFICIAL, wfiles.DIFFUSERS)
PIPELINE_CLASS = "WanSpeechToVideoPipeline"  # what the Diffusers repacks' model_index.json declares


def init_dir(directory: Path, size: str = "tiny", seed: int = 0, layout: str = wfiles.OFFICIAL) -> WanS2VConfig:
    """Write a random wan-s2v model directory in either released layout: "official" (DiT shards + index +
    config.json, the two .pth files as plain tensor dicts, google/umt5-xxl/, the wav2vec2 folder) or "diffusers"
    (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, audio_encoder/, audio_processor/). The same
    seed gives the same weights in both."""
    if layout not in LAYOUTS:
        raise InputError(f"models init: layout '{layout}' of wan-s2v: choose from {', '.join(LAYOUTS)}")
    if size != "tiny":
        raise InputError(f"models init: size '{size}' of wan-s2v: only 'tiny' is written (the release's 16 B "
                         "random weights would take 33 GB; `bench/load_memory.py` writes large synthetic ones)")
    if directory.exists() and any(directory.iterdir()):
        raise InputError(f"{directory}: exists and is not empty; refusing to overwrite")
    # Written beside the target and renamed into place at the end: a failure leaves no half-written model.
    work = directory.parent / f".{directory.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        _write_tiny(work, seed, layout)
        if directory.exists():
            directory.rmdir()  # empty (checked above)
        work.rename(directory)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return read_config(directory)


def _write_dit(folder: Path, dit_p: WanDiTParams, state: dict[str, torch.Tensor]) -> None:
    """Two shards + index + config.json, as the release's (the Diffusers transformer/ holds the same files)."""
    folder.mkdir(exist_ok=True)
    names = sorted(state)
    half = len(names) // 2
    shards = {f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors": part
              for i, part in enumerate((names[:half], names[half:]))}
    weight_map = {}
    for fname, keys in shards.items():
        save_safetensors({k: state[k] for k in keys}, folder / fname)
        weight_map.update({k: fname for k in keys})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (folder / wfiles.DIT_INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                      "weight_map": weight_map}, indent=2) + "\n")
    config = {"_class_name": wfiles.DIT_CLASS, "model_type": "s2v", "enable_motioner": False,
              **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(dit_p).items()}}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_tiny(directory: Path, seed: int, layout: str = wfiles.OFFICIAL) -> None:
    diffusers = layout == wfiles.DIFFUSERS
    gen = torch.Generator().manual_seed(seed)
    dit_p, vae_p, t5_p = tiny_dit(), VAE_PRESETS["tiny"], T5_TINY

    # Every component is randomised in the same order from one generator whatever the layout, so both layouts
    # of one seed hold the same weights.
    dit = WanS2VDiT(dit_p)
    _randomise(dit, gen)
    _write_dit(directory / "transformer" if diffusers else directory, dit_p,
               {k: v.contiguous() for k, v in dit.state_dict().items()})

    vae = WanVAE(vae_p)
    _randomise(vae, gen)
    vae_state = {k: v.contiguous() for k, v in vae.state_dict().items()}
    if diffusers:
        (directory / "vae").mkdir()
        save_safetensors(adapter_vae.official_to_diffusers(vae_state, vae_p.num_res_blocks),
                         directory / "vae" / wfiles.DIT_SINGLE)
        (directory / "vae" / "config.json").write_text(json.dumps(adapter_vae.diffusers_config(vae_p), indent=2)
                                                       + "\n")
    else:
        torch.save(vae_state, directory / "Wan2.1_VAE.pth")

    text = build_text_encoder(t5_p)
    _randomise(text, gen)
    if diffusers:
        # transformers' own writer, sharded as the release's text_encoder/ is (the tied embedding stored once).
        text.save_pretrained(str(directory / "text_encoder"), max_shard_size="40KB")
        shutil.copytree(TINY_TOKENIZER, directory / "tokenizer")
    else:
        torch.save({k: v.contiguous() for k, v in hf_to_wan(text.state_dict()).items()},
                   directory / "models_t5_umt5-xxl-enc-bf16.pth")
        shutil.copytree(TINY_TOKENIZER, directory / "google" / "umt5-xxl")

    from transformers import Wav2Vec2ForCTC

    w2v_dir = directory / ("audio_encoder" if diffusers else "wav2vec2-large-xlsr-53-english")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ctc = Wav2Vec2ForCTC(_w2v_config(dit_p.audio_dim)).eval()
    ctc.save_pretrained(str(w2v_dir), safe_serialization=True)
    # Diffusers: the extractor only in audio_processor/ (the case where audio_encoder/ lacks its own).
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                             return_attention_mask=True).save_pretrained(
        str(directory / "audio_processor" if diffusers else w2v_dir))
    if diffusers:
        index = {"_class_name": PIPELINE_CLASS, "transformer": ["diffusers", wfiles.DIT_CLASS],
                 "vae": ["diffusers", adapter_vae.DIFFUSERS_CLASS], "text_encoder": ["transformers", "UMT5EncoderModel"],
                 "tokenizer": ["transformers", "T5TokenizerFast"], "audio_encoder": ["transformers", "Wav2Vec2ForCTC"],
                 "audio_processor": ["transformers", "Wav2Vec2Processor"]}
        (directory / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
