"""The Wan2.1 VAE (avatar_cli/families/wan_s2v/vae.py) against the official code's outputs at the tiny size
(goldens made by tests/golden/make_wan_vae_goldens.py), its streaming decode, and the full-size key layout."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save

from avatar_cli.families.wan_s2v.vae import WanVAE, WanVAECache, WanVAEParams

GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def vae() -> WanVAE:
    model = WanVAE(WanVAEParams.tiny()).eval()
    # strict: every key of the official layout is ours and vice versa, with equal shapes
    model.load_state_dict(load_file(GOLDEN / "vae_tiny_weights.safetensors"), strict=True)
    return model


@pytest.fixture(scope="module")
def io_() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN / "vae_io.safetensors")


@pytest.fixture(scope="module")
def whole(vae, io_) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(io_["z"], clamp=False)


def test_full_size_keys_shapes_and_count_on_meta():
    expected = {}
    for line in (GOLDEN / "vae_keys.txt").read_text().splitlines():
        key, shape = line.split("\t")
        expected[key] = [int(s) for s in shape.strip("[]").split(",")]
    with torch.device("meta"):
        model = WanVAE(WanVAEParams.full())
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == expected
    assert sum(p.numel() for p in model.parameters()) == 126_892_531


def test_encode_matches_official(vae, io_):
    with torch.no_grad():
        mu = vae.encode(io_["video"])
    assert mu.shape == (2, 16, 3, 4, 5) and mu.dtype == torch.float32
    assert rel_err(mu, io_["mu"]) < 1e-5
    # Causal: a 1-frame encode (a reference image) is latent 0 of the video's encode.
    with torch.no_grad():
        mu0 = vae.encode(io_["video"][:, :, :1])
    assert rel_err(mu0, io_["mu"][:, :, :1]) < 1e-5


def test_decode_matches_official(vae, io_, whole):
    assert whole.shape == (2, 3, 13, 32, 40)  # latent 0 -> 1 frame, the 3 others -> 4 each
    assert rel_err(whole, io_["frames"]) < 1e-5
    # The default clamps like the official wrapper; the golden has values outside [-1, 1], so this is a check.
    assert (io_["frames"].abs() > 1).any()
    with torch.no_grad():
        clamped = vae.decode(io_["z"])
    assert rel_err(clamped, io_["frames"].clamp(-1, 1)) < 1e-5


def test_stream_decode_in_uneven_chunks_is_bit_exact(vae, io_, whole):
    z, cache, parts = io_["z"], None, []
    with torch.no_grad():
        for lo, hi in ((0, 1), (1, 3), (3, 4)):
            frames, cache = vae.decode_stream(z[:, :, lo:hi], cache, clamp=False)
            parts.append(frames)
    assert [p.shape[2] for p in parts] == [1, 8, 4]
    assert torch.equal(torch.cat(parts, dim=2), whole)
    assert cache.latents == 4


def test_cache_round_trip_through_tensors(vae, io_, whole):
    z = io_["z"]
    with torch.no_grad():
        _, cache = vae.decode_stream(z[:, :, :2], None, clamp=False)
        # As a resume checkpoint would: named tensors, through safetensors bytes, back to a cache.
        tensors = cache.tensors()
        assert len(tensors) == vae.decoder.n_slots + 1
        rebuilt = WanVAECache.from_tensors(load(save({k: v.contiguous() for k, v in tensors.items()})))
        assert rebuilt.latents == 2 and rebuilt.nbytes() == cache.nbytes()
        again, _ = vae.decode_stream(z[:, :, 2:], rebuilt, clamp=False)
        # decode_stream did not change the cache it was given: continuing from it twice gives the same frames.
        first, _ = vae.decode_stream(z[:, :, 2:], cache, clamp=False)
    assert torch.equal(again, whole[:, :, 5:])
    assert torch.equal(first, again)


def test_rejects_bad_inputs(vae, io_):
    with pytest.raises(ValueError, match="T=6"):
        vae.encode(io_["video"][:, :, :6])
    with pytest.raises(ValueError, match="divisible by 8"):
        vae.encode(io_["video"][:, :, :1, :, :36])
    _, cache = vae.decode_stream(io_["z"][:1, :, :1], None)
    with pytest.raises(ValueError, match="do not continue"):
        vae.decode_stream(io_["z"][:, :, 1:2], cache)  # batch 2 after a batch-1 timeline
    with pytest.raises(ValueError, match="slot"):
        WanVAECache.from_tensors({"latents": torch.tensor(1), "slot.001": torch.zeros(1)})


def test_cpu_kernels_agree_with_torchs_and_are_the_ones_used(vae, io_, whole, monkeypatch):
    """On a CPU the decoder calls oneDNN for its convolutions and sums squares for its norm (bench/wan_vae_cpu.py:
    torch's own choices were 3x slower here); with torch's choices it decodes the same to float rounding."""
    from avatar_cli.families.wan_s2v import vae as vae_module

    calls = []
    real = torch.mkldnn_convolution
    monkeypatch.setattr(torch, "mkldnn_convolution", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.no_grad():
        one = vae.decode(io_["z"][:1], clamp=False)  # batch 1: torch alone would take slow_conv3d here
    n_convs = sum(isinstance(m, vae_module.CausalConv3d) for m in vae.decoder.modules())
    assert len(calls) >= n_convs and all(s[0] == 1 for s in calls)
    assert torch.allclose(one, whole[:1], rtol=0, atol=1e-5 * whole.abs().max())
    monkeypatch.setattr(vae_module, "_onednn_conv", lambda x, w: False)
    monkeypatch.setattr(vae_module.RMSNorm, "forward",
                        lambda self, x: torch.nn.functional.normalize(x, dim=1) * self.scale * self.gamma)
    with torch.no_grad():
        theirs = vae.decode(io_["z"][:1], clamp=False)
    assert rel_err(one, theirs) < 1e-5


def test_flops_counted_on_the_cpu_path_equal_the_meta_count(vae, io_):
    """make bench divides FLOPs by time: the direct oneDNN call must count as the convolution torch would run."""
    from avatar_cli.runtime.flops import flop_counter

    z = io_["z"][:1]
    counts = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = WanVAE(WanVAEParams.tiny()).eval()
        counter = flop_counter()
        with torch.no_grad(), counter:
            model.decode(z.to(device), clamp=False)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_a_bfloat16_vae_against_the_official_float32_goldens(vae, io_):
    """runtime.vae_dtype: bfloat16. Measured on these goldens (tiny random weights): decode 7.3 % of the frames'
    largest value at worst, 0.0092 on average (of [-1, 1]); encode 0.7 %. Bounds: half as much again."""
    import copy

    half = copy.deepcopy(vae).to(torch.bfloat16)
    with torch.no_grad():
        frames = half.decode(io_["z"], clamp=False)
        mu = half.encode(io_["video"])
    assert frames.dtype == mu.dtype == torch.float32  # float32 out, whatever the weights
    assert 1e-3 < rel_err(frames, io_["frames"]) < 0.11  # (above 1e-3: it did compute in bf16)
    assert (frames - io_["frames"]).abs().mean() < 0.014
    assert rel_err(mu, io_["mu"]) < 0.011
