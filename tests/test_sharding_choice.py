"""Shard or replicate, chosen from device memory (runtime/sharding.py)."""

import pytest

from avatar_cli.runtime.sharding import choose_sharding
from tests.conftest import torchrun

GB = 10**9
# Wan2.2-S2V-14B in bf16: DiT 32.59 GB, umT5 11.36 GB; VAE + wav2vec2 (fp32) 1.77 GB.
SIZES = {"dit": int(32.59 * GB), "text": int(11.36 * GB), "vae": int(0.51 * GB), "audio": int(1.26 * GB)}


def test_80gb_cards_replicate_everything():
    c = choose_sharding(("dit", "text"), SIZES, 8, free_bytes=79 * GB, working_bytes=18 * GB)
    assert c.sharded == () and "replicating dit, text" in c.reason and "all-gathers nothing" in c.reason


def test_a_smaller_card_replicates_the_dit_and_shards_umt5():
    c = choose_sharding(("dit", "text"), SIZES, 8, free_bytes=60 * GB, working_bytes=18 * GB)
    assert c.sharded == ("text",) and "replicating dit, sharding text" in c.reason


def test_24gb_cards_shard_both_and_say_what_it_costs():
    c = choose_sharding(("dit", "text"), SIZES, 8, free_bytes=24 * GB, working_bytes=11 * GB)
    assert c.sharded == ("dit", "text")
    assert "all-gathers 38.5 GB per rank" in c.reason  # 7/8 of 43.95 GB


def test_unknown_memory_and_forced_modes():
    assert choose_sharding(("dit",), SIZES, 2, None, 0).sharded == ("dit",)  # a CPU: as before
    assert choose_sharding(("dit",), SIZES, 2, 10**15, 0, mode="shard").sharded == ("dit",)
    assert choose_sharding(("dit",), SIZES, 2, 1, 0, mode="replicate").sharded == ()
    assert choose_sharding(("dit",), SIZES, 1, 1, 0).sharded == ()
    with pytest.raises(ValueError, match="runtime.shard"):
        choose_sharding(("dit",), SIZES, 2, None, 0, mode="sometimes")


def test_two_ranks_replicate_or_shard_and_compute_the_same():
    """place() on 2 gloo ranks: replicate keeps whole parameters, shard makes FSDP2 DTensors, auto replicates
    when the free memory allows and shards when it is unknown; the Ulysses forward equals one rank's."""
    import json
    import os
    from pathlib import Path

    scripts = Path(__file__).parent / "dist_scripts"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(scripts))
    r = torchrun("--standalone", "--nproc_per_node", "2", str(scripts / "shard_choice.py"), env=env, timeout=120)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(lines[-1])
    assert {k: (v["fsdp"], v["dtensor"]) for k, v in res.items()} == {
        "replicate/unknown": (False, False), "shard/unknown": (True, True),
        "auto/ample": (False, False), "auto/unknown": (True, True)}
    assert max(v["rel"] for v in res.values()) < 3e-6
