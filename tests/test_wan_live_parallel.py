"""Ulysses sequence parallelism of LiveAvatar's streaming forward (live_parallel.py): 2 gloo ranks equal causal.py on
one rank over 2 clips of blocks with the sink refresh; the caches' head shards; the costs at full size."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from avatar_cli.families.wan_s2v import causal
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT
from avatar_cli.families.wan_s2v.live_parallel import rank_costs, shard_caches
from tests.conftest import torchrun

SCRIPTS = Path(__file__).parent / "dist_scripts"


def test_two_ranks_stream_equals_one_rank():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(SCRIPTS), AVATAR_DIST_TIMEOUT_S="30")
    r = torchrun("--standalone", "--nproc_per_node", "2", str(SCRIPTS / "wan_live_sp_equivalence.py"), env=env,
                 timeout=120)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(lines[-1])
    assert res["ok"] is True, res
    # 8 blocks x 4 steps, the sink refreshed at block 4: every block's latents within 1e-5 of one rank's
    assert len(res["latents_rel"]) == 8 and max(res["latents_rel"]) < 1e-5, res["latents_rel"]
    assert res["latents_absmax"] > 1.0  # not trivially zero
    assert res["golden_rel"] < 1e-5  # and against LiveAvatar's own CausalWanModel_S2V (tests/golden/liveavatar)
    assert res["one_rank_bit_equal"] is True  # a 1-rank group through the class is causal.py bit for bit
    # each rank held 1 of the 2 heads and ran half the rows: 48 of a block's 96, 40 of the sink's 80
    assert res["cache_heads"] == 1 and res["rows"] == [40, 48]
    assert max(res["caches_rel"].values()) < 1e-5 and res["reshard_equal"] is True, res
    assert "heads=1 is not divisible by the degree 2" in res["heads_error"]


def test_shard_caches_cuts_heads():
    p = WanDiTParams.tiny()
    whole = causal.CausalCaches.empty(p, 8, 16, steps=2)
    g = torch.Generator().manual_seed(0)
    whole = causal.CausalCaches(**{n: torch.randn(t.shape[:1] + (5,) + t.shape[2:] if n.startswith("sink") else
                                                  t.shape, generator=g) for n, t in whole.tensors().items()})
    parts = [shard_caches(whole, r, 2) for r in range(2)]
    assert parts[0].k.shape == (2, p.num_layers, whole.ring_tokens, 1, p.head_dim)
    for n, t in whole.tensors().items():
        assert torch.equal(torch.cat([getattr(s, n) for s in parts], dim=-2), t)
        assert getattr(parts[1], n).is_contiguous()
    with pytest.raises(ValueError, match="not divisible by the degree 3"):
        shard_caches(whole, 0, 3)


def test_one_rank_refuses_a_rank_share_of_heads():
    """Caches of one head (a 2-rank share) given to the one-rank forward: refused, not attended with."""
    p = WanDiTParams.tiny()
    model = WanS2VDiT(p).eval()
    c = causal.CausalCaches.empty(p, 8, 16, heads=1)
    c.sink_k = c.sink_v = torch.zeros(p.num_layers, causal.sink_tokens(p, 8, 16), 1, p.head_dim)
    inputs = causal.block_inputs(model, torch.zeros(3, p.text_dim), torch.zeros(1, 25, p.audio_dim, 12))
    with pytest.raises(ValueError, match="caches hold 1 heads, this rank attends with 2"):
        causal.causal_forward(model, c, 0, torch.zeros(16, 3, 8, 16), torch.full((3,), 1000.0), 0, inputs, 30)


def test_costs_at_full_size():
    """Wan2.2-S2V-14B at 704x384 (latent 48x88), bf16, 8 ranks: 1/8 of the 41.52 GB of rings and of the 2.16 GB sink
    a rank; per block-forward 649 MB through the all-to-alls and 811 kB of head outputs."""
    p = WanDiTParams.full()
    one, eight = rank_costs(p, 48, 88, 1), rank_costs(p, 48, 88, 8)
    assert one["rings"] == 41_523_609_600 and one["sink"] == 2_162_688_000
    assert eight == {"rings": 5_190_451_200, "sink": 270_336_000, "all_to_all": 648_806_400, "head_gather": 811_008}
    with pytest.raises(ValueError, match="degree 3"):
        rank_costs(p, 48, 88, 3)


class ShapesOnly:
    """The exchange of rank 0 of `world` with the shapes of what it would receive, for a forward on meta."""

    def __init__(self, world: int):
        self.world, self.rank = world, 0

    def to_heads(self, qkv: torch.Tensor, tokens: int) -> torch.Tensor:
        S, B, H, n, Dh = qkv.shape
        return qkv.new_empty(S, B, H // self.world, tokens, Dh)

    def to_rows(self, a: torch.Tensor, tokens: int) -> torch.Tensor:
        B, hs, N, Dh = a.shape
        return a.new_empty(B, hs * self.world, -(-tokens // self.world), Dh)

    def gather_rows(self, out: torch.Tensor, tokens: int) -> torch.Tensor:
        return out.new_empty(tokens, out.shape[1])


def test_rank_activations_at_full_size_on_meta():
    """One rank's block-forward of 8 at full size (704x384, bf16, after the first clip: full ring + sink), on meta:
    the tensors it allocates peak at 143 MB (fused attention), with the time projection's weight kept in fp32 (bf16,
    linear_f32 adds a 629 MB fp32 copy of it at every forward, whatever the rank count)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    try:
        from wan_budget import on_meta, peak_bytes
    finally:
        sys.path.pop(0)
    p = WanDiTParams.full()
    dit = on_meta(WanS2VDiT, p, torch.bfloat16)
    dit.time_projection.float()
    c = causal.CausalCaches.empty(p, 48, 88, dtype=torch.bfloat16, device="meta", heads=p.num_heads // 8)
    c.sink_k = c.sink_v = torch.empty(p.num_layers, 2640, 5, p.head_dim, dtype=torch.bfloat16, device="meta")
    with torch.device("meta"):
        inputs = causal.BlockInputs(torch.empty(1, p.text_len, p.dim, dtype=torch.bfloat16),
                                    torch.empty(3, p.num_audio_token + 1, p.dim), torch.empty(3, p.dim))
        x, t = torch.empty(16, 3, 48, 88, dtype=torch.bfloat16), torch.full((3,), 602.15)
    peak = peak_bytes(lambda: causal.causal_forward(dit, c, 0, x, t, 8, inputs, 10, exchange=ShapesOnly(8)))
    # the largest: the rank's per-row modulation (396, 6, 5120) fp32, 48.7 MB; [ring | sink] keys and values
    # (5 heads x 15,312 x 128 bf16), 19.6 MB each
    assert 100e6 < peak < 200e6, peak
