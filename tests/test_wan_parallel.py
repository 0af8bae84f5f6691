"""Ulysses sequence parallelism for the wan-s2v DiT: 2 gloo ranks equal 1 rank, plain and FSDP2-sharded; the
partial-frame audio injection it relies on, on one process."""

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from avatar_cli.families.wan_s2v.dit import TokenShard, WanDiTParams, WanS2VDiT
from tests.conftest import torchrun

SCRIPTS = Path(__file__).parent / "dist_scripts"
GOLDEN = Path(__file__).parent / "golden" / "wan_s2v"


def test_two_ranks_equal_one_rank_plain_and_fsdp_sharded():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    # A collective issued by the refused construction would leave rank 0 waiting: bound that wait.
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(SCRIPTS), AVATAR_DIST_TIMEOUT_S="20")
    r = torchrun("--standalone", "--nproc_per_node", "2", str(SCRIPTS / "wan_sp_equivalence.py"), env=env,
                 timeout=120)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(lines[-1])
    assert res["ok"] is True, res
    diffs = {k: v for k, v in res.items() if "/step" in k}
    # 4 clips x (plain, per_block, 2 steps of per_stage)
    assert len(diffs) == 16 and max(diffs.values()) < 1e-5, diffs
    assert min(v for k, v in res.items() if k.endswith("/out_absmax")) > 1.0  # the outputs are not trivially zero
    # Each rank's blocks ran on ceil(N / 2) rows: the odd clip (N = 75) is padded, not run whole.
    assert res["tokens"] == {"a": 480, "b": 624, "odd": 75, "one_frame": 56}
    assert res["plain/rows"] == res["per_block/rows"] == [[240, 312, 38, 28]] * 2
    assert "heads=1 is not divisible by the degree 2" in res["heads_error"]


def test_injection_by_shards_cut_inside_frames_equals_whole():
    """What lets a rank inject its own tokens: rows cut anywhere (inside a latent frame, across the noisy/ref
    boundary, past the end) inject exactly the rows the whole sequence would."""
    m = WanS2VDiT(WanDiTParams.tiny()).eval()
    m.load_state_dict(load_file(GOLDEN / "dit_tiny_weights.safetensors"), strict=True)
    c = load_file(GOLDEN / "dit_cases.safetensors")
    with torch.no_grad():
        s = m.prepare(c["b.x"], c["b.t"], c["b.context"], c["b.ref"], c["b.motion"], c["b.cond"], c["b.audio"])
        N, per_frame = s.tokens.shape[1], s.seg // 4
        assert (N, per_frame) == (624, 96)
        h = torch.randn(s.tokens.shape, generator=torch.Generator().manual_seed(0))  # (1, N, D)
        whole = m.inject(1, h, s)  # (1, N, D)
        assert (whole[:, :s.seg] - h[:, :s.seg]).abs().min() > 0 and torch.equal(whole[:, s.seg:], h[:, s.seg:])
        for length in (37, 96, 200, 700):  # 37: cuts inside frames; 700: one shard with padding rows
            shards = [TokenShard(start, length) for start in range(0, N, length)]
            parts = [m.inject(1, sh.rows(h[0])[None], dataclasses.replace(s, tokens=sh.rows(h[0])[None],
                                                                          start=sh.start)) for sh in shards]
            got = torch.cat(parts, dim=1)[:, :N]  # (1, N, D)
            assert ((got - whole).abs().max() / whole.abs().max()).item() < 1e-6, length
