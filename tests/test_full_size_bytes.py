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


def test_resume_copies_at_full_size_move_a_gib_a_block_and_one_snapshot_at_most():
    """LiveAvatar at 704x384 (latent 48 x 88): its 4 rings are 41.5 GB. Copied after one block in 39 (both sides
    know which: resume_schedule), the step ranks send the decode rank 1 GiB a block on average instead of 41.5 GB,
    and of the DEPTH stretches a decode worker has in flight at most one keeps a snapshot."""
    from types import SimpleNamespace

    from avatar_cli.families.wan_s2v.dit import WanDiTParams
    from avatar_cli.families.wan_s2v.live import LiveAvatarFamily
    from avatar_cli.pipeline import checkpoint as ckpt
    from avatar_cli.stages.decode_worker import DEPTH

    family = LiveAvatarFamily(SimpleNamespace(dit=WanDiTParams.full()))
    rings = family.resume_bytes((704, 384), steps=4)
    assert rings == 4 * 40 * (12 * 48 * 88 // 4) * 5120 * 2 * 2  # steps x layers x ring tokens x dim x (k, v) x bf16
    due = ckpt.resume_schedule(rings)
    blocks = range(10_000)
    copied = [b for b in blocks if due(b)]
    assert copied[:2] == [38, 77]
    assert rings * len(copied) / len(blocks) <= ckpt.POINT_BYTES_PER_BLOCK  # bytes moved per block, on average
    assert max(sum(due(b) for b in range(g, g + DEPTH)) for g in blocks) == 1  # snapshots in flight
    assert all(ckpt.resume_schedule(0)(b) for b in range(10))  # a small state: every block, as before


def test_an_fp32_island_at_full_size_holds_32_mb_of_weight_not_a_629_mb_copy():
    """The time projection (5120 -> 6 x 5120, bf16) on meta: what linear_f32 allocates beyond its inputs."""
    from avatar_cli.families.wan_s2v.dit import WanDiTParams
    from avatar_cli.runtime.meta_count import peak_bytes

    d = WanDiTParams.full().dim
    proj = nn.Linear(d, 6 * d, device="meta", dtype=torch.bfloat16)
    t = torch.empty(2, d, device="meta")  # (2, D) the two timesteps' embeddings
    whole = 6 * d * d * 4
    assert whole == 629_145_600  # what upcasting the whole weight allocated on every forward
    out = 2 * 6 * d * 4  # (2, 6D) fp32, the blocks' outputs and their concatenation
    peak = peak_bytes(lambda: layers.linear_f32(proj, t))
    assert peak <= layers.F32_BLOCK_BYTES + 3 * out, peak


def test_a_bfloat16_vae_decode_at_480p_peaks_at_half_the_float32_one():
    """One latent's decode continuing a timeline at 480p (latent 60 x 104), counted on meta."""
    from avatar_cli.families.wan_s2v.budget import _vae_decode
    from avatar_cli.families.wan_s2v.vae import WanVAEParams

    vp = WanVAEParams.full()
    f32, _, cache32 = _vae_decode(vp, 60, 104, 2, torch.float32)
    bf16, _, cache16 = _vae_decode(vp, 60, 104, 2, torch.bfloat16)
    assert bf16 <= 0.52 * f32 and cache16 <= 0.52 * cache32, (bf16, f32, cache16, cache32)


def test_one_counting_run_gives_the_peak_and_the_flops_of_two():
    """peak_and_flops counts the peak (attention fused) and the FLOPs in one run on meta: the same figures as
    peak_bytes and a FlopCounterMode over the math path, attention given by position or by name, 3-d or 4-d."""
    from avatar_cli.runtime.flops import flop_counter
    from avatar_cli.runtime.meta_count import peak_and_flops, peak_bytes

    with torch.device("meta"):
        proj = nn.Linear(64, 192)
        x = torch.empty(2, 300, 64)

    def forward():
        q, k, v = proj(x).view(2, 300, 3, 4, 16).permute(2, 0, 3, 1, 4)  # each (2, 4, 300, 16)
        a = F.scaled_dot_product_attention(q, k, v)
        b = F.scaled_dot_product_attention(query=q[0], key=k[0, :, :100], value=v[0, :, :100])  # (4, 300, 16)
        return a.sum() + b.sum()

    counter = flop_counter()
    with torch.no_grad(), counter:
        forward()
    peak, flops = peak_and_flops(forward)
    assert (peak, flops) == (peak_bytes(forward), counter.get_total_flops())
    assert flops > 2 * 2 * 300 * 64 * 192  # the attentions counted beside the projection
