"""SwiftVR against the official code's outputs at a tiny size (tests/golden/swiftvr/, made by
tests/golden/make_swiftvr_goldens.py: official `SwiftVRPipeline.restore_video`, float32 on CPU, SDPA, matmul
precision "highest"). These tests never import the official code.

The release directory is the golden's `release/` (transformer and prompt as the official classes saved them) plus a
`reae.safetensors` rebuilt from the golden's seeded rule (the official ReAE has no size arguments: 41 M parameters
are not committed); its sha256 is checked against the golden's.

On the machine the goldens were made on, every comparison here is bit-identical (largest error 0: the ops are
the official ones, rounded where the official code rounds). The tolerances leave room for float32 op-order noise
where another CPU's kernels (another ISA, another thread count) sum in another order.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from avatar_cli.modules.module import build_meta, save_safetensors
from avatar_cli.sr.swiftvr import adapter
from avatar_cli.sr.swiftvr.dit import SwiftVRDiT, axis_rotations, axis_starts
from avatar_cli.sr.swiftvr.model_dir import read_release
from avatar_cli.sr.swiftvr.reae import ReAE, ReAEParams
from avatar_cli.sr.swiftvr.stream import SRStream, load_sr
from tests.golden.swiftvr_weights import seeded_weights, tensor_sha256

GOLDEN = Path(__file__).parent / "golden" / "swiftvr"
CASES = ("a", "b", "c1", "e")  # c2 is the README's stream() API, a different chunking not offered here

# Largest errors allowed; the tensors are of order 0.5, and the largest errors measured are 0.
TOL_LATENTS = 5e-6  # ReAE latents and MemBlock states
TOL_DIT = 2e-6  # DiT predictions
TOL_FRAMES = 2e-5  # decoded frames, per chunk and through the whole stream
# uint8 output: the official truncation (x * 255 to uint8) of frames equal within TOL_FRAMES may differ by 1 where a
# value sits at an integer.

def _official(name: str) -> dict:
    return json.loads((GOLDEN / "official.json").read_text())[name]


@pytest.fixture(scope="module")
def keys() -> dict:
    return json.loads((GOLDEN / "release" / "keys.json").read_text())


@pytest.fixture(scope="module")
def release(swiftvr_official_dir) -> Path:
    return swiftvr_official_dir


@pytest.fixture(scope="module")
def models(release):
    return load_sr(release, "cpu", torch.float32)


def load_case(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    path = GOLDEN / f"case_{name}.safetensors"
    with safe_open(str(path), "pt") as f:
        case = json.loads(f.metadata()["case"])
        return case, {k: f.get_tensor(k) for k in f.keys()}


def test_release_keys_are_ours_key_for_key(release, keys):
    rel = read_release(release)
    assert rel.reae == ReAEParams.release()
    dit = build_meta(SwiftVRDiT, rel.dit)
    ours = {adapter.ours_to_release(k): list(v.shape) for k, v in dit.state_dict().items()}
    assert ours == keys["transformer/diffusion_pytorch_model.safetensors"]
    reae = build_meta(ReAE, ReAEParams.release())
    assert {k: list(v.shape) for k, v in reae.state_dict().items()} == keys["reae.safetensors"]
    assert keys["prompt_embedding.safetensors"] == {"prompt_emb": [1, 8, rel.dit.text_dim]}


def test_the_weights_load_as_written(models, keys):
    rule = _official("transformer_rule")
    want = seeded_weights(keys["transformer/diffusion_pytorch_model.safetensors"], rule["seed"])
    assert tensor_sha256(want) == rule["sha256"]
    got = {adapter.ours_to_release(k): v for k, v in models.dit.state_dict().items()}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _frames(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return t["input_uint8"].permute(0, 3, 1, 2)  # (N, 3, H, W) uint8


def _stream(models, case: dict, t: dict[str, torch.Tensor]) -> SRStream:
    h, w = t["input_uint8"].shape[1:3]
    return SRStream(models, (h, w), case["upscale"], "cpu", torch.float32, overlap=case.get("dit_overlap", 0))


@pytest.mark.parametrize("name", CASES)
def test_dit_per_chunk_matches(models, name):
    """Each chunk's DiT pass on the official input latents (after LAST padding / the overlap latent), at the
    official RoPE t-offset."""
    case, t = load_case(name)
    cond = models.dit.conditioning(models.prompt)
    worst = 0.0
    for i, c in enumerate(case["chunks"]):
        z = t[f"chunk{i}.dit_in"][0].transpose(0, 1)  # (C, F, h, w)
        with torch.no_grad():
            pred = models.dit(z, cond, c["t_off"]).transpose(0, 1)  # (F, C, h, w)
        worst = max(worst, float((pred - t[f"chunk{i}.dit_pred"][0]).abs().max()))
    assert worst < TOL_DIT, worst


@pytest.mark.parametrize("name", ["a", "b"])  # every chunk kind and the carried states; the rest via the stream
def test_reae_encode_and_decode_per_chunk_match(models, name):
    """Encoder: the chunks of our own upscaled input, state carried, against the official latents. Decoder: the
    official DiT outputs, state carried, against the official decoded frames (trim and crop applied)."""
    case, t = load_case(name)
    s = _stream(models, case, t)
    frames = _frames(t)
    enc, dec = {}, {}
    worst_z = worst_y = 0.0
    for i, c in enumerate(case["chunks"]):
        # Contiguous, as the official preprocessing makes it (a strided input would pick other conv kernels).
        x = frames[c["frame_start"]:c["frame_start"] + c["frame_count"], :, :s._crop[0], :s._crop[1]].contiguous()
        x = x.float()
        x = s._upscale(x)
        if c["kind"] == "last":
            x = torch.cat([x, x[-1:].expand(3, -1, -1, -1)])
        with torch.no_grad():
            z, enc = models.reae.encode(x, enc)
            worst_z = max(worst_z, float((z - t[f"chunk{i}.latents"][0]).abs().max()))
            y, dec = models.reae.decode(t[f"chunk{i}.dit_out"][0], dec)
        if c["is_first_decode"]:
            y = y[3:]
        y = y[:, :, :s.out_hw[0], :s.out_hw[1]]
        want = t[f"chunk{i}.decoded"][0]
        worst_y = max(worst_y, float((y[:want.shape[0]] - want).abs().max()))
        if name == "a" and i == 0:
            for k, v in t.items():
                if k.startswith("state."):
                    side, j = k.split(".")[1], k.split("_")[-1]
                    ours = (enc if side == "enc" else dec)[f"{side}.{j}"]
                    assert (ours - v[0]).abs().max() < TOL_LATENTS, k
    assert worst_z < TOL_LATENTS, worst_z
    assert worst_y < TOL_FRAMES, worst_y


@pytest.mark.parametrize("name", CASES)
def test_the_whole_stream_matches_restore_video(models, name):
    """Frames pushed in uneven groups, then finish: every chunk kind, all state carried by the stream itself."""
    case, t = load_case(name)
    s = _stream(models, case, t)
    frames = _frames(t)[:case["frames_written"]]  # the official drops the tail past 4a + 1; we would keep it
    outs = [s.push(frames[i:i + 11]) for i in range(0, frames.shape[0], 11)] + [s.finish()]
    out = torch.cat(outs)
    assert out.shape[0] == case["frames_written"]
    decoded = torch.cat([t[f"chunk{i}.decoded"][0] for i in range(len(case["chunks"]))])  # (N, 3, H, W)
    n = decoded.shape[0] if case.get("decoded_frames_kept") is None else None
    if n is not None:
        assert (out - decoded).abs().max() < TOL_FRAMES
    u8 = (out * 255).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)  # the official io.py:ntchw_to_uint8_frames
    diff = (u8.int() - t["output_uint8"].int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3


def test_preprocessing_matches_exactly(models):
    case, t = load_case("b")
    s = _stream(models, case, t)
    x = _frames(t)[:, :, :s._crop[0], :s._crop[1]].float()
    assert torch.equal(s._upscale(x), t["chunk0.preprocessed"][0][:x.shape[0]])


def test_rope_table_with_the_extension_matches(models):
    """The official table after case a (grown past rope_max_seq_len = 8): every row, bit for bit."""
    _, t = load_case("a")
    rows = t["rope.freqs_cos"].shape[0]
    p = models.dit.params
    parts = [axis_rotations(torch.arange(rows), d, p.rope_max_seq_len, torch.float32) for d in p.rope_dims]
    cos = torch.cat([c.repeat_interleave(2, dim=1) for c, _ in parts], dim=1)
    sin = torch.cat([s.repeat_interleave(2, dim=1) for _, s in parts], dim=1)
    assert rows > p.rope_max_seq_len
    assert torch.equal(cos, t["rope.freqs_cos"]) and torch.equal(sin, t["rope.freqs_sin"])


@pytest.mark.parametrize("name", CASES)
def test_window_starts_are_the_official_ones_at_each_case(models, name):
    case, _ = load_case(name)
    H, W = case["tokens_hw"]
    wh, ww = (min(w, n) for w, n in zip(models.dit.params.window_hw, (H, W)))
    for kind, shifted in (("plain", False), ("shifted", True)):
        assert [axis_starts(H, wh, shifted), axis_starts(W, ww, shifted)] == case["window_starts"][kind], kind


def test_init_tiny_writes_the_release_layout_the_golden_records(tmp_path, keys):
    from avatar_cli.sr.swiftvr.model_dir import init_tiny

    d = init_tiny(tmp_path / "tiny", seed=0).root
    assert sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()) == [
        "prompt_embedding.safetensors", "reae.safetensors", "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors"]
    golden_cfg = json.loads((GOLDEN / "release" / "transformer" / "config.json").read_text())
    ours_cfg = json.loads((d / "transformer" / "config.json").read_text())
    assert set(ours_cfg) == set(golden_cfg) - {"_diffusers_version"}
    for file, listing in keys.items():
        if file.endswith(".safetensors"):
            with safe_open(str(d / file), "pt") as f:
                assert sorted(f.keys()) == sorted(listing), file  # the same names (2 blocks in both), tiny shapes
