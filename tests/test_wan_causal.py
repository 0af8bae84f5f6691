"""LiveAvatar's block-causal streaming (avatar_cli/families/wan_s2v/causal.py) against THEIR CausalWanModel_S2V at the
tiny size: 2 clips x 4 blocks x 4 Euler steps with the sink refreshed after clip 0 (goldens from
tests/golden/make_liveavatar_goldens.py, same weights as the S2V DiT goldens); bounded caches; the sink offset."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from avatar_cli.families.wan_s2v import causal
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.sampler import euler_schedule

GOLDEN = Path(__file__).parent / "golden"
CLIPS, BLOCKS, STEPS = 2, 4, 4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def model() -> WanS2VDiT:
    config = json.loads((GOLDEN / "wan_s2v" / "dit_tiny_config.json").read_text())
    m = WanS2VDiT(WanDiTParams.from_config(config)).eval()
    m.load_state_dict(load_file(GOLDEN / "wan_s2v" / "dit_tiny_weights.safetensors"), strict=True)
    return m


@pytest.fixture(scope="module")
def golden() -> dict:
    return load_file(GOLDEN / "liveavatar" / "stream_tiny.safetensors")


@pytest.fixture(scope="module")
def streamed(model, golden):
    """Our streaming over the recorded run, free-running (each step's input is our previous step's output, the
    refreshed sink our own first latent): per-block step inputs, flows and latents, and the caches at the end."""
    H, W = golden["input.ref"].shape[-2:]
    caches = causal.CausalCaches.empty(model.params, H, W)
    ctx, motion = golden["input.context"], golden["input.motion"]
    out, ref = {}, golden["input.ref"]
    for r in range(CLIPS):
        if r == 1:
            ref = out["clip0.block0.latents"][:, 0:1]  # the rolled sink frame
        out[f"clip{r}.sink_ref"] = ref
        causal.prefill_sink(model, caches, ref, motion, ctx)
        for b in range(BLOCKS):
            key = f"clip{r}.block{b}"
            inputs = causal.block_inputs(model, ctx, golden[f"{key}.audio"])
            x = golden[f"clip{r}.noise"][:, 3 * b:3 * b + 3]  # (16, 3, h, w)
            sig = golden["sigmas"]
            xs, flows = [], []
            for i in range(STEPS):
                v = causal.causal_forward(model, caches, i, x, golden[f"{key}.t"][i], r * BLOCKS + b, inputs,
                                          int(golden[f"{key}.sink_offset"][i]))  # (16, 3, h, w)
                xs.append(x)
                flows.append(v)
                x = (x.float() + (sig[i + 1] - sig[i]) * v).to(v.dtype)
            out[f"{key}.step_in"], out[f"{key}.flow"] = torch.stack(xs), torch.stack(flows)
            out[f"{key}.latents"] = x
    return out, caches


def test_schedule_and_settings_match_the_recording(golden):
    timesteps, sigmas = euler_schedule(STEPS)
    assert golden["timesteps"].tolist() == timesteps  # their diffusers scheduler, float32 values
    assert golden["sigmas"].tolist() == sigmas
    settings = json.loads((GOLDEN / "liveavatar" / "stream_tiny.json").read_text())
    offsets = torch.stack([golden[f"clip{r}.block{b}.sink_offset"] for r in range(CLIPS) for b in range(BLOCKS)])
    assert offsets.flatten().tolist() == settings["sink_offsets"]
    # the recording exercises the offset: some late steps move the reference (f > 30 - offset), others do not
    shifts = [causal.sink_ref_shift(3 * (r * BLOCKS + b), int(o)) for r in range(CLIPS) for b in range(BLOCKS)
              for o in golden[f"clip{r}.block{b}.sink_offset"]]
    assert 0 < sum(s > 0 for s in shifts) < len(shifts)


@pytest.mark.parametrize("clip", range(CLIPS))
@pytest.mark.parametrize("block", range(BLOCKS))
def test_stream_matches_liveavatar(streamed, golden, clip, block):
    ours, _ = streamed
    key = f"clip{clip}.block{block}"
    for i in range(STEPS):
        assert rel(ours[f"{key}.step_in"][i], golden[f"{key}.step_in"][i]) < 1e-5, (key, i)
        assert rel(ours[f"{key}.flow"][i], golden[f"{key}.flow"][i]) < 1e-5, (key, i)
    assert rel(ours[f"{key}.latents"], golden[f"{key}.latents"]) < 1e-5
    assert rel(ours[f"clip{clip}.sink_ref"], golden[f"clip{clip}.sink_ref"]) < 1e-5


def test_caches_hold_what_theirs_hold(streamed, golden):
    """Shapes of one layer's cache as theirs, and the contents at the end: step 0's ring of layer 0 (roped keys,
    their float16 RoPE tables: float64 tables would differ by ~1e-3 here) and the refreshed sink's un-roped keys."""
    _, caches = streamed
    assert list(caches.k.shape[2:]) == golden["cache_shape.k"].tolist()[1:]  # (ring, heads, head_dim)
    assert caches.sink_k.shape[1] == int(golden["cache_shape.cond_end"])  # their cond_end: 80 = 32 + 32 + 8 + 8
    assert rel(caches.k[0, 0], golden["final.step0.layer0.k"]) < 1e-5
    assert rel(caches.sink_k[0], golden["final.step0.layer0.cond_k"]) < 1e-5


def test_stream_block_equals_the_steps(model, golden, streamed):
    """stream_block (the 4 Euler steps in one call) gives the same latents as the step-by-step run, bit for bit."""
    ours, _ = streamed
    H, W = golden["input.ref"].shape[-2:]
    caches = causal.CausalCaches.empty(model.params, H, W)
    causal.prefill_sink(model, caches, golden["input.ref"], golden["input.motion"], golden["input.context"])
    for b in range(2):
        key = f"clip0.block{b}"
        lat = causal.stream_block(model, caches, golden["clip0.noise"][:, 3 * b:3 * b + 3], b,
                                  golden["input.context"], golden[f"{key}.audio"],
                                  golden[f"{key}.sink_offset"].tolist())
        assert torch.equal(lat, ours[f"{key}.latents"])


def test_caches_stay_bounded_over_blocks(model):
    """12 blocks = 3 rings' worth on random inputs: every tensor keeps its shape and its storage (the rings are
    written in place), every ring slot ends up written; a cache rebuilt from tensors() continues identically."""
    p, H, W = model.params, 8, 16
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(5, p.text_dim, generator=gen)
    caches = causal.CausalCaches.empty(p, H, W)
    causal.prefill_sink(model, caches, torch.randn(16, 1, H, W, generator=gen),
                        torch.randn(16, 19, H, W, generator=gen), ctx)
    layout = {n: (tuple(t.shape), t.data_ptr()) for n, t in caches.tensors().items()}
    nbytes = caches.nbytes()
    assert caches.ring_tokens == causal.RING_FRAMES * causal.frame_tokens(p, H, W)
    assert caches.sink_k.shape == (p.num_layers, causal.sink_tokens(p, H, W), p.num_heads, p.head_dim)

    def block(c, b, seed):
        g = torch.Generator().manual_seed(seed)
        noise, audio = torch.randn(16, 3, H, W, generator=g), torch.randn(1, 25, p.audio_dim, 12, generator=g)
        return causal.stream_block(model, c, noise, b, ctx, audio, 30)

    for b in range(12):
        assert torch.isfinite(block(caches, b, b)).all()
        assert {n: (tuple(t.shape), t.data_ptr()) for n, t in caches.tensors().items()} == layout, b
    assert caches.nbytes() == nbytes
    assert bool((caches.k.abs().amax(dim=(3, 4)) > 0).all())  # (steps, layers, ring): every slot written
    again = causal.CausalCaches.from_tensors({n: t.clone() for n, t in caches.tensors().items()})
    assert torch.equal(block(caches, 12, 99), block(again, 12, 99))


def test_sink_offset_is_explicit_and_matters(model, golden, streamed):
    """Equal offsets reproduce bit for bit (outputs and cache writes); a different offset changes a late block (f =
    24: offset 30 moves the reference to t 54, offset 4 leaves it at 30), and never the first block (f = 0)."""
    _, caches = streamed
    ctx, key = golden["input.context"], "clip1.block3"
    inputs = causal.block_inputs(model, ctx, golden[f"{key}.audio"])
    x, t = golden[f"{key}.step_in"][0], golden[f"{key}.t"][0]

    def run(block_index: int, offset: int):
        c = causal.CausalCaches.from_tensors({n: v.clone() for n, v in caches.tensors().items()})
        return causal.causal_forward(model, c, 0, x, t, block_index, inputs, offset), c

    a, ca = run(8, 30)
    b, cb = run(8, 30)
    assert torch.equal(a, b) and all(torch.equal(u, v) for u, v in zip(ca.tensors().values(), cb.tensors().values()))
    c, _ = run(8, 4)
    assert rel(c, a) > 1e-4
    assert causal.sink_ref_shift(24, 30) == 24 and causal.sink_ref_shift(24, 4) == 0
    first_a, _ = run(0, 30)
    first_b, _ = run(0, 4)
    assert torch.equal(first_a, first_b)


def test_full_size_cache_bytes():
    """LiveAvatar's rings at 704x384 (latent 48x88), bf16, on the meta device: 10.38 GB per step's ring, 2640 sink tokens."""
    p = WanDiTParams.full()
    c = causal.CausalCaches.empty(p, 48, 88, dtype=torch.bfloat16, device="meta")
    assert c.ring_tokens == 12_672
    assert 2 * c.k[0].numel() * 2 == 10_380_902_400
    assert causal.sink_tokens(p, 48, 88) == 2640


def test_bad_input_is_refused(model):
    p = model.params
    c = causal.CausalCaches.empty(p, 8, 16)
    inputs = causal.block_inputs(model, torch.zeros(3, p.text_dim), torch.zeros(1, 25, p.audio_dim, 12))
    x, t = torch.zeros(16, 3, 8, 16), torch.full((3,), 1000.0)
    with pytest.raises(ValueError, match="sink is empty"):
        causal.causal_forward(model, c, 0, x, t, 0, inputs, 30)
    causal.prefill_sink(model, c, torch.zeros(16, 1, 8, 16), torch.zeros(16, 19, 8, 16), torch.zeros(3, p.text_dim))
    with pytest.raises(ValueError, match="outside LiveAvatar's range"):
        causal.causal_forward(model, c, 0, x, t, 0, inputs, 31)
    with pytest.raises(ValueError, match="step 4 outside"):
        causal.causal_forward(model, c, 4, x, t, 0, inputs, 30)
    with pytest.raises(ValueError, match="sink holds 80 tokens"):
        causal.causal_forward(model, c, 0, torch.zeros(16, 3, 16, 16), t, 0, inputs, 30)
    with pytest.raises(ValueError, match="2 sink offsets for 4 steps"):
        causal.stream_block(model, c, x, 0, torch.zeros(3, p.text_dim), torch.zeros(1, 25, p.audio_dim, 12), [4, 5])
    with pytest.raises(ValueError, match="expected"):
        causal.CausalCaches.from_tensors({"k": c.k, "v": c.v})
    with pytest.raises(ValueError, match="whole number"):
        causal.CausalCaches.empty(p, 8, 16, ring_frames=10)
