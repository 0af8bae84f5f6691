"""`avatar render` of a tiny two-clip wan-s2v job against the official `WanS2V.generate` run on the same model
directory, inputs, noise, steps and guidance (tests/golden/make_wan_e2e_golden.py, under the official pins).

The model directory is written again here from committed weights, and every file is checked to hold exactly what
the official classes wrote (the golden's sha256 per file). The render runs in this process so that the frames
are read as floats before the 8-bit rounding and the lossy encode, and the latents where the decoder takes them.

Where avatar differs from the official pipeline on purpose (wan_s2v/family.py), the comparison says how:
- the 3-frame lip-sync lead: the official clip r reads the audio of frames 80r..80r+79 and publishes them from
  frame 80r - 3 on; avatar's clip reads the audio of the frames it publishes. Here avatar is given the official
  windows (clip_audio reads 3 frames later), so that both models see the same audio.
- the decoder cache: the official code decodes each later clip from a cleared cache, [19 motion latents + 20 new];
  avatar carries the cache over the whole timeline. Clip 1's frames are compared both ways: avatar's latents
  decoded the official way agree to float rounding; its own continuous decode is bounded as what it is.
- the frame count: the official code makes whole clips (77 + 80 = 157 frames here), avatar round(duration x fps);
  the golden's 9.8125 s of audio makes both 157.
- the reference crop and resize: avatar's wan-s2v reference is the official one (PIL, 8 bits, centre crop) when
  the official crop does not pad, as here (96 x 80 -> 64 x 64): nothing to adjust; the pixels are compared exactly.
"""

import hashlib
import json
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from avatar_cli.families.wan_s2v import model_dir as wan
from avatar_cli.families.wan_s2v.family import LEAD, WanS2VFamily
from avatar_cli.modules.module import save_safetensors
from tests.conftest import avatar

GOLDEN = Path(__file__).parent / "golden"
E2E = GOLDEN / "wan_s2v_e2e"
W2V = "wav2vec2-large-xlsr-53-english"

# float32 rounding, measured as max |avatar - official|: the reference latent 2.4e-7, clip 0's latents 5.7e-6, clip
# 1's motion latents 2.9e-6 and latents 6.4e-6, clip 0's frames 7.0e-6, clip 1's frames decoded the official way
# 1.2e-5 (frames in [-1, 1]). The bound leaves room for other CPUs' kernels.
ROUNDING = 1e-4


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_model_dir(d: Path, files: dict) -> None:
    """The official-layout directory the golden was made from: the small files as committed, the weights from the
    committed tiny weights (written as the official classes wrote them: same tensors, order, dtype, metadata)."""
    shutil.copytree(E2E / "model", d)
    shutil.copytree(GOLDEN / "wan_s2v" / "t5_tokenizer", d / "google" / "umt5-xxl")
    shutil.copyfile(E2E / "w2v_model.safetensors", d / W2V / "model.safetensors")
    dit = load_file(str(GOLDEN / "wan_s2v" / "dit_tiny_weights.safetensors"))
    index = json.loads((d / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(index.values())):
        save_safetensors({k: dit[k] for k, s in index.items() if s == shard}, d / shard, files[shard]["metadata"])
    vae = load_file(str(GOLDEN / "wan_s2v" / "vae_tiny_weights.safetensors"))
    t5 = load_file(str(GOLDEN / "wan_s2v" / "t5_weights.safetensors"))
    t5["token_embedding.weight"] = t5["token_embedding.weight"][:128].clone()  # the tiny tokenizer's 128 pieces
    for name, sd in (("Wan2.1_VAE.pth", vae), ("models_t5_umt5-xxl-enc-bf16.pth", t5)):
        state = OrderedDict((k, sd[k]) for k in files[name]["tensors"])  # the official state_dict's order
        state._metadata = files[name]["state_dict_metadata"]  # and its module versions, as torch.save pickles them
        torch.save(state, d / name)


def write_job(path: Path, model: Path, job: dict) -> None:
    """The golden's job (official.json's `job`) for avatar, its inputs beside it, float32 and an inline decode."""
    for name in ("reference.png", "speech.wav"):
        shutil.copyfile(E2E / name, path.parent / name)
    path.write_text(json.dumps({
        "reference": "reference.png", "audio": "speech.wav", "output": "out/video.mp4", "model": str(model),
        "prompt": job["prompt"], "seed": job["seed"], "video": {"width": 64, "height": 64},
        "sampling": {"steps": job["steps"], "guidance": job["guidance"], "shift": job["shift"]},
        "chunking": {"frames": job["infer_frames"]}, "runtime": {"dtype": "float32", "decode": "inline"}}))


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def check_model_dir(d: Path, files: dict) -> None:
    """Every file the official classes wrote, and nothing else: byte for byte, except the .pth files (torch.save
    writes a random serialization id into each, so no two saves are alike), which must hold the same tensors, in
    the same order, and the same _metadata."""
    assert sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()) == sorted(files)
    for rel, f in files.items():
        # A weight golden this directory is made from changed: make the end-to-end golden again.
        stale = f"{rel} is not what the official classes wrote: run tests/golden/make_wan_e2e_golden.py"
        if not rel.endswith(".pth"):
            assert sha256(d / rel) == f["sha256"], stale
            continue
        sd = torch.load(d / rel, map_location="cpu", weights_only=True)
        got = {k: [str(v.dtype).removeprefix("torch."), list(v.shape), tensor_digest(v)] for k, v in sd.items()}
        assert list(got.items()) == list(f["tensors"].items()), stale
        assert dict(sd._metadata) == f["state_dict_metadata"], stale


@pytest.fixture(scope="module")
def golden() -> tuple[dict, dict]:
    meta = json.loads((E2E / "official.json").read_text())
    with safe_open(str(E2E / "official.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return meta, tensors


def test_render_matches_the_official_generate(tmp_path: Path, golden, monkeypatch):
    meta, official = golden
    job = meta["job"]
    model = tmp_path / "Wan2.2-S2V-tiny"
    write_model_dir(model, meta["files"])
    check_model_dir(model, meta["files"])

    # The lip-sync lead, put back: clip r reads the audio window the official clip r reads (frames 80r..80r+79).
    clip_audio = WanS2VFamily.clip_audio
    monkeypatch.setattr(WanS2VFamily, "clip_audio", lambda self, models, audio, start, length, fps: clip_audio(
        self, models, audio, start + LEAD, length, fps))
    # Read-only taps: the reference picture as the VAE encoder gets it; the latents the decode is handed, the float
    # frames it publishes, the motion latents it makes.
    seen = {"image": [], "z": [], "frames": [], "motion": []}
    reference, decode = WanS2VFamily.reference, WanS2VFamily.decode

    def tapped_reference(self, models, image, device, dtype):
        seen["image"].append(image.clone())  # (3, H, W) in [-1, 1]
        return reference(self, models, image, device, dtype)

    def tapped(self, models, final, state, put):
        seen["z"].append(final.z.clone())  # (n, 16, h, w)

        def tap(x):  # (t, 3, H, W)
            seen["frames"].append(x.float().clone())
            put(x)

        made = decode(self, models, final, state, tap)
        if "motion" in state.tensors:
            seen["motion"].append(state.tensors["motion"].clone())
        return made

    monkeypatch.setattr(WanS2VFamily, "reference", tapped_reference)
    monkeypatch.setattr(WanS2VFamily, "decode", tapped)
    write_job(tmp_path / "job.yaml", model, job)
    result = avatar("render", str(tmp_path / "job.yaml"), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    done = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")][-1]
    assert done["frames"] == job["frames"] == 157  # the frame count: both make 157 of this audio

    z = torch.cat(seen["z"]).transpose(0, 1)  # (16, 1 + 20 + 20, h, w): [ref, clip 0, clip 1]
    assert z.shape[1] == 41
    frames = torch.cat(seen["frames"]).clamp(-1, 1).transpose(0, 1)  # (3, 157, 64, 64), as the official clamps
    assert frames.shape == (3, 157, 64, 64)

    def worst(a: torch.Tensor, b: torch.Tensor) -> float:
        assert a.shape == b.shape, (a.shape, b.shape)
        return float((a - b).abs().max())

    # The reference: resized and cropped as the official code does, to the bit (PIL, 8 bits, ToTensor * 2 - 1).
    assert torch.equal(seen["image"][0], official["ref_pixels"])
    # Conditioning and sampling: the reference latent, each clip's latents, clip 1's motion latents.
    assert worst(z[:, :1], official["ref_latent"]) <= ROUNDING
    assert worst(z[:, 1:21], official["latents_0"]) <= ROUNDING
    assert worst(seen["motion"][0], official["motion_1"]) <= ROUNDING
    assert worst(z[:, 21:], official["latents_1"]) <= ROUNDING

    index = official["frame_index"]
    want = official["frames"]  # (3, n, 64, 64)
    clip0 = index < 77
    # Clip 0: the same decode (a fresh cache, [ref latent, clip 0]), the first 1 + LEAD frames dropped by both.
    assert worst(frames[:, index[clip0]], want[:, clip0]) <= ROUNDING
    # Clip 1 decoded the official way: avatar's own latents, [motion, clip 1] from a cleared cache, the last 80.
    vae = wan.load_vae(wan.read_config(model)).model.eval()
    with torch.no_grad():
        official_way = vae.decode(torch.cat([seen["motion"][0], z[:, 21:]], dim=1)[None])[0][:, -80:]  # (3, 80, ..)
    assert worst(official_way[:, index[~clip0] - 77], want[:, ~clip0]) <= ROUNDING
    # Clip 1 as avatar publishes it: the decoder's cache carried from clip 0's latents instead of rebuilt from the
    # motion latents. Not rounding: this random VAE does not give back what it encodes, so the two contexts differ;
    # their effect fades along the clip (measured mean |diff| 0.28 at frame 77, 0.13 at 115, 0.0035 at 145,
    # 0.0007 at 155; max 1.76 near the seam, 0.022 from frame 145 on).
    carried = (frames[:, index[~clip0]] - want[:, ~clip0]).abs().amax(dim=(0, 2, 3))  # per frame
    late = index[~clip0] >= 145
    assert float(carried[late].max()) < 0.05 and float(carried[~late].max()) > 0.1, carried
