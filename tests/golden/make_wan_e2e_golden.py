"""Make the Wan2.2-S2V end-to-end golden: the official `WanS2V.generate` (wan/speech2video.py) on a tiny model
directory written by the official classes, float32 on a CPU, under the official repository's own pins.

    git -C $REPO archive HEAD wan | tar -x -C /tmp/wan22_e2e
    OMP_NUM_THREADS=2 nice -n 19 $OFFICIAL_VENV/bin/python tests/golden/make_wan_e2e_golden.py \
        --wan-repo /tmp/wan22_e2e --official-git $REPO

$REPO is a git clone of Wan-Video/Wan2.2; $OFFICIAL_VENV its own environment (tests/golden/official_env.py create):
the script refuses to run under versions outside that repository's requirements.txt.

The model directory (official layout, written by the official classes into a temporary folder):
- config.json + diffusion_pytorch_model-0000k-of-0000n.safetensors + their index: `WanModel_S2V.save_pretrained`
  (max_shard_size 1MB, so it shards as the release does) of the official class at the DiT goldens' tiny size,
  holding wan_s2v/dit_tiny_weights.safetensors. The class keeps text_dim out of its config.json
  (ignore_for_config): the tiny umT5 is 32 wide, not the release's 4096, so `"text_dim": 32` is added to the file.
- Wan2.1_VAE.pth: the state dict of the official `WanVAE_` at the VAE goldens' tiny size (dim 8), holding
  wan_s2v/vae_tiny_weights.safetensors, saved with torch.save as the release's is.
- models_t5_umt5-xxl-enc-bf16.pth: the official `T5Encoder` at the size `avatar models init --size tiny` writes
  (vocab 128, dim 32, ffn 64, 4 heads, 2 layers, 32 buckets), holding wan_s2v/t5_weights.safetensors with its
  embedding cut to the first 128 rows (the tiny tokenizer's 128 pieces); float32 (the release's is bf16).
- google/umt5-xxl/: wan_s2v/t5_tokenizer/ (the tiny tokenizer, which transformers 4.51 and 5 read alike).
- wav2vec2-large-xlsr-53-english/: a tiny random `Wav2Vec2ForCTC` (24 layers, stable layer norm as
  wav2vec2-large-xlsr-53, hidden 32 = the tiny DiT's audio_dim; the w2v goldens' one is 16 wide) with
  save_pretrained, and a `Wav2Vec2Processor` (the feature extractor and a 33-letter CTC vocabulary, which the
  official AudioEncoder loads) with save_pretrained. Its weights are committed as w2v_model.safetensors.

The job: reference.png (96 x 80, so the resize and the centre crop both act), speech.wav (9.8125 s of 16 kHz
speech-like audio: the official code makes 2 clips of it, 77 + 80 = 157 frames = round(9.8125 x 16)), max_area
64 x 64 (the official area rule then gives 64 x 64), infer_frames 80 (the config's), 6 UniPC steps, shift 3,
guidance 4.5, seed 42, the prompt below and the config's negative prompt.

Writes to tests/golden/wan_s2v_e2e/:
- reference.png, speech.wav: the inputs;
- model/: the small files of the model directory, byte for byte as written (config.json, the DiT index,
  wav2vec2-large-xlsr-53-english/ less its weights); w2v_model.safetensors: that folder's model.safetensors;
- official.safetensors (header metadata `official`: the provenance): `frames` (3, n, 64, 64) float32 in [-1, 1],
  the official output at the frame indices `frame_index` (every 5th frame, which walks all 4 frames of a latent,
  plus the clip boundaries 76, 77 and the last, 156); `latents_0` (16, 20, 8, 8) and `latents_1`: each clip's
  sampled latents; `ref_latent` (16, 1, 8, 8); `motion_1` (16, 19, 8, 8): the motion latents clip 1 is conditioned
  on (the re-encoded last 73 frames of clip 0); `ref_pixels` (3, 64, 64): the reference as the VAE encoder takes it
  (resized, cropped, in [-1, 1]);
- official.json: the job, the versions and commit, the patches, the timings, and `files`: each file of the model
  directory with its sha256, and for weight files each tensor's dtype, shape and sha256, so a test that writes the
  directory again from the committed weights can show it holds exactly what the official classes wrote.

Patches, all applied at run time; the official files are never edited (speech2video.py is patched in a copy):
1. speech2video.py (copy): `self.device = torch.device(f"cuda:{device_id}")` -> `torch.device("cpu")`.
2. `decord` stubbed: speech2video.py imports VideoReader at its top, and uses it only for a pose video or a
   previous video, which this job has neither of.
3. The package `__init__`s of wan, wan.modules, wan.distributed, wan.utils, wan.configs are not run (they import
   every pipeline, and flash_attn); their modules are imported from the tree as they are.
4. `torch.cuda.current_device` returns "cpu" while wan/modules/t5.py is imported (T5EncoderModel's default
   `device=` argument calls it at import).
5. `flash_attention` (wan/modules/attention.py; CUDA and half precision only) is replaced, where the DiT reads
   it, by scaled_dot_product_attention in the inputs' dtype with k_lens as a key mask.
6. float32: the config's `param_dtype` and `t5_dtype` (bf16) set to float32 (the VAE and wav2vec2 are float32
   in the official code already). Its autocast('cuda') regions are off on a machine without CUDA.
7. Sizes: `umt5_xxl` (t5.py) and `_video_vae` (vae2_1.py) hard-code the release's sizes; they are called with
   the tiny sizes instead. `WanModel_S2V.ignore_for_config` without `text_dim` while it loads, so that
   from_pretrained reads the tiny text_dim from config.json (otherwise it always builds the release's 4096). The
   config's text_len (512, the umT5 context the release's DiT takes) set to the tiny DiT's 16.
Everything else runs as published: the T5EncoderModel, Wan2_1_VAE, AudioEncoder (librosa, Wav2Vec2Processor)
and WanModel_S2V.from_pretrained loaders, the area rule, the PIL resize and crop of the reference, the noise,
FlowUniPCMultistepScheduler, CFG, the per-clip decode and the motion re-encode.

Tests never run this script: tests/test_wan_e2e_golden.py renders the same job through `avatar render`.
"""

import argparse
import copy
import hashlib
import importlib
import json
import math
import platform
import shutil
import sys
import tempfile
import time
import types
import wave
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from official_env import as_metadata, provenance  # tests/golden/, on sys.path as the script's folder
from make_wan_dit_goldens import sdpa_flash_attention  # the same CPU stand-in as the DiT goldens

GOLDEN = Path(__file__).resolve().parent
SRC = GOLDEN / "wan_s2v"
OUT = GOLDEN / "wan_s2v_e2e"

# The DiT goldens' tiny size (make_wan_dit_goldens.py TINY), keyword arguments of WanModel_S2V.__init__.
DIT_TINY = dict(
    cond_dim=16, audio_dim=32, num_audio_token=4, enable_adain=True, adain_mode="attn_norm", audio_inject_layers=[0, 2],
    zero_init=True, zero_timestep=True, enable_motioner=False, add_last_motion=True, enable_framepack=True,
    framepack_drop_mode="padd", model_type="s2v", patch_size=(1, 2, 2), text_len=16, in_dim=16, dim=64, ffn_dim=128,
    freq_dim=32, text_dim=32, out_dim=16, num_heads=2, num_layers=3, window_size=(-1, -1), qk_norm=True,
    cross_attn_norm=True, eps=1e-6,
)
# avatar's `models init --size tiny` umT5 (model_dir.T5_TINY) in umt5_xxl's keyword arguments.
T5_TINY = dict(vocab_size=128, dim=32, dim_attn=32, dim_ffn=64, num_heads=4, encoder_layers=2, decoder_layers=2,
               num_buckets=32)
VAE_TINY = dict(dim=8)  # make_wan_vae_goldens.py: the release's structure at dim 8
W2V_DIM = 32  # = DIT_TINY audio_dim

JOB = dict(prompt="A woman is talking to the camera.", seed=42, steps=6, guidance=4.5, shift=3.0, infer_frames=80,
           max_area=64 * 64, num_repeat=2, sample_solver="unipc", seconds=9.8125, sample_rate=16000,
           reference_size=[96, 80])  # reference (width, height)
FRAME_STEP = 5

# Text patches of the copy of the official tree: (file, old, new); each old must occur exactly once.
TEXT_PATCHES = [
    ("wan/speech2video.py", 'self.device = torch.device(f"cuda:{device_id}")', 'self.device = torch.device("cpu")'),
]


def copy_tree(wan_repo: Path, dst: Path) -> Path:
    """A copy of the official wan/ package with TEXT_PATCHES applied."""
    shutil.copytree(wan_repo / "wan", dst / "wan")
    for rel, old, new in TEXT_PATCHES:
        path = dst / rel
        text = path.read_text()
        assert text.count(old) == 1, (rel, old)
        path.write_text(text.replace(old, new))
    return dst


def import_official(tree: Path):
    """wan.speech2video and the modules the maker uses, from the patched copy, with patches 2-5 and 7."""
    # transformers first: its availability probes need real module specs, which the decord stub lacks.
    from transformers import AutoTokenizer, Wav2Vec2ForCTC, Wav2Vec2Processor  # noqa: F401

    for name in ("wan", "wan.modules", "wan.modules.s2v", "wan.distributed", "wan.utils", "wan.configs"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(tree / name.replace(".", "/"))]
        sys.modules[name] = pkg
    decord = types.ModuleType("decord")

    def video_reader(*args, **kwargs):
        raise RuntimeError("decord is stubbed: this job reads no video")

    decord.VideoReader = video_reader
    sys.modules["decord"] = decord
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        t5 = importlib.import_module("wan.modules.t5")
    finally:
        torch.cuda.current_device = real
    wan_model = importlib.import_module("wan.modules.model")
    model_s2v = importlib.import_module("wan.modules.s2v.model_s2v")
    vae2_1 = importlib.import_module("wan.modules.vae2_1")
    s2v = importlib.import_module("wan.speech2video")
    cfg_mod = importlib.import_module("wan.configs.wan_s2v_14B")
    wan_model.flash_attention = sdpa_flash_attention
    model_s2v.flash_attention = sdpa_flash_attention
    umt5_xxl, video_vae = t5.umt5_xxl, vae2_1._video_vae
    t5.umt5_xxl = lambda **kw: umt5_xxl(**{**kw, **T5_TINY})
    vae2_1._video_vae = lambda **kw: video_vae(**{**kw, **VAE_TINY})
    return types.SimpleNamespace(t5=t5, model_s2v=model_s2v, vae2_1=vae2_1, s2v=s2v, config=cfg_mod.s2v_14B)


# --- inputs --------------------------------------------------------------------------------------------------

def speech_like(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """make_wan_text_audio_goldens.speech_like: voiced 'syllables' (a gliding pitch with harmonics, 4 per second)
    over low noise, with a pause; here int16, as a wav file holds it."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * rate))) / rate
    f0 = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(h * phase) / h for h in range(1, 6))
    envelope = np.clip(np.sin(2 * np.pi * 4 * t), 0, None) ** 2 * ((t < 2.5) | (t > 3.2))
    x = 0.3 * voiced * envelope + 0.01 * rng.standard_normal(t.size)
    return np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())


def reference_image(width: int, height: int) -> np.ndarray:
    """A smooth face-like picture with some texture: a bright oval, two dark eyes, a mouth, a coloured gradient."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    u, v = (xx - width / 2) / (width / 2), (yy - height / 2) / (height / 2)
    img = np.stack([90 + 60 * u, 110 + 50 * v, 150 - 40 * u * v], axis=-1)
    face = (u / 0.55) ** 2 + (v / 0.8) ** 2 < 1
    img[face] = [220, 180, 150]
    for cx in (-0.22, 0.22):
        img[((u - cx) / 0.09) ** 2 + ((v + 0.2) / 0.06) ** 2 < 1] = [40, 30, 30]
    img[(np.abs(u) < 0.2) & (np.abs(v - 0.35) < 0.05)] = [150, 50, 60]
    img += (12 * np.sin(1.3 * xx) * np.cos(0.9 * yy))[..., None]  # fine texture, which a resize filters
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


# --- the model directory -------------------------------------------------------------------------------------

def tiny_w2v(folder: Path) -> None:
    """Wav2Vec2ForCTC (wav2vec2-large-xlsr-53's structure at hidden 32) + Wav2Vec2Processor, save_pretrained."""
    from transformers import (Wav2Vec2Config, Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC,
                              Wav2Vec2Processor)

    cfg = Wav2Vec2Config(
        vocab_size=33, hidden_size=W2V_DIM, num_hidden_layers=24, num_attention_heads=2, intermediate_size=2 * W2V_DIM,
        conv_dim=(8,) * 7, conv_kernel=(10, 3, 3, 3, 3, 2, 2), conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_bias=True,
        feat_extract_norm="layer", do_stable_layer_norm=True, num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, feat_extract_activation="gelu", hidden_act="gelu", layer_norm_eps=1e-5,
        architectures=["Wav2Vec2ForCTC"])
    torch.manual_seed(3)
    model = Wav2Vec2ForCTC(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.25 * torch.randn_like(p))
            elif p.dim() >= 2 and "conv" not in name:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)  # larger than the 0.02 init: attention is live
    model.save_pretrained(str(folder), safe_serialization=True)
    letters = ["<pad>", "<s>", "</s>", "<unk>", "|", *"ETAONISRHLDCUMWFGYPBVK'XJQZ-"]
    assert len(letters) == 33
    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "vocab.json"
        vocab.write_text(json.dumps({c: i for i, c in enumerate(letters)}))
        tok = Wav2Vec2CTCTokenizer(str(vocab), unk_token="<unk>", pad_token="<pad>", word_delimiter_token="|")
    ext = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                                   return_attention_mask=True)
    Wav2Vec2Processor(feature_extractor=ext, tokenizer=tok).save_pretrained(str(folder))


def write_model_dir(off, d: Path) -> None:
    d.mkdir(parents=True)
    dit = off.model_s2v.WanModel_S2V(**DIT_TINY).float().eval()
    dit.load_state_dict(load_file(str(SRC / "dit_tiny_weights.safetensors")), strict=True)
    dit.save_pretrained(str(d), max_shard_size="1MB")
    config = json.loads((d / "config.json").read_text())
    assert "text_dim" not in config  # ignore_for_config
    config["text_dim"] = DIT_TINY["text_dim"]
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    vae = off.vae2_1.WanVAE_(**{**dict(z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                       temperal_downsample=[False, True, True], dropout=0.0), **VAE_TINY})
    vae.load_state_dict(load_file(str(SRC / "vae_tiny_weights.safetensors")), strict=True)
    torch.save(vae.state_dict(), d / "Wan2.1_VAE.pth")

    t5 = off.t5.T5Encoder(vocab=T5_TINY["vocab_size"], dim=T5_TINY["dim"], dim_attn=T5_TINY["dim_attn"],
                          dim_ffn=T5_TINY["dim_ffn"], num_heads=T5_TINY["num_heads"],
                          num_layers=T5_TINY["encoder_layers"], num_buckets=T5_TINY["num_buckets"], shared_pos=False,
                          dropout=0.1)
    sd = load_file(str(SRC / "t5_weights.safetensors"))
    sd["token_embedding.weight"] = sd["token_embedding.weight"][:T5_TINY["vocab_size"]].clone()
    t5.load_state_dict(sd, strict=True)
    torch.save(t5.state_dict(), d / "models_t5_umt5-xxl-enc-bf16.pth")

    shutil.copytree(SRC / "t5_tokenizer", d / "google" / "umt5-xxl")
    tiny_w2v(d / "wav2vec2-large-xlsr-53-english")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    return sha256(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def manifest(d: Path) -> dict:
    """Every file: its sha256; weight files also each tensor's dtype, shape and sha256 (and a .pth state dict's
    `_metadata`), what a loader sees, which a test can compare where the bytes of a pickle may differ."""
    out = {}
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        rel = f.relative_to(d).as_posix()
        entry = {"sha256": sha256(f.read_bytes())}
        if f.suffix in (".safetensors", ".pth"):
            sd = load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu",
                                                                                 weights_only=True)
            if f.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(f), "pt") as h:
                    entry["metadata"] = h.metadata()
            entry["tensors"] = {k: [str(v.dtype).removeprefix("torch."), list(v.shape), tensor_digest(v)]
                                for k, v in sd.items()}
            if hasattr(sd, "_metadata"):  # a state_dict's module versions, pickled with it by torch.save
                entry["state_dict_metadata"] = dict(sd._metadata)
        out[rel] = entry
    return out


# --- the run -------------------------------------------------------------------------------------------------

class Recorder:
    """Wraps the pipeline's VAE to keep what generate() encodes and decodes (a read-only tap)."""

    def __init__(self, vae):
        self.vae, self.inputs, self.encoded, self.decoded = vae, [], [], []
        self.encode_, self.decode_ = vae.encode, vae.decode
        vae.encode, vae.decode = self.encode, self.decode

    def encode(self, videos):
        self.inputs.append([u.clone() for u in videos])
        out = self.encode_(videos)
        self.encoded.append([u.clone() for u in out])
        return out

    def decode(self, zs):
        self.decoded.append([u.clone() for u in zs])
        return self.decode_(zs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wan-repo", type=Path, required=True, help="folder holding the extracted wan/ package")
    ap.add_argument("--official-git", type=Path, required=True,
                    help="a git clone of Wan-Video/Wan2.2: its commit and requirements.txt pins are checked "
                    "and recorded")
    args = ap.parse_args()
    prov = provenance(args.official_git, "Wan-Video/Wan2.2")  # refuses outside the official pins
    import librosa
    import PIL
    import soundfile
    import torchvision

    prov.update(pillow=PIL.__version__, torchvision=torchvision.__version__, librosa=librosa.__version__,
                soundfile=soundfile.__version__, torch_threads=str(torch.get_num_threads()),
                machine=platform.machine())
    work = Path(tempfile.mkdtemp(prefix="wan22_e2e_"))
    off = import_official(copy_tree(args.wan_repo.resolve(), work / "tree"))

    OUT.mkdir(parents=True, exist_ok=True)
    from PIL import Image

    Image.fromarray(reference_image(*JOB["reference_size"])).save(OUT / "reference.png")
    write_wav(OUT / "speech.wav", speech_like(JOB["seconds"], JOB["sample_rate"]), JOB["sample_rate"])

    ckpt = work / "Wan2.2-S2V-tiny"
    t0 = time.perf_counter()
    write_model_dir(off, ckpt)
    files = manifest(ckpt)
    model_out = OUT / "model"
    shutil.rmtree(model_out, ignore_errors=True)
    for rel in files:
        if rel.endswith((".safetensors", ".pth")) or rel.startswith("google/"):
            continue  # weights: rebuilt by the test from committed tensors; the tokenizer is wan_s2v/t5_tokenizer
        (model_out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ckpt / rel, model_out / rel)
    shutil.copyfile(ckpt / "wav2vec2-large-xlsr-53-english" / "model.safetensors", OUT / "w2v_model.safetensors")

    cfg = copy.deepcopy(off.config)
    cfg.param_dtype = torch.float32  # patch 6
    cfg.t5_dtype = torch.float32
    cfg.text_len = DIT_TINY["text_len"]  # patch 7: the umT5 context length is the DiT's (512 both in the release)
    cls = off.model_s2v.WanModel_S2V
    ignored = cls.ignore_for_config
    cls.ignore_for_config = [k for k in ignored if k != "text_dim"]  # patch 7, while it loads
    try:
        pipe = off.s2v.WanS2V(config=cfg, checkpoint_dir=str(ckpt), device_id=0, rank=0)
    finally:
        cls.ignore_for_config = ignored
    assert pipe.noise_model.text_dim == DIT_TINY["text_dim"]
    assert next(pipe.noise_model.parameters()).dtype == torch.float32
    rec = Recorder(pipe.vae)
    t1 = time.perf_counter()
    video = pipe.generate(
        input_prompt=JOB["prompt"], ref_image_path=str(OUT / "reference.png"), audio_path=str(OUT / "speech.wav"),
        enable_tts=False, tts_prompt_audio=None, tts_prompt_text=None, tts_text=None, num_repeat=JOB["num_repeat"],
        pose_video=None, max_area=JOB["max_area"], infer_frames=JOB["infer_frames"], shift=JOB["shift"],
        sample_solver=JOB["sample_solver"], sampling_steps=JOB["steps"], guide_scale=JOB["guidance"], n_prompt="",
        seed=JOB["seed"], offload_model=False, init_first_frame=False)  # (3, N, H, W) in [-1, 1]
    t2 = time.perf_counter()
    print(f"generate: {tuple(video.shape)} in {t2 - t1:.1f} s (model dir {t1 - t0:.1f} s)")
    n = video.shape[1]
    assert n == 157 and video.shape[2:] == (64, 64), video.shape
    lat_motion = (cfg.transformer.motion_frames + 3) // 4
    # encode calls: the reference, the zero motion frames, the pose condition, then after each clip the motion.
    ref_latent = rec.encoded[0][0]
    dec0, dec1 = rec.decoded[0][0], rec.decoded[1][0]  # (16, 1 + 20, h, w) [ref, clip 0]; (16, 19 + 20, h, w)
    assert torch.equal(dec0[:, :1], ref_latent)
    assert torch.equal(dec1[:, :lat_motion], rec.encoded[3][0])
    index = sorted(set(range(0, n, FRAME_STEP)) | {76, 77, n - 1})
    ref_pixels = rec.inputs[0][0]  # (3, 1, H, W): the resized, cropped reference in [-1, 1]
    tensors = {"frames": video[:, index].contiguous(), "frame_index": torch.tensor(index),
               "ref_pixels": ref_pixels[:, 0].contiguous(),
               "latents_0": dec0[:, 1:].contiguous(), "latents_1": dec1[:, lat_motion:].contiguous(),
               "ref_latent": ref_latent.contiguous(), "motion_1": dec1[:, :lat_motion].contiguous()}
    save_file(tensors, str(OUT / "official.safetensors"), metadata=as_metadata(prov))
    meta = {
        "job": {**JOB, "negative_prompt": cfg.sample_neg_prompt, "size": [64, 64], "frames": n,
                "motion_frames": cfg.transformer.motion_frames, "drop_first_motion": cfg.drop_first_motion,
                "reference": "reference.png", "audio": "speech.wav"},
        "official": prov,
        "patches": {"text": [{"file": f, "old": o, "new": w} for f, o, w in TEXT_PATCHES],
                    "run_time": ["decord stubbed", "package __init__s not run",
                                 "torch.cuda.current_device -> 'cpu' while t5.py imports",
                                 "flash_attention -> scaled_dot_product_attention (model.py, model_s2v.py)",
                                 "param_dtype, t5_dtype -> float32", "text_len -> 16 (the tiny DiT's)",
                                 f"umt5_xxl(**{T5_TINY}), _video_vae(**{VAE_TINY}), "
                                 "WanModel_S2V.ignore_for_config without text_dim while from_pretrained runs"]},
        "timings_s": {"model_dir": round(t1 - t0, 2), "generate": round(t2 - t1, 2)},
        "files": files,
        "weights_from": {
            "diffusion_pytorch_model-*.safetensors": "wan_s2v/dit_tiny_weights.safetensors",
            "Wan2.1_VAE.pth": "wan_s2v/vae_tiny_weights.safetensors",
            "models_t5_umt5-xxl-enc-bf16.pth": "wan_s2v/t5_weights.safetensors, token_embedding.weight[:128]",
            "wav2vec2-large-xlsr-53-english/model.safetensors": "wan_s2v_e2e/w2v_model.safetensors",
            "google/umt5-xxl/": "wan_s2v/t5_tokenizer/"},
        "stats": {"frames_mean_abs": round(float(video.abs().mean()), 4),
                  "frames_clipped_fraction": round(float((video.abs() >= 1).float().mean()), 4)},
    }
    (OUT / "official.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    # Not committed: what a disagreement would be traced with.
    debug = {f"encoded_{i}": e[0].contiguous() for i, e in enumerate(rec.encoded)}
    debug.update({f"decoded_{i}": d[0].contiguous() for i, d in enumerate(rec.decoded)}, video=video.contiguous())
    save_file(debug, str(work / "debug.safetensors"))
    print(f"wrote {OUT}; debug tensors and the model directory in {work}")
    print(json.dumps(meta["stats"]))


if __name__ == "__main__":
    main()
