"""runtime.weights (runtime/quantize.py): which Linears are quantized, and the bytes at full size, counted on meta."""

import pytest
import torch
from torch import nn

from avatar_cli.families.wan_s2v.components import UMT5Text
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.family import QUANTIZED
from avatar_cli.families.wan_s2v.text import UMT5_XXL
from avatar_cli.modules.module import build_meta
from avatar_cli.runtime.quantize import (component_bytes, fp8_weight, linears_under, quantize_linears,
                                         quantized_bytes, tensor_bytes)

DIT_PATHS = dict(QUANTIZED)["dit"]
T5_PATHS = dict(QUANTIZED)["text"]  # umT5's 24 layers


@pytest.fixture(scope="module")
def full_dit():
    return build_meta(WanS2VDiT, WanDiTParams.full())


def _expected(model: nn.Module, paths, weights: str) -> int:
    """The count worked out by hand from the module tree: a quantized weight is 1 byte per parameter plus, per
    output channel, a float32 scale (and for int8 an int8 zero point); everything else 2 bytes (bf16)."""
    layers = linears_under(model, paths)
    q = sum(l.weight.numel() for l in layers.values())
    rows = sum(l.out_features for l in layers.values())
    total = sum(p.numel() for p in model.parameters())
    per_row = {"int8": 4 + 1, "fp8": 4}[weights]
    return q + per_row * rows + 2 * (total - q)


def test_dit_bytes_at_full_size(full_dit):
    layers = linears_under(full_dit, DIT_PATHS)
    # 40 blocks x (4 self + 4 cross + 2 FFN) and 12 injectors x 4: every projection of the transformer.
    assert len(layers) == 40 * 10 + 12 * 4
    assert all(n.startswith(("blocks.", "audio_injector.injector.")) for n in layers)
    q = sum(l.weight.numel() for l in layers.values())
    assert q == 15_309_209_600  # of the release's 16,295,755,609
    bf16 = quantized_bytes(full_dit, "bf16", DIT_PATHS, torch.bfloat16)
    assert bf16 == 2 * 16_295_755_609
    for weights in ("int8", "fp8"):
        n = quantized_bytes(full_dit, weights, DIT_PATHS, torch.bfloat16)
        assert n == _expected(full_dit, DIT_PATHS, weights), weights
        # about half of bf16: 1 byte for 94 % of the parameters, scales add < 0.01 %
        assert 0.52 < n / bf16 < 0.54, (weights, n / bf16)
    assert quantized_bytes(full_dit, "int8", DIT_PATHS, torch.bfloat16) / 1e9 == pytest.approx(17.2955, abs=1e-4)


def test_text_encoder_bytes_at_full_size():
    """umT5-XXL under runtime.weights: its 24 layers' 7 Linears in 1 byte, the rest (the tied token embedding,
    the relative-position tables, the norms) in bf16; the count from the module tree and from the shape alone."""
    from avatar_cli.families.wan_s2v.budget import _t5_bytes

    t5 = build_meta(UMT5Text, UMT5_XXL)
    layers = linears_under(t5, T5_PATHS)
    assert len(layers) == 24 * 7  # q, k, v, o, wi_0, wi_1, wo per layer
    assert all(n.startswith("model.encoder.block.") for n in layers)
    assert not any(isinstance(m, nn.Linear) for n, m in t5.named_modules() if not n.startswith("model.encoder.block."))
    bf16 = component_bytes(t5, T5_PATHS, "bf16", torch.bfloat16)
    p = UMT5_XXL
    d, f, n = p.dim, p.ffn_dim, p.num_layers
    linear = n * (4 * d * d + 3 * d * f)  # parameters in the quantized Linears: 4.63 B of 5.68 B
    rows = n * (4 * d + 2 * f + d)  # their output channels, one scale each
    rest = p.vocab_size * d + n * (p.num_buckets * p.num_heads + 2 * d) + d  # embedding (tied), tables, norms
    assert linear == 4_630_511_616 and bf16 == 2 * (linear + rest) == 11_361_820_672
    for weights, per_row in (("int8", 4 + 1), ("fp8", 4)):  # a float32 scale (and int8's int8 zero point) per row
        q = component_bytes(t5, T5_PATHS, weights, torch.bfloat16)
        assert q == _expected(t5, T5_PATHS, weights) == linear + per_row * rows + 2 * rest, weights
        assert _t5_bytes(p, torch.bfloat16, weights, T5_PATHS).total == q  # what `avatar plan` counts
        assert 0.59 < q / bf16 < 0.60  # 6.74 GB of 11.36: the 1 B-parameter token embedding stays bf16
    assert component_bytes(t5, None, "fp8", torch.bfloat16) == bf16  # a component a family keeps whole


def test_meta_model_is_not_changed(full_dit):
    quantized_bytes(full_dit, "fp8", DIT_PATHS, torch.bfloat16)
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in full_dit.parameters())


def test_paths_must_fit_the_model():
    with pytest.raises(ValueError, match="no 'blocks'"):
        linears_under(nn.Linear(2, 2), ("blocks",))
    seq = nn.Sequential(nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3)), nn.Sequential(nn.Linear(3, 2)))
    assert list(linears_under(seq, ("*.0",))) == ["0.0", "1.0"]


@pytest.mark.parametrize("weights,bound", [("int8", 0.01), ("fp8", 0.07)])
def test_quantized_linear_dequantizes_per_forward(weights, bound):
    """Weight-only: the weight is stored in 1 byte and dequantized to the activations' dtype in the forward."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    x = torch.randn(5, 64)
    ref = m(x)
    assert quantize_linears(m, weights, ("",)) == 2
    inner = m[0].weight.qdata
    assert inner.element_size() == 1 and m[0].weight.dtype == torch.float32
    y = m(x)
    err = ((y - ref).norm() / ref.norm()).item()
    assert 0 < err < bound, err
    assert quantize_linears(m, weights, ("",)) == 0  # already in that format: kept
    other = "fp8" if weights == "int8" else "int8"
    with pytest.raises(ValueError, match=f"runtime.weights: {other}, but 2 Linear.s. hold weights already quantized "
                                         f"to {weights} .0, ...."):
        quantize_linears(m, other, ("",))


def test_fp8_weight_installs_stored_fp8():
    """A weight stored in FP8 with its scales (per tensor or per channel) kept as it is: weight = qdata * scale."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    w = layer.weight.detach().clone()
    x = torch.randn(3, 16)
    for scale in (w.abs().amax() / 448, w.abs().amax(dim=1) / 448):
        q = (w / (scale if scale.dim() == 0 else scale[:, None])).to(torch.float8_e4m3fn)
        layer.weight = nn.Parameter(fp8_weight(q, scale, torch.float32), requires_grad=False)
        deq = q.float() * (scale if scale.dim() == 0 else scale[:, None])
        torch.testing.assert_close(layer(x), x @ deq.T + layer.bias, rtol=0, atol=1e-6)
        assert layer.weight.qdata.data_ptr() == q.data_ptr()  # kept, not copied
    with pytest.raises(ValueError, match="3 scales"):
        fp8_weight(q, torch.ones(3), torch.float32)
    # runtime.weights: fp8 keeps an installed FP8 weight as it is (nothing re-quantized)
    seq = nn.Sequential(layer, nn.Linear(8, 4))
    assert quantize_linears(seq, "fp8", ("",)) == 1 and seq[0].weight.qdata.data_ptr() == q.data_ptr()


def test_host_peak_of_the_block_at_a_time_read_at_full_size(full_dit):
    """placement reads a quantized DiT a block at a time (quantize.load_quantized): the host holds at most the
    quantized blocks plus, read last, everything outside them in bf16 (docs/speed.md quotes it)."""
    q = tensor_bytes(full_dit, "int8", DIT_PATHS, torch.bfloat16)
    b = tensor_bytes(full_dit, "bf16", DIT_PATHS, torch.bfloat16)
    blocks = sum(v for k, v in q.items() if k.startswith("blocks."))
    rest = sum(v for k, v in b.items() if not k.startswith("blocks."))
    one_block = max(sum(v for k, v in b.items() if k.startswith(f"blocks.{i}.")) for i in range(40))
    assert blocks + one_block < blocks + rest  # the last read, not a block's, sets the peak
    assert (blocks + rest) / 1e9 == pytest.approx(18.55, abs=0.01)
    assert (blocks + rest) / sum(b.values()) < 0.57  # against 32.6 GB read whole
