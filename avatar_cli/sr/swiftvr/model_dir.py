"""A SwiftVR release directory (`swiftvr/pipeline.py:SwiftVRPipeline.from_pretrained`), recognised and checked from
the safetensors headers alone, and a random tiny one in the same layout:

    reae.safetensors                    the ReAE (strict; its sizes are read from its own shapes)
    prompt_embedding.safetensors        `prompt_emb` (1, L, text_dim): the fixed prompt, used as prompt_emb[0]
    transformer/config.json             diffusers config of the official WanTransformer3DModel
    transformer/diffusion_pytorch_model.safetensors, or its shards and diffusion_pytorch_model.safetensors.index.json

Every refusal is an InputError (exit 2) naming the file and what is wrong with it: a missing file, a pickled
checkpoint where a safetensors one belongs (never unpickled), a missing, unexpected or mis-shaped tensor, or a
transformer of another model (Wan2.2-S2V, an official Wan2.2 checkpoint, a Wan2.2 diffusers pipeline).

Not told apart: a bare diffusers Wan2.2-TI2V-5B `transformer/` put beside a ReAE. It has the same class, config
fields and tensor names as SwiftVR's (SwiftVR fine-tunes that backbone), and the release's config may lack the
fields only the SwiftVR class registers (`self_attn_window_hw`, `enable_swa`), so nothing in the headers differs.
"""

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from avatar_cli.errors import InputError
from avatar_cli.modules.loading import TensorIndex
from avatar_cli.modules.module import build_meta, save_safetensors
from avatar_cli.modules.tensor_files import TensorInfo, read_safetensors_header
from avatar_cli.sr.swiftvr import adapter
from avatar_cli.sr.swiftvr.dit import SwiftVRDiT, SwiftVRParams
from avatar_cli.sr.swiftvr.reae import ReAE, ReAEParams

REAE_FILE = "reae.safetensors"
PROMPT_FILE = "prompt_embedding.safetensors"
PROMPT_KEY = "prompt_emb"
TRANSFORMER = "transformer"
CONFIG = "config.json"
DIT_SINGLE = "diffusion_pytorch_model.safetensors"
DIT_INDEX = "diffusion_pytorch_model.safetensors.index.json"
_PICKLES = (".pth", ".pt", ".bin", ".ckpt", ".pkl")
# Other models' transformers, by what their config.json says.
_OTHER_CLASSES = {"WanS2VTransformer3DModel": "a Wan2.2-S2V transformer",
                  "WanModel": "an official Wan2.x checkpoint", "WanModel_S2V": "an official Wan2.2-S2V checkpoint",
                  "WanVACETransformer3DModel": "a Wan VACE transformer",
                  "WanAnimateTransformer3DModel": "a Wan2.2-Animate transformer"}
_WAN_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline", "WanSpeechToVideoPipeline", "WanVideoToVideoPipeline")


@dataclass(frozen=True)
class ReleaseDir:
    """A checked release: sizes from its files, and the tensors' places in them (no data read)."""

    root: Path
    reae: ReAEParams
    dit: SwiftVRParams
    reae_index: TensorIndex
    dit_index: TensorIndex
    prompt: TensorInfo  # the `prompt_emb` entry, (B, L, text_dim)


def is_release_dir(path: Path) -> bool:
    """Looks like a SwiftVR release (its ReAE file and a transformer config); `read_release` checks it."""
    path = Path(path)
    return path.is_dir() and (path / TRANSFORMER / CONFIG).is_file() and any(
        (path / REAE_FILE.replace(".safetensors", ext)).is_file() for ext in (".safetensors", *_PICKLES))


def _safetensors(path: Path, what: str) -> Path:
    """The safetensors file at `path`, refusing a pickle in its place by name."""
    if path.is_file():
        return path
    for ext in _PICKLES:
        pickled = path.with_suffix(ext)
        if pickled.is_file():
            raise InputError(f"swiftvr: {pickled}: a pickled checkpoint; only safetensors are read (convert it to "
                             f"{path.name})")
    raise InputError(f"swiftvr: {path.parent}: missing {path.name} ({what})")


def _dit_params(folder: Path) -> SwiftVRParams:
    cfg_path = folder / CONFIG
    if not cfg_path.is_file():
        raise InputError(f"swiftvr: {folder}: missing {CONFIG} (the transformer's config)")
    try:
        cfg = json.loads(cfg_path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise InputError(f"swiftvr: {cfg_path}: not a readable config ({e})") from None
    cls = cfg.get("_class_name")
    if cls in _OTHER_CLASSES or "model_type" in cfg:
        kind = f"an official Wan2.x '{cfg['model_type']}' checkpoint" if "model_type" in cfg else _OTHER_CLASSES[cls]
        raise InputError(f"swiftvr: {cfg_path}: {kind}, not the SwiftVR transformer ({adapter.DIT_CLASS})")
    if cls is not None and cls != adapter.DIT_CLASS:
        raise InputError(f"swiftvr: {cfg_path}: _class_name {cls!r}, not the SwiftVR transformer "
                         f"({adapter.DIT_CLASS})")
    try:
        return adapter.params_from_config(cfg)
    except ValueError as e:
        raise InputError(f"swiftvr: {cfg_path}: {e}") from None


def _dit_index(folder: Path) -> TensorIndex:
    """The transformer's tensors under our names: the sharded index when there is one, else the single file."""
    path = folder / DIT_INDEX if (folder / DIT_INDEX).is_file() else _safetensors(
        folder / DIT_SINGLE, "the transformer's weights, or their shards and index")
    return TensorIndex.from_safetensors(path, rename=adapter.release_to_ours)


def _reae_params(index: TensorIndex) -> ReAEParams:
    """The ReAE's sizes from its own tensor shapes (the release's are the official defaults)."""
    need = ("encoder.0.weight", "encoder.17.weight", "decoder.1.weight", "decoder.8.weight", "decoder.14.weight",
            "decoder.20.weight")
    missing = [k for k in need if k not in index]
    if missing:
        raise InputError(f"swiftvr: {index.source}: not a ReAE checkpoint (missing keys: {', '.join(missing)})")
    pix = index["encoder.0.weight"].shape[1]
    patch = math.isqrt(pix // 3)
    if 3 * patch * patch != pix:
        raise InputError(f"swiftvr: {index.source}: encoder.0.weight takes {pix} channels, not 3 x patch^2")
    dims = tuple(index[f"decoder.{i}.weight"].shape[0] for i in (1, 8, 14, 20))
    return ReAEParams(enc_dim=index["encoder.0.weight"].shape[0], dec_dims=dims,
                      latent_channels=index["encoder.17.weight"].shape[0], patch=patch)


def read_release(path: Path) -> ReleaseDir:
    """Recognise and check a release directory from headers alone (see the module docstring)."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"swiftvr: {root}: not a directory")
    pipeline = root / "model_index.json"
    if pipeline.is_file():
        try:
            cls = json.loads(pipeline.read_text()).get("_class_name")
        except (OSError, ValueError, AttributeError):
            cls = None
        if cls in _WAN_PIPELINES:
            raise InputError(f"swiftvr: {root}: a Wan2.2 diffusers pipeline ({cls}), not a SwiftVR release")
    dit_p = _dit_params(root / TRANSFORMER)
    dit_index = _dit_index(root / TRANSFORMER)
    dit_index.check(build_meta(SwiftVRDiT, dit_p))

    reae_index = TensorIndex.from_safetensors(_safetensors(root / REAE_FILE, "the ReAE"))
    reae_p = _reae_params(reae_index)
    reae_index.check(build_meta(ReAE, reae_p))
    if reae_p.latent_channels != dit_p.in_channels or dit_p.out_channels != dit_p.in_channels:
        raise InputError(f"swiftvr: {root}: the ReAE has {reae_p.latent_channels} latent channels, the transformer "
                         f"takes {dit_p.in_channels} and gives {dit_p.out_channels}")

    prompt_path = _safetensors(root / PROMPT_FILE, "the prompt embedding")
    infos = read_safetensors_header(prompt_path)
    if PROMPT_KEY not in infos:
        raise InputError(f"swiftvr: {prompt_path}: missing key {PROMPT_KEY!r} (found: {', '.join(sorted(infos))})")
    prompt = infos[PROMPT_KEY]
    if len(prompt.shape) != 3 or prompt.shape[0] < 1 or prompt.shape[1] < 1 or prompt.shape[2] != dit_p.text_dim:
        raise InputError(f"swiftvr: {prompt_path}: {PROMPT_KEY} has shape {list(prompt.shape)}, expected "
                         f"[1, L, {dit_p.text_dim}] (text_dim of the transformer)")
    if not prompt.dtype.is_floating_point:
        raise InputError(f"swiftvr: {prompt_path}: {PROMPT_KEY} is {prompt.dtype}, not a float tensor")
    return ReleaseDir(root, reae_p, dit_p, reae_index, dit_index, prompt)


# --- a random tiny release ---------------------------------------------------------------------------------------

def tiny_params() -> tuple[ReAEParams, SwiftVRParams, int]:
    """Toy sizes of the release's topology (windows of 2 x 2 tokens, so small frames still have several), and the
    prompt length."""
    reae = ReAEParams(enc_dim=8, dec_dims=(16, 16, 8, 8), latent_channels=16)
    dit = SwiftVRParams(patch_size=(1, 2, 2), num_heads=2, head_dim=12, in_channels=16, out_channels=16, text_dim=16,
                        freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024,
                        window_hw=(2, 2))
    return reae, dit, 6


def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every tensor random (gains near one, the rest ~ 1/sqrt(fan-in)): a zero-initialised part would hide bugs."""
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.data = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            fan_in = max(1, p[0].numel() if p.dim() > 1 else p.numel())
            p.data = torch.randn(p.shape, generator=gen) / fan_in ** 0.5


def init_tiny(directory: Path, seed: int = 0, shards: int = 0) -> ReleaseDir:
    """Write a random tiny release to `directory` (absent or empty); shards > 1 splits the transformer into that
    many files behind an index, as diffusers does for large ones. Written beside it and renamed into place."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise InputError(f"{directory}: exists and is not empty; refusing to overwrite")
    work = directory.parent / f".{directory.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    (work / TRANSFORMER).mkdir(parents=True)
    try:
        reae_p, dit_p, prompt_len = tiny_params()
        gen = torch.Generator().manual_seed(seed)
        reae, dit = ReAE(reae_p), SwiftVRDiT(dit_p)
        _randomise(reae, gen)
        _randomise(dit, gen)
        save_safetensors({k: v.contiguous() for k, v in reae.state_dict().items()}, work / REAE_FILE)
        state = {adapter.ours_to_release(k): v.contiguous() for k, v in dit.state_dict().items()}
        if shards > 1:
            names = sorted(state)
            weight_map = {}
            for i in range(shards):
                part = names[i * len(names) // shards:(i + 1) * len(names) // shards]
                fname = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
                save_safetensors({k: state[k] for k in part}, work / TRANSFORMER / fname)
                weight_map.update(dict.fromkeys(part, fname))
            total = sum(v.numel() * v.element_size() for v in state.values())
            (work / TRANSFORMER / DIT_INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        else:
            save_safetensors(state, work / TRANSFORMER / DIT_SINGLE)
        (work / TRANSFORMER / CONFIG).write_text(json.dumps(adapter.config_from_params(dit_p), indent=2) + "\n")
        prompt = torch.randn(1, prompt_len, dit_p.text_dim, generator=gen)
        save_safetensors({PROMPT_KEY: prompt}, work / PROMPT_FILE)
        if directory.exists():
            directory.rmdir()
        work.rename(directory)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return read_release(directory)

