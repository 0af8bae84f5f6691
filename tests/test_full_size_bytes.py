"""What the wan-s2v family moves or holds at full size (Wan2.2-S2V-14B), counted on the meta device, against the
bounds docs/wan-s2v.md states; and the tiny-size checks that the leaner paths compute what the plain ones do."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from avatar_cli.families.wan_s2v import layers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_fp32_island_upcast_in_blocks_equals_the_whole_upcast(monkeypatch, dtype):
    """linear_f32 upcasts a low-precision weight a block of rows at a time: the same products within fp32 rounding
    (each output is the same dot product; the kernel's blocking over the inputs may differ)."""
    torch.manual_seed(0)
    lin = nn.Linear(512, 3000).to(dtype)
    x = torch.randn(2, 512)
    whole = F.linear(x, lin.weight.float(), lin.bias.float())
    monkeypatch.setattr(layers, "F32_BLOCK_BYTES", 4 * 512 * 7)  # 7 rows a block: 429 blocks
    out = layers.linear_f32(lin, x)
    assert out.shape == (2, 3000) and out.dtype == torch.float32
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    lin32 = nn.Linear(512, 30).float()  # an fp32 weight: used as it is
    assert torch.equal(layers.linear_f32(lin32, x), F.linear(x, lin32.weight, lin32.bias))
