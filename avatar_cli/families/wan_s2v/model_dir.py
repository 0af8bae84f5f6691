"""A Wan2.2-S2V model directory as the renderer uses it: what it holds (read from headers and config files
only), its check, its load into our modules, and `avatar models init` of a random one in the official layout.

The DiT is built from the directory's own config.json (never from code defaults). The two `.pth` files carry
no config: the VAE and T5 sizes are the presets whose names and shapes the file's header matches (the
release's, or the tiny ones `models init --size tiny` writes); a header that matches none is checked
against the release's and every difference named.

Pickles: the `.pth` files are read only through `torch.load(weights_only=True, mmap=True)`
(`modules.tensor_files.load_pth`), which refuses anything but a flat dict of tensors, with exit 2.
"""

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC

from avatar_cli.errors import InputError
from avatar_cli.families.wan_s2v import files as wfiles
from avatar_cli.families.wan_s2v.adapter_t5 import hf_to_wan, load_into
from avatar_cli.families.wan_s2v.components import UMT5Text, Wav2Vec2Audio
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.text import UMT5_XXL, UMT5Params, build_text_encoder
from avatar_cli.families.wan_s2v.vae import WanVAE, WanVAEParams
from avatar_cli.modules.loading import TensorIndex
from avatar_cli.modules.module import Module, build_meta, lazy_module, save_safetensors
from avatar_cli.modules.tensor_files import CheckpointFormatError, load_pth, read_header

FAMILY = "wan-s2v"
TINY_TOKENIZER = Path(__file__).resolve().parent / "tiny_tokenizer"

# The tiny size `models init --size tiny` writes: every code path of the release at a size a CPU renders in
# seconds (fact sheet §8; the text width is the DiT's text_dim, the audio width its audio_dim).
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
    vae_preset: str  # "release", "tiny" or "unknown" (then checked against the release's)
    t5_preset: str

    @property
    def files(self) -> dict[str, wfiles.ComponentFiles]:
        return wfiles.find_layout(self.path).components

    @property
    def size(self) -> str:
        return "full" if self.dit == WanDiTParams.full() else ("tiny" if self.dit == tiny_dit() else "custom")

    def to_json(self) -> str:
        d = {"family": FAMILY, "layout": self.layout, "dit": asdict(self.dit), "vae": asdict(self.vae),
             "t5": asdict(self.t5)}
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


def looks_like(path: Path) -> bool:
    """A directory in one of the release's layouts (cheap: file names only)."""
    try:
        wfiles.find_layout(path)
        return True
    except CheckpointFormatError:
        return False


def _preset(header: dict, presets: dict, expected_of, exact: bool = True) -> str:
    """The preset whose expected names and shapes equal the header's, else "unknown"; with exact=False the one
    sharing the most (name, shape) pairs with it (to compare a damaged file with what it was meant to be)."""
    found = {(k, tuple(v.shape)) for k, v in header.items()}
    score = {name: len(found & {(k, s) for k, (s, _) in expected_of(params).items()})
             for name, params in presets.items()}
    best = max(score, key=score.get)
    if not exact:
        return best
    return best if score[best] == len(found) == len(expected_of(presets[best])) else "unknown"


def _vae_expected(p: WanVAEParams) -> wfiles.Expected:
    with torch.device("meta"):
        return wfiles.expected_from_module(WanVAE(p))


def _t5_expected(p: UMT5Params) -> wfiles.Expected:
    with torch.device("meta"):
        return wfiles.expected_from_module_dict(hf_to_wan(build_text_encoder(p).state_dict()))


def read_config(path: Path) -> WanS2VConfig:
    """The directory's layout and sizes, from config.json and the headers of the VAE and T5 files."""
    try:
        d = wfiles.find_layout(path)
        cfg_path = d.components["dit"].config
        if cfg_path is None or not cfg_path.is_file():
            raise InputError(f"model: {path}: no config.json for the DiT ({cfg_path})")
        try:
            dit = WanDiTParams.from_config(json.loads(cfg_path.read_text()))
        except (ValueError, TypeError) as e:
            raise InputError(f"model: {cfg_path}: {e}") from None
        if d.layout != wfiles.OFFICIAL:
            raise InputError(f"model: {path}: the Diffusers layout is recognised (avatar models check reads it) but "
                             "not rendered yet: its vae/ and text_encoder/ need their own key adapters; use the "
                             "official layout (Wan-AI/Wan2.2-S2V-14B)")
        vae_file, t5_file = d.components["vae"].weights, d.components["t5"].weights
        for f in (vae_file, t5_file):
            if not f.is_file():
                raise InputError(f"model: {path}: missing {f.name}")
        vae_preset = _preset(read_header(vae_file), VAE_PRESETS, _vae_expected)
        t5_preset = _preset(read_header(t5_file), T5_PRESETS, _t5_expected)
    except CheckpointFormatError as e:
        raise InputError(f"model: {e}") from None
    return WanS2VConfig(Path(path), d.layout, dit, VAE_PRESETS.get(vae_preset, WanVAEParams.full()),
                        T5_PRESETS.get(t5_preset, UMT5_XXL), vae_preset, t5_preset)


def check_path(path: Path) -> wfiles.DirReport:
    """`avatar models check`: any layout, headers only. The VAE and T5 are compared with the preset their header
    matches (the release's when none does, so every difference is named)."""
    d = wfiles.find_layout(path)
    expected = {}
    if d.layout == wfiles.OFFICIAL:
        for comp, presets, of in (("vae", VAE_PRESETS, _vae_expected), ("t5", T5_PRESETS, _t5_expected)):
            f = d.components[comp].weights
            if f is not None and f.is_file():
                try:
                    name = _preset(read_header(f), presets, of, exact=False)
                except CheckpointFormatError:
                    continue  # check_dir reports the unreadable file
                expected[comp] = of(presets.get(name, presets["release"]))
    return wfiles.check_dir(path, expected)


def check(cfg: WanS2VConfig) -> wfiles.DirReport:
    """Headers only: every component's names, shapes (and the DiT's config) against our modules."""
    expected = {"vae": _vae_expected(cfg.vae), "t5": _t5_expected(cfg.t5)}
    return wfiles.check_dir(cfg.path, expected)


def check_or_fail(cfg: WanS2VConfig) -> None:
    report = check(cfg)
    if not report.ok:
        bad = [line for line in report.lines() if "missing" in line or "unexpected" in line or "mis" in line
               or "not found" in line or "wrong" in line]
        raise InputError(f"model: {cfg.path}: the files do not fit the wan-s2v architecture: "
                         + "; ".join(s.strip() for s in (bad or report.lines())[:4])
                         + f" (run `avatar models check {cfg.path}` for the full report)")


def _aligned(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """64-byte aligned tensors (see modules.module.load_module: unaligned ones take slower, differently
    rounding BLAS paths)."""
    return {k: v if v.data_ptr() % 64 == 0 else v.clone() for k, v in sd.items()}


def load_dit(cfg: WanS2VConfig) -> Module:
    """Lazy: built on meta from config.json with its headers checked; placement reads it onto the device, or
    under FSDP2 each rank only its own rows (modules/loading.py), so 14B is never copied once per rank."""
    comp = cfg.files["dit"]
    return lazy_module("dit", WanS2VDiT, cfg.dit, TensorIndex.from_safetensors(comp.weights))


def load_vae(cfg: WanS2VConfig) -> Module:
    path = cfg.files["vae"].weights
    model = build_meta(WanVAE, cfg.vae)
    model.load_state_dict(_aligned(load_pth(path)), strict=True, assign=True)
    return Module("vae", model, str(path))


def load_text(cfg: WanS2VConfig) -> Module:
    path = cfg.files["t5"].weights
    with torch.device("meta"):
        text = UMT5Text(cfg.t5)
    try:
        load_into(text.model, _aligned(load_pth(path)))
    except ValueError as e:
        raise InputError(f"model: {path}: {e}") from None
    return Module("text", text.eval(), str(path))


def load_audio(cfg: WanS2VConfig) -> Module:
    folder = cfg.files["wav2vec2"].root
    try:
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
    """Every weight random, the zero-initialised ones included (fact sheet §9.16: a zero head or zero
    injector outputs would make a random model output constants and hide every bug downstream)."""
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


def init_dir(directory: Path, size: str = "tiny", seed: int = 0) -> WanS2VConfig:
    """Write a random wan-s2v model directory in the official layout (DiT shards + index + config.json, the
    two .pth files as plain tensor dicts, the tokenizer folder, the wav2vec2 folder)."""
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
        _write_tiny(work, seed)
        if directory.exists():
            directory.rmdir()  # empty (checked above)
        work.rename(directory)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return read_config(directory)


def _write_tiny(directory: Path, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dit_p, vae_p, t5_p = tiny_dit(), VAE_PRESETS["tiny"], T5_TINY

    dit = WanS2VDiT(dit_p)
    _randomise(dit, gen)
    state = {k: v.contiguous() for k, v in dit.state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    shards = {f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors": part
              for i, part in enumerate((names[:half], names[half:]))}
    weight_map = {}
    for fname, keys in shards.items():
        save_safetensors({k: state[k] for k in keys}, directory / fname)
        weight_map.update({k: fname for k in keys})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (directory / wfiles.DIT_INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                         "weight_map": weight_map}, indent=2) + "\n")
    config = {"_class_name": wfiles.DIT_CLASS, "model_type": "s2v", "enable_motioner": False,
              **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(dit_p).items()}}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    vae = WanVAE(vae_p)
    _randomise(vae, gen)
    torch.save({k: v.contiguous() for k, v in vae.state_dict().items()}, directory / "Wan2.1_VAE.pth")
    text = build_text_encoder(t5_p)
    _randomise(text, gen)
    torch.save({k: v.contiguous() for k, v in hf_to_wan(text.state_dict()).items()},
               directory / "models_t5_umt5-xxl-enc-bf16.pth")
    shutil.copytree(TINY_TOKENIZER, directory / "google" / "umt5-xxl")

    w2v_dir = directory / "wav2vec2-large-xlsr-53-english"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ctc = Wav2Vec2ForCTC(_w2v_config(dit_p.audio_dim)).eval()
    ctc.save_pretrained(str(w2v_dir), safe_serialization=True)
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                             return_attention_mask=True).save_pretrained(str(w2v_dir))
