"""SwiftVR in avatar's own code (avatar_cli/sr/swiftvr): the window rules, RoPE extension, release keys, the
release directory check, and the stream's chunking, carried state and resume. The comparisons with the official
code's outputs are in tests/test_swiftvr_golden.py."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load, save

from avatar_cli.errors import InputError
from avatar_cli.modules.module import build_meta, save_safetensors
from avatar_cli.sr.swiftvr import adapter
from avatar_cli.sr.swiftvr.dit import SwiftVRDiT, SwiftVRParams, axis_rotations, axis_starts, window_layout
from avatar_cli.sr.swiftvr.model_dir import init_tiny, is_release_dir, read_release
from avatar_cli.sr.swiftvr.reae import ReAE, ReAEParams
from avatar_cli.sr.swiftvr.stream import SRStream, load_sr, output_size

LQ = (20, 28)  # cropped to 16 x 24, x4 -> 64 x 96: latents 4 x 6, tokens 2 x 3 under 2 x 2 windows
SCALE = 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return init_tiny(tmp_path_factory.mktemp("swiftvr") / "release", seed=0).root


@pytest.fixture(scope="module")
def models(tiny_dir):
    return load_sr(tiny_dir, "cpu", torch.float32)


def clip(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, *LQ), generator=g, dtype=torch.uint8)


def run(models, frames: torch.Tensor, step: int) -> tuple[torch.Tensor, list[int]]:
    """Push frames `step` at a time, then finish. -> all output frames, and how many each call returned."""
    s = SRStream(models, LQ, SCALE, "cpu", torch.float32)
    outs = [s.push(frames[i:i + step]) for i in range(0, frames.shape[0], step)] + [s.finish()]
    return torch.cat(outs), [o.shape[0] for o in outs]


# --- windows ------------------------------------------------------------------------------------------------------

def test_window_starts_on_the_official_example():
    # 1920 x 1088 output: 34 x 60 tokens, windows of 16.
    assert axis_starts(34, 16, False) == [0, 16, 18]
    assert axis_starts(60, 16, False) == [0, 16, 32, 44]
    assert axis_starts(34, 16, True) == [0, 8, 18]
    assert axis_starts(60, 16, True) == [0, 8, 24, 40, 44]
    assert axis_starts(16, 16, True) == axis_starts(10, 16, False) == [0]
    assert axis_starts(32, 16, False) == axis_starts(32, 16, True) == [0, 16]  # up to 32 tokens both agree


def _reference_starts(size: int, win: int, shifted: bool) -> list[int]:
    """The official rule written out with tensors (a second, independent statement of it)."""
    if size <= win:
        return [0]
    k = torch.arange((size + win - 1) // win + 2)
    s = torch.unique((k * win - (win // 2 if shifted else 0)).clamp(0, size - win), sorted=True)
    if s.numel() > 2:
        keep = torch.ones_like(s, dtype=torch.bool)
        keep[1:-1] = ~(s[2:] <= s[:-2] + win)
        s = s[keep]
    return s.tolist()


def test_window_starts_match_the_rule_on_many_sizes():
    for win in (2, 3, 5, 16):
        for size in range(1, 80):
            for shifted in (False, True):
                assert axis_starts(size, win, shifted) == _reference_starts(size, win, shifted), (size, win, shifted)


@pytest.mark.parametrize("T,H,W,wh,ww", [(2, 34, 60, 16, 16), (3, 5, 7, 2, 3), (1, 4, 4, 4, 4)])
def test_window_gather_and_scatter_match_an_overwrite_loop(T, H, W, wh, ww):
    """Official scatter: windows written in order, the last write wins: from the highest window down on plain
    blocks (lowest wins), from the lowest up on shifted ones (highest wins)."""
    for shifted in (False, True):
        hs, ws = axis_starts(H, wh, shifted), axis_starts(W, ww, shifted)
        lin = torch.tensor([[(t * H + h0 + dy) * W + w0 + dx for t in range(T) for dy in range(wh) for dx in range(ww)]
                            for h0 in hs for w0 in ws])  # (Nw, Lw)
        owner = torch.full((T * H * W,), -1)
        order = range(lin.shape[0]) if shifted else range(lin.shape[0] - 1, -1, -1)
        for wi in order:
            owner[lin[wi]] = wi * lin.shape[1] + torch.arange(lin.shape[1])
        gather, ours = window_layout(T, H, W, wh, ww, shifted)
        assert torch.equal(gather, lin.reshape(-1))
        assert torch.equal(ours, owner) and bool((owner >= 0).all())


# --- RoPE ---------------------------------------------------------------------------------------------------------

def _official_table(dim: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The official table grown past `rows` as `_ensure_rope_cache_len` grows it: float32 rows, then the
    extension angle0 + p * atan2(rotation row 0 -> row 1), in float64."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.outer(torch.arange(rows, dtype=torch.float64), inv)
    cos, sin = ang.cos().float(), ang.sin().float()
    c, s = cos.double(), sin.double()
    step = torch.atan2(s[1] * c[0] - c[1] * s[0], c[1] * c[0] + s[1] * s[0])
    a = torch.atan2(s[0], c[0]) + torch.arange(rows, 3 * rows, dtype=torch.float64)[:, None] * step
    return torch.cat([cos, a.cos().float()]), torch.cat([sin, a.sin().float()])


def test_rope_extension_past_the_table_follows_the_official_rule():
    dim, rows = 44, 16
    want_cos, want_sin = _official_table(dim, rows)
    cos, sin = axis_rotations(torch.arange(3 * rows), dim, rows, torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    # The extension is not the exact angle: at these positions it differs from cos(p * inv) in float64.
    exact = torch.outer(torch.arange(3 * rows, dtype=torch.float64),
                        1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)))
    assert not torch.equal(cos[rows:], exact[rows:].cos().float())


def test_rope_dims_split_as_the_official_axes():
    assert SwiftVRParams.release().rope_dims == (44, 42, 42)


# --- keys and config ----------------------------------------------------------------------------------------------

def test_release_sizes_have_the_release_key_counts_and_parameters():
    dit = build_meta(SwiftVRDiT, SwiftVRParams.release())
    keys = dit.state_dict()
    assert len(keys) == 825
    assert sum(p.numel() for p in dit.parameters()) == 4_999_787_712
    assert tuple(keys["blocks.29.ffn.net.0.proj.weight"].shape) == (14336, 3072)
    assert tuple(keys["condition_embedder.time_proj.weight"].shape) == (18432, 3072)
    assert tuple(keys["proj_out.weight"].shape) == (192, 3072)
    assert tuple(keys["patch_embedding.weight"].shape) == (3072, 48, 1, 2, 2)
    reae = build_meta(ReAE, ReAEParams.release())
    rk = reae.state_dict()
    assert len(rk) == 128 and sum(p.numel() for p in reae.parameters()) == 40_946_364
    assert tuple(rk["decoder.13.conv3d.weight"].shape) == (256, 256, 3, 1, 1)
    assert tuple(rk["decoder.7.proj.weight"].shape) == (512, 512, 1, 1)
    assert tuple(rk["encoder.4.conv.0.weight"].shape) == (64, 128, 3, 3)


def test_fused_projections_and_norm_added_q_are_ignored_as_the_official_loader_does():
    assert adapter.release_to_ours("blocks.3.attn1.to_qkv.weight") is None
    assert adapter.release_to_ours("blocks.3.attn2.to_kv.bias") is None
    assert adapter.release_to_ours("blocks.0.attn2.norm_added_q.weight") is None
    assert adapter.release_to_ours("blocks.3.attn1.to_q.weight") == "blocks.3.attn1.to_q.weight"


def test_config_round_trip_and_official_defaults():
    p = SwiftVRParams.release()
    assert adapter.params_from_config(adapter.config_from_params(p)) == p
    # A field the file lacks takes the official class's default, as diffusers' from_pretrained gives it.
    cfg = adapter.config_from_params(p)
    del cfg["self_attn_window_hw"], cfg["rope_max_seq_len"]
    assert adapter.params_from_config(cfg) == p
    with pytest.raises(ValueError, match="image_dim"):
        adapter.params_from_config({**cfg, "image_dim": 1280})
    with pytest.raises(ValueError, match="unknown key.*audio_dim"):
        adapter.params_from_config({**cfg, "audio_dim": 1024})


# --- the release directory ----------------------------------------------------------------------------------------

def test_tiny_release_is_recognised_and_loads_strictly(tiny_dir, models):
    assert is_release_dir(tiny_dir)
    rel = read_release(tiny_dir)
    from safetensors.torch import load_file

    state = load_file(str(tiny_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert set(state) == set(models.dit.state_dict())
    assert all(torch.equal(state[k], v) for k, v in models.dit.state_dict().items())
    assert models.prompt.shape == (rel.prompt.shape[1], rel.dit.text_dim)


def test_sharded_transformer_and_fused_keys_load(tmp_path, tiny_dir):
    d = init_tiny(tmp_path / "sharded", seed=0, shards=3).root
    assert (d / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    a, b = load_sr(d, "cpu", torch.float32), load_sr(tiny_dir, "cpu", torch.float32)
    assert all(torch.equal(v, b.dit.state_dict()[k]) for k, v in a.dit.state_dict().items())
    # A state dict saved after fuse_projections: the extra to_qkv / to_kv are tolerated and not read.
    from safetensors.torch import load_file

    f = tmp_path / "fused"
    shutil.copytree(tiny_dir, f)
    path = f / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(path))
    state["blocks.0.attn1.to_qkv.weight"] = torch.cat([state[f"blocks.0.attn1.to_{x}.weight"] for x in "qkv"])
    state["blocks.0.attn2.to_kv.weight"] = torch.cat([state[f"blocks.0.attn2.to_{x}.weight"] for x in "kv"])
    save_safetensors(state, path)
    assert read_release(f).dit == b.dit.params


def _copy(tiny_dir, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(tiny_dir, d)
    return d


def _edit_file(path, edit):
    from safetensors.torch import load_file

    state = load_file(str(path))
    edit(state)
    save_safetensors(state, path)


@pytest.mark.parametrize("case,match", [
    ("no_reae", "missing reae.safetensors"),
    ("pickled_reae", "reae.pth: a pickled checkpoint"),
    ("no_transformer", "missing diffusion_pytorch_model.safetensors"),
    ("no_prompt", "missing prompt_embedding.safetensors"),
    ("prompt_key", "missing key 'prompt_emb'"),
    ("prompt_shape", r"prompt_emb has shape \[6, 16\]"),
    ("dit_unexpected", "unexpected keys: blocks.0.extra.weight"),
    ("dit_missing", "missing keys: proj_out.bias"),
    ("dit_shape", r"shape mismatch: blocks.1.attn1.to_q.weight \(file \[24, 12\], config \[24, 24\]\)"),
    ("reae_shape", r"shape mismatch: encoder.4.conv.2.weight"),
    ("s2v", "a Wan2.2-S2V transformer, not the SwiftVR transformer"),
    ("official_wan", "an official Wan2.x 'ti2v' checkpoint"),
    ("wan_pipeline", "a Wan2.2 diffusers pipeline \\(WanPipeline\\)"),
    ("config_field", "image_dim=1280"),
])
def test_bad_release_directories_are_refused_by_name(tiny_dir, tmp_path, case, match):
    d = _copy(tiny_dir, tmp_path)
    cfg_path = d / "transformer" / "config.json"
    dit_file = d / "transformer" / "diffusion_pytorch_model.safetensors"
    cfg = json.loads(cfg_path.read_text())
    if case == "no_reae":
        (d / "reae.safetensors").unlink()
    elif case == "pickled_reae":
        (d / "reae.safetensors").rename(d / "reae.pth")
    elif case == "no_transformer":
        dit_file.unlink()
    elif case == "no_prompt":
        (d / "prompt_embedding.safetensors").unlink()
    elif case == "prompt_key":
        save_safetensors({"embedding": torch.zeros(1, 6, 16)}, d / "prompt_embedding.safetensors")
    elif case == "prompt_shape":
        save_safetensors({"prompt_emb": torch.zeros(6, 16)}, d / "prompt_embedding.safetensors")
    elif case == "dit_unexpected":
        _edit_file(dit_file, lambda s: s.update({"blocks.0.extra.weight": torch.zeros(2)}))
    elif case == "dit_missing":
        _edit_file(dit_file, lambda s: s.pop("proj_out.bias"))
    elif case == "dit_shape":
        _edit_file(dit_file, lambda s: s.update({"blocks.1.attn1.to_q.weight": torch.zeros(24, 12)}))
    elif case == "reae_shape":
        _edit_file(d / "reae.safetensors", lambda s: s.update({"encoder.4.conv.2.weight": torch.zeros(8, 8, 1, 1)}))
    elif case == "s2v":
        cfg_path.write_text(json.dumps({**cfg, "_class_name": "WanS2VTransformer3DModel"}))
    elif case == "official_wan":
        cfg_path.write_text(json.dumps({"_class_name": "WanModel", "model_type": "ti2v", "dim": 3072}))
    elif case == "wan_pipeline":
        (d / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    elif case == "config_field":
        cfg_path.write_text(json.dumps({**cfg, "image_dim": 1280}))
    with pytest.raises(InputError, match=match) as e:
        read_release(d)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_init_tiny_refuses_a_non_empty_folder(tiny_dir):
    with pytest.raises(InputError, match="not empty"):
        init_tiny(tiny_dir)


# --- the stream ---------------------------------------------------------------------------------------------------

def test_output_size_crops_to_eight_then_scales():
    assert output_size((270, 480), 4) == (1056, 1920)
    assert output_size((20, 28), 4) == (64, 96)
    with pytest.raises(InputError, match="at least 8"):
        output_size((7, 100), 2)
    with pytest.raises(InputError, match="positive integer"):
        output_size((64, 64), 0)


@pytest.mark.parametrize("n,per_call", [
    (13, [0, 13]),  # one LAST chunk (t <= 28)
    (29, [0, 0, 25, 4]),  # FIRST (25 out) once frame 29 arrives, LAST of 1 (4b + 4 = 4)
    (57, [0, 0, 25, 24, 0, 8]),  # FIRST, MIDDLE once frame 53 arrives (4th push), LAST of 5
])
def test_chunks_are_released_once_known_not_last(models, n, per_call):
    out, counts = run(models, clip(n), 14)
    assert counts == per_call and out.shape == (n, 3, 64, 96)
    assert out.dtype == torch.float32 and 0 <= float(out.min()) and float(out.max()) <= 1


def test_push_size_does_not_change_the_output(models):
    frames = clip(33, seed=1)
    a, _ = run(models, frames, 33)
    b, _ = run(models, frames, 1)
    assert torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 2, 26, 31, 52])
def test_frame_counts_not_4a_plus_1_keep_every_frame(models, n):
    """Padded with copies of the last frame to the next 4a + 1: the output is that clip's, cut to n frames (26
    frames pad to 29, which the official chunking runs as FIRST + a LAST of one frame)."""
    frames = clip(n, seed=n)
    padded_n = 4 * math.ceil((n - 1) / 4) + 1
    padded = torch.cat([frames, frames[-1:].expand(padded_n - n, -1, -1, -1)])
    out, _ = run(models, frames, 5)
    want, _ = run(models, padded, 5)
    assert out.shape[0] == n and torch.equal(out, want[:n])


def test_float_input_is_taken_on_0_to_255(models):
    frames = clip(9, seed=3)
    a, _ = run(models, frames, 9)
    b, _ = run(models, frames.float() / 255, 9)
    assert (a - b).abs().max() < 1e-4


def _manual_last_only(models, frames: torch.Tensor) -> torch.Tensor:
    """A clip of t <= 28 frames by hand: one LAST chunk, zeros before its latents, positions from 0, the first
    decode's 3 frames dropped."""
    import torch.nn.functional as F

    x = F.interpolate(frames[:, :, :16, :24].float(), size=(64, 96), mode="bilinear", align_corners=False) / 255
    x = torch.cat([x, x[-1:].expand(3, -1, -1, -1)])
    z, _ = models.reae.encode(x)
    z = z.transpose(0, 1)  # (C, b + 1, h, w)
    pad = 7 - z.shape[1]
    zz = torch.cat([z.new_zeros(z.shape[0], pad, *z.shape[2:]), z], dim=1)
    cond = models.dit.conditioning(models.prompt)
    den = (zz - models.dit(zz, cond, 0))[:, pad:]
    y, _ = models.reae.decode(den.transpose(0, 1))
    return y[3:]


def test_a_last_only_clip_is_padded_with_zero_latents(models):
    frames = clip(9, seed=4)
    with torch.no_grad():
        want = _manual_last_only(models, frames)
    out, _ = run(models, frames, 9)
    assert torch.equal(out, want)


def test_state_dict_round_trip_mid_stream_is_bit_identical(models):
    frames = clip(61, seed=5)
    whole, _ = run(models, frames, 6)
    # Cut points: before anything ran, while FIRST is held, right after FIRST, while a MIDDLE group is held.
    for cut in (6, 24, 30, 48):
        s = SRStream(models, LQ, SCALE, "cpu", torch.float32)
        got = [s.push(frames[i:min(i + 6, cut)]) for i in range(0, cut, 6)]
        # Through a safetensors file's bytes, as a resume checkpoint holds it.
        state = load(save(s.state_dict()))
        assert s.held == cut - sum(g.shape[0] for g in got) and s.held > 0
        assert state["pending"].shape[0] > 0 and all(isinstance(v, torch.Tensor) for v in state.values())
        del s
        r = SRStream(models, LQ, SCALE, "cpu", torch.float32)
        r.load_state_dict(state)
        got += [r.push(frames[i:i + 6]) for i in range(cut, 61, 6)] + [r.finish()]
        assert torch.equal(torch.cat(got), whole), cut


def test_state_of_another_shape_is_refused(models):
    s = SRStream(models, LQ, SCALE, "cpu", torch.float32)
    other = SRStream(models, (24, 32), SCALE, "cpu", torch.float32)
    with pytest.raises(ValueError, match="state of frames"):
        other.load_state_dict(s.state_dict())


def test_bad_frames_are_refused(models):
    s = SRStream(models, LQ, SCALE, "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"expected \(T, 3, 20, 28\)"):
        s.push(torch.zeros(2, 3, 20, 20))
    s.finish()
    with pytest.raises(RuntimeError, match="push after finish"):
        s.push(clip(1))


def test_a_stream_given_nothing_gives_nothing(models):
    s = SRStream(models, LQ, SCALE, "cpu", torch.float32)
    assert s.push(clip(0)).shape == (0, 3, 64, 96) and s.finish().shape == (0, 3, 64, 96) and s.held == 0
