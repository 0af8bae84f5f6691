"""Modules: build on meta, strict safetensors loading, model directories, and the models themselves."""

import json
import os
import stat
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from avatar_cli.errors import InputError
from avatar_cli.families.mini.config import COMPONENTS, SIZES, FamilyConfig
from avatar_cli.modules.module import load_module, save_safetensors
from avatar_cli.families.mini.model_dir import init_model_dir
from avatar_cli.families.registry import check_model, load_modules, resolve_model


def test_model_dir_round_trip(tmp_path):
    modules = init_model_dir(tmp_path / "m", "tiny", seed=5)
    src = resolve_model(str(tmp_path / "m"), tmp_path)
    assert src.trained and src.config == SIZES["tiny"]
    loaded = load_modules(src)
    for name, module in loaded.items():
        for (k, a), (_, b) in zip(modules[name].model.state_dict().items(), module.model.state_dict().items()):
            assert torch.equal(a, b), (name, k)
        assert not any(p.is_meta for p in module.model.parameters())
        # Aligned for BLAS, though safetensors hands out tensors at the file's (unaligned) byte offsets.
        assert all(p.data_ptr() % 64 == 0 for p in module.model.parameters()), name
    raw = load_file(str(tmp_path / "m" / "dit.safetensors"))
    assert any(v.data_ptr() % 64 for v in raw.values())  # what the loader has to fix


def test_model_dir_is_config_plus_safetensors(tmp_path):
    init_model_dir(tmp_path / "m", "tiny")
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == sorted(["config.json"] + [f for f, _ in COMPONENTS.values()])
    assert FamilyConfig.from_dict(json.loads((tmp_path / "m" / "config.json").read_text())) == SIZES["tiny"]


def test_missing_and_unexpected_keys_are_named(tmp_path):
    init_model_dir(tmp_path / "m", "tiny")
    path = tmp_path / "m" / "sr.safetensors"
    state = load_file(str(path))
    state.pop("conv_out.bias")
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(path))
    with pytest.raises(InputError) as e:
        check_model(resolve_model(str(tmp_path / "m"), tmp_path))
    assert "missing keys: conv_out.bias" in str(e.value)
    assert "unexpected keys: extra.weight" in str(e.value)


def test_shape_mismatch_is_named(tmp_path):
    init_model_dir(tmp_path / "m", "tiny")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["sr"]["width"] = 24  # the config no longer matches the weights
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"shape mismatch: .*conv_in\.weight"):
        load_modules(resolve_model(str(tmp_path / "m"), tmp_path))


def test_bad_model_dirs(tmp_path):
    with pytest.raises(InputError, match="neither a shipped model"):
        resolve_model("no-such-model", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json"):
        resolve_model("empty", tmp_path)
    init_model_dir(tmp_path / "m", "tiny")
    (tmp_path / "m" / "dit.safetensors").write_bytes(b"\x00not safetensors")
    with pytest.raises(InputError, match="not a readable safetensors file"):
        check_model(resolve_model("m", tmp_path))
    (tmp_path / "m" / "vae.safetensors").unlink()
    with pytest.raises(InputError, match="missing weights file"):
        check_model(resolve_model("m", tmp_path))


def test_unknown_config_field_is_rejected(tmp_path):
    init_model_dir(tmp_path / "m", "tiny")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["dit"]["depthh"] = 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="depthh"):
        resolve_model("m", tmp_path)


def test_init_refuses_to_overwrite(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "mine.txt").write_text("user data")
    with pytest.raises(InputError, match="not empty"):
        init_model_dir(tmp_path / "m", "tiny")
    assert (tmp_path / "m" / "mine.txt").read_text() == "user data"


@pytest.fixture
def umask():
    """Set the process umask for one test; restored after."""
    saved = os.umask(0o022)
    yield os.umask
    os.umask(saved)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_weights_files_get_the_mode_a_plain_open_gives(tmp_path, umask):
    """safetensors writes a private temp file and renames it: weights came out 0600 beside a 0644 config.json,
    unreadable to other accounts on a shared file system."""
    umask(0o022)
    init_model_dir(tmp_path / "m", "tiny")
    modes = {p.name: _mode(p) for p in (tmp_path / "m").iterdir()}
    assert modes == {name: 0o644 for name in modes} and len(modes) == 1 + len(COMPONENTS)
    umask(0o027)  # the mode follows the umask, as open() does; it is not a fixed 0644
    save_safetensors({"a": torch.zeros(2)}, tmp_path / "g.safetensors", metadata={"k": "v"})
    assert _mode(tmp_path / "g.safetensors") == 0o640
    assert load_file(str(tmp_path / "g.safetensors"))["a"].shape == (2,)


def test_attention_norms_run_in_one_dtype_under_autocast(monkeypatch):
    """Training's bf16 autocast gave the q/k RMSNorm a bf16 input and an fp32 weight: torch warned "Mismatch dtype
    between input and weight" (once per process, so the spy checks the cause, not the warning)."""
    from avatar_cli.families.mini.dit import Attention
    from avatar_cli.families.mini.layers import rope_3d

    seen = []
    real = torch.rms_norm

    def spy(x, shape, weight=None, eps=None):
        seen.append((x.dtype, None if weight is None else weight.dtype))
        return real(x, shape, weight, eps)

    monkeypatch.setattr(torch, "rms_norm", spy)
    torch.manual_seed(0)
    attn = Attention(64, 4)
    pos = torch.arange(6)
    cos, sin = rope_3d(pos, pos, pos, 16)
    x = torch.randn(2, 6, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attn(x, cos, sin)
    assert y.shape == (2, 6, 64) and seen and all(a == b for a, b in seen), seen


@pytest.mark.parametrize("x_dtype,w_dtype,autocast", [(torch.bfloat16, torch.float32, True),
                                                      (torch.bfloat16, torch.float32, False),
                                                      (torch.float32, torch.float32, False),
                                                      (torch.bfloat16, torch.bfloat16, False)])
def test_rms_norm_matches_torch_bit_for_bit(x_dtype, w_dtype, autocast):
    """Same numbers as nn.RMSNorm in every case: inference (matching dtypes) is untouched, and the mixed case
    equals torch's unfused fallback; small inputs so that which epsilon is used would show."""
    from avatar_cli.families.mini.layers import RMSNorm

    torch.manual_seed(0)
    ours, ref = RMSNorm(16), torch.nn.RMSNorm(16)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16))
    ours.load_state_dict(ref.state_dict())
    ours.to(w_dtype), ref.to(w_dtype)
    x = (torch.randn(3, 5, 16) * torch.logspace(-4, 1, 5)[:, None]).to(x_dtype)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        warnings.simplefilter("ignore")  # torch's own mismatch warning, from the reference
        a, b = ours(x), ref(x)
    assert a.dtype == b.dtype == x_dtype and torch.equal(a, b)


def test_module_casts_and_loads_without_pickle(tmp_path, monkeypatch):
    init_model_dir(tmp_path / "m", "tiny")
    # Loading must never unpickle: make torch.load explode and load anyway.
    monkeypatch.setattr(torch, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("pickle used")))
    cls = COMPONENTS["vae"][1]
    module = load_module("vae", cls, SIZES["tiny"].vae, tmp_path / "m" / "vae.safetensors")
    module.to("cpu", torch.bfloat16)
    assert module.dtype == torch.bfloat16 and module.device.type == "cpu"


def test_vae_decoder_cache_makes_chunked_decoding_seamless():
    cfg = SIZES["tiny"]
    torch.manual_seed(0)
    vae = COMPONENTS["vae"][1](cfg.vae).eval()
    z = torch.randn(10, cfg.vae.latent_channels, 8, 8)
    with torch.no_grad():
        whole, _ = vae.decode(z)
        a, cache = vae.decode(z[:4])
        b, _ = vae.decode(z[4:], cache)
        b_nocache, _ = vae.decode(z[4:])
    assert torch.allclose(torch.cat([a, b]), whole, atol=1e-5)
    assert not torch.allclose(b_nocache[:1], whole[4:5], atol=1e-3)  # the cache matters at the seam


def test_dit_shapes_and_mask_conditioning():
    cfg = SIZES["tiny"]
    torch.manual_seed(0)
    dit = COMPONENTS["dit"][1](cfg.dit).eval()
    for p in dit.parameters():  # non-zero everywhere so every input reaches the output
        torch.nn.init.normal_(p, std=0.2)
    p = cfg.dit
    L, C, n = 6, p.latent_channels, p.latent_size
    args = dict(x=torch.randn(1, L, C, n, n), t=torch.rand(1, L), mask=torch.zeros(1, L, dtype=torch.bool),
                audio=torch.randn(1, L, p.audio_dim), ref_lo=torch.randn(1, C, n, n),
                ref_hi=torch.randn(1, C, 2 * n, 2 * n), text=torch.randn(1, 2, p.text_dim))
    with torch.no_grad():
        v = dit(**args)
        assert v.shape == args["x"].shape
        args2 = dict(args, audio=args["audio"].clone())
        args2["audio"][0, 3] += 1.0  # audio of frame 3 changes
        v2 = dit(**args2)
        assert (v2 - v)[0, 3].abs().mean() > (v2 - v)[0, 0].abs().mean()  # mostly frame 3 moves
        v3 = dit(**dict(args, text=args["text"][:, :0]))  # no prompt tokens: still works
        assert v3.shape == v.shape and not torch.allclose(v3, v)


def test_dit_predicting_the_frame_cancels_the_noise_exactly():
    """predict="x": the output is the clean frame as a change from the reference, so at init (zero output) one
    Euler step to t = 1 lands on the reference latent whatever the noise; a velocity model lands on the noise."""
    from dataclasses import replace

    cfg = SIZES["tiny"]
    p = cfg.dit
    L, C, n = 5, p.latent_channels, p.latent_size
    t = torch.full((1, L), 0.3)
    args = dict(x=torch.randn(1, L, C, n, n), t=t, mask=torch.zeros(1, L, dtype=torch.bool),
                audio=torch.randn(1, L, p.audio_dim), ref_lo=torch.randn(1, C, n, n),
                ref_hi=torch.randn(1, C, 2 * n, 2 * n), text=torch.randn(1, 2, p.text_dim))
    for predict, target in (("x", args["ref_lo"][:, None].expand(1, L, C, n, n)), ("v", args["x"])):
        dit = COMPONENTS["dit"][1](replace(p, predict=predict))
        dit.init_weights(torch.Generator().manual_seed(0))
        with torch.no_grad():
            x1 = args["x"] + 0.7 * dit(**args)  # (1, L, C, n, n)
        torch.testing.assert_close(x1, target, rtol=1e-5, atol=1e-5)


def test_config_written_before_predict_existed_loads_as_a_velocity_model(tmp_path):
    d = json.loads(SIZES["mini"].to_json())
    assert d["dit"]["predict"] == "x"
    del d["dit"]["predict"]
    assert FamilyConfig.from_dict(d).dit.predict == "v"
    d["dit"]["predict"] = "eps"
    with pytest.raises(ValueError, match="dit.predict"):
        FamilyConfig.from_dict(d).check()


def test_config_written_before_near_given_existed_loads_without_it():
    d = json.loads(SIZES["mini"].to_json())
    assert d["dit"]["near_given"] is True
    del d["dit"]["near_given"], d["dit"]["max_gap"]
    old = FamilyConfig.from_dict(d)
    assert old.dit.near_given is False
    assert not any(k.startswith(("left_in", "gap_left")) for k in COMPONENTS["dit"][1](old.dit).state_dict())


def test_nearest_given_finds_the_given_frame_on_each_side_and_its_distance():
    from avatar_cli.families.mini.dit import nearest_given

    L = 9
    x = torch.arange(L, dtype=torch.float32).view(1, L, 1, 1, 1).expand(2, L, 1, 2, 2) + 1  # frame j holds j + 1
    mask = torch.zeros(2, L, dtype=torch.bool)
    mask[0, :2] = True  # an N chunk: motion frames 0, 1
    mask[1, [0, 7]] = True  # an I chunk: anchors 0 and 7 (frame 8 lies past the second anchor)
    left, right, gl, gr = nearest_given(x, mask, max_gap=4)
    assert left[0, :, 0, 0, 0].tolist() == [1, 2, 2, 2, 2, 2, 2, 2, 2]
    assert gl[0].tolist() == [0, 0, 1, 2, 3, 4, 4, 4, 4]  # clamped at max_gap
    assert right[0, 2:].abs().sum() == 0 and gr[0, 2:].tolist() == [4] * 7  # nothing given after frame 1
    assert left[1, :, 0, 0, 0].tolist() == [1, 1, 1, 1, 1, 1, 1, 8, 8]
    assert right[1, :, 0, 0, 0].tolist() == [1, 8, 8, 8, 8, 8, 8, 8, 0]
    assert gr[1].tolist() == [0, 4, 4, 4, 3, 2, 1, 0, 4] and gl[1].tolist() == [0, 1, 2, 3, 4, 4, 4, 0, 1]


def test_dit_frames_next_to_a_given_frame_see_it_at_the_same_place():
    """near_given: with attention cut off, changing the last motion frame still changes the frames after it;
    without near_given nothing reaches them."""
    from dataclasses import replace

    p = SIZES["tiny"].dit
    L, C, n = 5, p.latent_channels, p.latent_size
    mask = torch.zeros(1, L, dtype=torch.bool)
    mask[0, :2] = True
    args = dict(x=torch.randn(1, L, C, n, n), t=torch.where(mask, 1.0, 0.5), mask=mask,
                audio=torch.randn(1, L, p.audio_dim), ref_lo=torch.randn(1, C, n, n),
                ref_hi=torch.randn(1, C, 2 * n, 2 * n), text=torch.randn(1, 2, p.text_dim))
    x2 = args["x"].clone()
    x2[0, 1] += 1.0  # the last motion frame
    changed = {}
    for near in (True, False):
        dit = COMPONENTS["dit"][1](replace(p, near_given=near))
        dit.init_weights(torch.Generator().manual_seed(0))
        with torch.no_grad():
            for m in dit.modules():  # give the zero-initialised gates and output some weight
                if isinstance(m, torch.nn.Linear) and not m.weight.any():
                    m.weight.normal_(0, 0.1)
            for block in dit.blocks:
                block.attn.attn_op = lambda q, k, v: v  # no mixing between tokens: only per-token paths remain
            changed[near] = (dit(**dict(args, x=x2)) - dit(**args))[0, 2:].abs().mean(dim=(1, 2, 3))  # (3,)
    assert (changed[True] > 1e-3).all()
    assert (changed[False] == 0).all()


def test_dit_at_init_continues_the_given_frames_and_forgets_them_past_max_gap():
    """predict="x" + near_given, zero output: frame j's clean estimate is the reference moved toward the nearest
    given frames by 0.9^d (1 - d / max_gap) at distance d (shared to 1 between two anchors), and exactly the
    reference from max_gap on."""
    p = SIZES["tiny"].dit
    L, C, n = 12, p.latent_channels, p.latent_size
    dit = COMPONENTS["dit"][1](p)
    dit.init_weights(torch.Generator().manual_seed(0))
    ref = torch.randn(1, C, n, n)
    x = torch.randn(2, L, C, n, n)
    mask = torch.zeros(2, L, dtype=torch.bool)
    mask[0, :2] = True  # N chunk
    mask[1, [0, 7]] = True  # I chunk
    t = torch.where(mask, 1.0, 0.5)
    with torch.no_grad():
        v = dit(x, t, mask, torch.randn(2, L, p.audio_dim), ref.expand(2, -1, -1, -1),
                torch.randn(2, C, 2 * n, 2 * n), torch.randn(2, 0, p.text_dim))
    x1 = x + 0.5 * v  # (2, L, C, n, n) the clean estimate of the free frames
    r = ref[0]
    def w(d: int) -> float:
        return 0.9 ** d * (1 - d / p.max_gap)

    torch.testing.assert_close(x1[0, 2], r + w(1) * (x[0, 1] - r), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x1[0, 4], r + w(3) * (x[0, 1] - r), rtol=1e-4, atol=1e-4)
    assert p.max_gap + 1 < L
    torch.testing.assert_close(x1[0, p.max_gap + 1:], r.expand(L - p.max_gap - 1, -1, -1, -1), rtol=1e-5, atol=1e-5)
    wl, wr = w(1), w(6)  # frame 1 of the I chunk: 1 from anchor 0, 6 from anchor 1
    torch.testing.assert_close(x1[1, 1], r + wl * (x[1, 0] - r) + wr * (x[1, 7] - r), rtol=1e-4, atol=1e-4)
    # Between anchors 2 apart the weights (2 w(1) > 1) are shared to 1: the midpoint of the anchors.
    mask2 = torch.zeros(1, 3, dtype=torch.bool)
    mask2[0, [0, 2]] = True
    x_2 = x[1:, :3]
    with torch.no_grad():
        v2 = dit(x_2, torch.where(mask2, 1.0, 0.5), mask2, torch.randn(1, 3, p.audio_dim), ref,
                 torch.randn(1, C, 2 * n, 2 * n), torch.randn(1, 0, p.text_dim))
    expect = (x_2[0, 0] + x_2[0, 2]) / 2
    torch.testing.assert_close((x_2 + 0.5 * v2)[0, 1], expect, rtol=1e-4, atol=1e-4)


def test_prompt_words_outside_the_vocabulary_are_ignored():
    from avatar_cli.families.mini.text import TextParams, tokenize

    p = TextParams()
    assert tokenize("Smiling, LIVELY!", p) == tokenize("smiling lively", p) != []
    assert tokenize("a smiling zebra, quite lively", p) == tokenize("smiling lively", p)
    assert tokenize("zebra unicorn", p) == []
