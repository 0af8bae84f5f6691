"""The Wan2.2-S2V DiT against the official WanModel_S2V at the tiny size (goldens from
tests/golden/make_wan_dit_goldens.py), and its key layout at full size on the meta device."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT, s2v_positions

GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"
CASES = {  # case -> (inputs taken from, config variant)
    "a": ("a", {}),  # clip 0, motion dropped, t=999
    "b": ("b", {}),  # later clip with motion, t=501
    "c": ("c", {}),  # CFG unconditional of b: negative context, audio * 0
    "d": ("b", dict(add_last_motion=False)),  # "padd": the newest 3 motion latents blanked
    "e": ("b", dict(add_last_motion=False, framepack_drop_mode="drop")),  # post and 2x motion tokens removed
}


def release_like_config(p: WanDiTParams) -> dict:
    """config.json as diffusers' ConfigMixin writes it for the official class: no ignore_for_config fields."""
    return {
        "_class_name": "WanModel_S2V", "_diffusers_version": "0.35.1", "adain_mode": p.adain_mode,
        "add_last_motion": p.add_last_motion, "audio_dim": p.audio_dim,
        "audio_inject_layers": list(p.audio_inject_layers),
        "cond_dim": p.cond_dim, "dim": p.dim, "enable_adain": p.enable_adain, "enable_framepack": p.enable_framepack,
        "enable_motioner": False, "enable_tsm": False, "eps": p.eps, "ffn_dim": p.ffn_dim,
        "framepack_drop_mode": p.framepack_drop_mode, "freq_dim": p.freq_dim, "in_dim": p.in_dim, "model_type": "s2v",
        "motion_token_num": 1024, "num_audio_token": p.num_audio_token, "num_heads": p.num_heads,
        "num_layers": p.num_layers, "out_dim": p.out_dim, "text_len": p.text_len, "trainable_token_pos_emb": False,
        "zero_init": True, "zero_timestep": p.zero_timestep,
    }


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((GOLDEN / "dit_tiny_config.json").read_text())


@pytest.fixture(scope="module")
def weights() -> dict:
    return load_file(GOLDEN / "dit_tiny_weights.safetensors")


@pytest.fixture(scope="module")
def cases() -> dict:
    return load_file(GOLDEN / "dit_cases.safetensors")


@pytest.fixture(scope="module")
def model(config, weights) -> WanS2VDiT:
    torch.manual_seed(0)
    m = WanS2VDiT(WanDiTParams.from_config(config)).eval()
    m.load_state_dict(weights, strict=True)
    return m


def run(m: WanS2VDiT, cases: dict, key: str, t=None) -> torch.Tensor:
    src = CASES[key][0]
    drop = bool(cases[f"{key}.drop_motion"])
    with torch.no_grad():
        return m(cases[f"{src}.x"], cases[f"{key}.t"] if t is None else t, cases[f"{src}.context"], cases[f"{src}.ref"],
                 None if drop else cases[f"{src}.motion"], cases[f"{src}.cond"], cases[f"{src}.audio"])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


def test_golden_config_is_the_tiny_size(config):
    assert WanDiTParams.from_config(config) == WanDiTParams.tiny()


@pytest.mark.parametrize("key", list(CASES))
def test_matches_official(model, weights, cases, key):
    variant = CASES[key][1]
    m = model
    if variant:  # the variants change no weight shape: same weights, other config
        m = WanS2VDiT(dataclasses.replace(model.params, **variant)).eval()
        m.load_state_dict(weights, strict=True)
    out = run(m, cases, key)
    ref = cases[f"{key}.out"]
    assert out.dtype == torch.float32 and out.shape == ref.shape == (16, 4, 16, 24)
    assert rel_err(out, ref) <= 1e-5


def test_meta_build_then_assign_load(weights, cases):
    # how the runtime loads the 14B: build on meta, then load_state_dict(assign=True); nothing may stay on meta
    with torch.device("meta"):
        m = WanS2VDiT(WanDiTParams.tiny()).eval()
    m.load_state_dict(weights, strict=True, assign=True)
    assert rel_err(run(m, cases, "b"), cases["b.out"]) <= 1e-5


def test_motion_and_audio_matter(model, cases):
    # guards against goldens that would pass with a dead path: b and c differ only in text and audio
    assert rel_err(cases["b.out"], cases["c.out"]) > 1e-2
    assert rel_err(run(model, cases, "b"), cases["a.out"]) > 1e-2


def test_timestep_forms_agree(model, cases):
    # the official UniPC passes int64 tensors; an int, a float or a float tensor of the same value is the same input
    ref = cases["b.out"]
    for t in (501, 501.0, torch.tensor(501.0), torch.tensor([501])):
        assert rel_err(run(model, cases, "b", t=t), ref) <= 1e-6


def test_attention_op_is_used(model, cases):
    calls = []

    def counting(q, k, v):
        calls.append(q.shape)
        return F.scaled_dot_product_attention(q, k, v)

    p = model.params
    m = WanS2VDiT(p).eval()
    m.load_state_dict(model.state_dict(), strict=True)
    m.set_attn_op(counting)
    out = run(m, cases, "b")
    n_tokens = 4 * 8 * 12 + 96 + 96 + 4 * 6 + 4 * 2 * 3  # noisy + ref + motion (post, 2x, 4x) at 16x24 latents
    assert calls == [torch.Size([1, p.num_heads, n_tokens, p.head_dim])] * p.num_layers
    assert rel_err(out, cases["b.out"]) <= 1e-5


def test_bf16_weights_run(model, cases):
    # precision islands written out (no autocast): bf16 weights give an fp32 output near the official fp32 one
    m = WanS2VDiT(model.params).eval().to(torch.bfloat16)
    m.load_state_dict(model.state_dict(), strict=True)
    c = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in cases.items()}
    out = run(m, c, "b")
    assert out.dtype == torch.float32
    assert rel_err(out, cases["b.out"]) < 3e-2


def test_full_size_on_meta_matches_release_keys():
    expected = {}
    for line in (GOLDEN / "dit_keys.txt").read_text().splitlines():
        name, shape = line.split("\t")
        expected[name] = [int(s) for s in shape.strip("[]").split(",")]
    with torch.device("meta"):
        m = WanS2VDiT(WanDiTParams.full())
    got = {k: list(v.shape) for k, v in m.state_dict().items()}
    assert sorted(set(got) ^ set(expected)) == []
    assert {k for k in got if got[k] != expected[k]} == set()
    assert len(got) == 1260 and list(m.buffers()) == []
    assert sum(p.numel() for p in m.parameters()) == 16_295_755_609


def test_release_like_config_gives_full():
    # the official loader never reads patch_size, text_dim, window_size, qk_norm, cross_attn_norm from config.json
    assert WanDiTParams.from_config(release_like_config(WanDiTParams.full())) == WanDiTParams.full()


@pytest.mark.parametrize("field", ["dim", "num_layers", "audio_dim", "audio_inject_layers", "enable_motioner"])
def test_from_config_refuses_missing_field(config, field):
    d = {k: v for k, v in config.items() if k != field}
    with pytest.raises(ValueError, match=field):
        WanDiTParams.from_config(d)


def test_from_config_refuses_unknown_key_and_bad_values(config):
    with pytest.raises(ValueError, match="rope_theta"):
        WanDiTParams.from_config({**config, "rope_theta": 10000})
    with pytest.raises(ValueError, match="enable_motioner"):
        WanDiTParams.from_config({**config, "enable_motioner": True})
    with pytest.raises(ValueError, match="num_heads"):
        WanDiTParams.from_config({**config, "num_heads": "2"})
    with pytest.raises(ValueError, match="patch_size"):
        WanDiTParams.from_config({**config, "patch_size": [2, 2]})
    with pytest.raises(ValueError, match="zero_timestep"):
        WanDiTParams.from_config({**config, "zero_timestep": False})
    with pytest.raises(ValueError, match="audio_inject_layers"):  # 1 would also match block 10 in the official code
        WanDiTParams.from_config({**config, "num_layers": 12, "audio_inject_layers": [1, 4]})
    # metadata is ignored
    assert WanDiTParams.from_config({**config, "_name_or_path": "x"}) == WanDiTParams.tiny()


def test_audio_length_must_match_frames(model, cases):
    with pytest.raises(ValueError, match="latent frames"):
        with torch.no_grad():
            model(cases["b.x"], 501, cases["b.context"], cases["b.ref"], cases["b.motion"], cases["b.cond"],
                  cases["b.audio"][..., :12])


def test_positions_at_480p():
    # The official 480p clip: 448x832 -> latent 56x104, 20 frames: 29,120 noisy + 1,456 ref + 2,184 motion tokens
    p = WanDiTParams.full()
    pos = s2v_positions(p, 20, 56, 104, with_motion=True)
    assert pos.shape == (32_760, 3) and s2v_positions(p, 20, 56, 104, with_motion=False).shape[0] == 30_576
    noisy, ref, post, x2, x4 = pos.split([29_120, 1_456, 1_456, 364, 364])
    assert noisy[:, 0].unique().tolist() == list(range(20)) and noisy[:, 1].max() == 27 and noisy[:, 2].max() == 51
    assert ref[:, 0].unique().tolist() == [30] and post[:, 0].unique().tolist() == [-1]
    assert x2[:, 0].unique().tolist() == [-3] and x4[:, 0].unique().tolist() == [-19, -14, -9, -4]
    assert x2[:, 1].unique().tolist() == [int(i * 27 / 13) for i in range(14)]  # linspace(0, 27, 14), truncated
    assert x4[:, 2].unique().tolist() == [int(i * 51 / 12) for i in range(12)] + [51]
