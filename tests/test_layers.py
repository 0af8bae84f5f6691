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
