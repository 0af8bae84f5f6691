"""The CPU inference fast paths compute what the plain formulas do (fused SiLU, sub-pixel upsampling conv)."""

import pytest
import torch
import torch.nn.functional as F

from avatar_cli.families.mini import layers
from avatar_cli.families.mini.layers import ResBlock2d, conv_silu, upsample_conv
from avatar_cli.families.mini.vae import VAE, VAEParams


@pytest.mark.parametrize("channels_last", [False, True])
def test_upsample_conv_equals_nearest_upsampling_then_conv(channels_last):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(6, 5, 3, padding=1)
    x = torch.randn(3, 6, 7, 9)  # odd, non-square sides: every border phase is exercised
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want = conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))  # (3, 5, 14, 18)
        got = upsample_conv(conv, x)
    assert got.shape == want.shape == (3, 5, 14, 18)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_conv_silu_and_resblock_equal_the_plain_ops():
    torch.manual_seed(0)
    block = ResBlock2d(8)
    x = torch.randn(2, 8, 10, 10)
    with torch.no_grad():
        assert torch.allclose(conv_silu(block.conv1, x), F.silu(block.conv1(x)), atol=1e-6)
        want = x + block.conv2(F.silu(block.conv1(F.silu(x))))
        assert torch.allclose(block(x), want, atol=1e-6)


def test_training_gets_the_gradients_of_the_plain_formula():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 3, 3, padding=1)
    x = torch.randn(2, 4, 5, 5)
    for fn, plain in ((upsample_conv, lambda c, x: c(F.interpolate(x, scale_factor=2.0, mode="nearest"))),
                      (conv_silu, lambda c, x: F.silu(c(x)))):
        conv.zero_grad()
        (fn(conv, x) ** 2).sum().backward()
        got = conv.weight.grad.clone()
        conv.zero_grad()
        (plain(conv, x) ** 2).sum().backward()
        assert torch.allclose(got, conv.weight.grad, atol=1e-5)


def test_vae_decode_fast_path_matches_plain_decode(monkeypatch):
    torch.manual_seed(0)
    vae = VAE(VAEParams(latent_channels=4, channels=(8, 16, 16), decoder_channels=(6, 12, 16))).eval()
    z = torch.randn(5, 4, 6, 6)
    with torch.no_grad():
        fast, cache = vae.decode(z, None)
        monkeypatch.setattr(layers, "_fast_path", lambda conv, x: False)
        plain, cache2 = vae.decode(z, None)
    assert fast.shape == (5, 3, 48, 48)
    assert (fast - plain).abs().max() < 1e-5 and torch.equal(cache, cache2)


@pytest.fixture
def two_thread_counts():
    """Run a body on 1 torch thread, then on 2; restore the session's count."""
    before = torch.get_num_threads()

    def run(fn):
        out = []
        for n in (1, 2):
            torch.set_num_threads(n)
            out.append(fn())
        return out
    yield run
    torch.set_num_threads(before)


def test_per_row_pads_only_thread_variant_float32_row_counts_and_computes_the_linear():
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 24)
    seen = []
    with torch.no_grad():
        for m in range(1, 14):
            x = torch.randn(1, m, 1, 16)  # (B, L, 1, K) as the DiT's per-frame modulation input
            out = layers.per_row(lambda r: seen.append(r.numel() // r.shape[-1]) or linear(r), x)
            assert out.shape == (1, m, 1, 24) and torch.allclose(out, linear(x), atol=1e-6)
        assert seen == [1, 2, 3, 4, 8, 8, 8, 8, 12, 12, 12, 12, 13]
        seen.clear()
        layers.per_row(lambda r: seen.append(r.numel() // r.shape[-1]) or r, torch.randn(5, 16, dtype=torch.bfloat16))
    assert seen == [5]  # bf16 sums the same on any thread count: left as it is


def test_the_dit_and_the_audio_and_text_encoders_give_the_same_float32_bits_on_one_thread_as_on_two(two_thread_counts):
    """A decode thread borrows one of the loop's threads while it works (runtime.decode: thread), so the loop's
    DiT may run a chunk on either count; its frames must not change. A short last chunk has 5 to 11 frames with
    its motion frames: the row counts where a float32 GEMM's sum order follows the thread count."""
    from avatar_cli.families.mini.audio import AudioEncoder, AudioParams
    from avatar_cli.families.mini.dit import DiT, DiTParams
    from avatar_cli.families.mini.text import TextEncoder, TextParams
    torch.manual_seed(0)
    p = DiTParams(latent_channels=8, latent_size=8, patch=2, dim=64, depth=2, heads=2, audio_dim=32, text_dim=32,
                  near_given=True, max_gap=8)
    dit = DiT(p).eval()
    audio = AudioEncoder(AudioParams(dim=32)).eval()
    text = TextEncoder(TextParams(dim=32, heads=2, depth=1)).eval()
    with torch.no_grad():
        for w in [*dit.parameters(), *audio.parameters(), *text.parameters()]:
            w.normal_(0, 0.2)  # nonzero modulation (the init zeroes it)
        for frames in (*range(1, 14), 28):
            x = torch.randn(1, frames, 8, 8, 8)
            mask = torch.zeros(1, frames, dtype=torch.bool)
            mask[:, :min(4, frames - 1)] = True  # the motion frames
            inputs = (x, torch.rand(1, frames), mask, torch.randn(1, frames, 32), torch.randn(1, 8, 8, 8),
                      torch.randn(1, 8, 16, 16), torch.randn(1, 6, 32))
            one, two = two_thread_counts(lambda: dit(*inputs))
            assert torch.equal(one, two), f"{frames} frames: the DiT's bits follow the thread count"
            mel = torch.randn(frames, 40, 12)  # (T, n_mels, mel_frames)
            one, two = two_thread_counts(lambda: audio(mel))
            assert torch.equal(one, two), f"{frames} frames: the audio encoder's bits follow the thread count"
        for tokens in range(1, 17):  # a prompt of 1 to max_tokens known words
            ids = torch.randint(1, len(text.params.vocab) + 1, (1, tokens))
            one, two = two_thread_counts(lambda: text(ids))
            assert torch.equal(one, two), f"{tokens} tokens: the text encoder's bits follow the thread count"
