"""Wan2.2-S2V samplers against the official code's outputs (tests/golden/make_wan_sampler_goldens.py)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from avatar_cli.families.wan_s2v.sampler import euler_schedule, sample_unipc, unipc_schedule

GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"

# wan/utils/fm_solvers_unipc.py set_timesteps(40, shift=3), as speech2video.py calls it.
OFFICIAL_40 = [999, 991, 982, 973, 963, 954, 944, 933, 922, 911, 899, 887, 874, 861, 847, 832, 817, 801, 785, 767,
               749, 730, 710, 688, 666, 642, 617, 590, 562, 531, 499, 465, 428, 388, 345, 299, 249, 195, 136, 71]


@pytest.fixture(scope="module")
def golden():
    return load_file(GOLDEN / "sampler_unipc.safetensors")


def toy_flow(w, b, calls):
    """The golden script's toy flow (linear channel mix + tanh + t-scaled bias), recording the t it is given."""
    def flow(x, t):
        calls.append(t.clone())
        xf = x.float()
        return (torch.einsum("oc,bc...->bo...", w, xf) + 0.5 * torch.tanh(xf)
                + (t.float() / 1000.0).view(-1, 1, 1, 1, 1) * b.view(1, -1, 1, 1, 1))
    return flow


def test_unipc_timesteps_equal_official(golden):
    ts, sigmas = unipc_schedule(40, 3.0)
    assert ts.dtype == torch.int64 and ts.tolist() == OFFICIAL_40
    assert torch.equal(ts, golden["timesteps_40"])
    assert torch.equal(sigmas, golden["sigmas_40"])  # float32, 41 values ending in 0
    ts3, sigmas3 = unipc_schedule(3, 3.0)
    assert torch.equal(ts3, golden["timesteps_3"]) and torch.equal(sigmas3, golden["sigmas_3"])


@pytest.mark.parametrize("steps", [3, 40])
def test_unipc_sample_matches_official_fp32(golden, steps):
    calls = []
    out = sample_unipc(toy_flow(golden["toy_w"], golden["toy_b"], calls), golden["noise"], steps=steps, shift=3.0)
    ref = golden[f"sample_{steps}_fp32"]
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel < 1e-5, rel
    # The model was called once per step with the official (1,)-shaped int64 timestep.
    assert torch.equal(torch.cat(calls), golden[f"calls_t_{steps}"]) and calls[0].shape == (1,)
    assert calls[0].dtype == torch.int64
    # The sample really moved: the toy flow drives it far from the noise.
    assert (out - golden["noise"]).abs().max() > 0.5


def test_unipc_sample_keeps_bf16_latent_like_official(golden):
    """The official loop keeps the latent in the noise's dtype (bf16): each step rounds, and we match that."""
    out = sample_unipc(toy_flow(golden["toy_w"], golden["toy_b"], []), golden["noise"].bfloat16(), steps=40)
    ref = golden["sample_40_bf16"]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    # and the bf16 run differs from the fp32 one (the dtype detail is observable, so the check above has teeth)
    assert not torch.equal(out.float(), golden["sample_40_fp32"])


def test_euler_schedule_liveavatar():
    ts, sigmas = euler_schedule(4, 3.0)
    assert ts == pytest.approx([1000.0, 857.6923, 602.1506, 8.9286], abs=1e-4)
    assert sigmas == pytest.approx([1.0, 0.857692, 0.602151, 0.008929, 0.0], abs=1e-6)
    ref = load_file(GOLDEN / "sampler_euler.safetensors")  # diffusers FlowMatchEulerDiscreteScheduler, float32
    assert ts == ref["timesteps"].tolist() and sigmas == ref["sigmas"].tolist()
