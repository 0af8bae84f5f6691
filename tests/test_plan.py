"""`avatar plan`: the layout a render would choose for Wan2.2-S2V-14B on machines this CPU does not have, counted on
the meta device at full size (no weights: the job names the release's size), checked against each machine's memory.

The figures are the models' own: every test below computes them from the meta builds (families/wan_s2v/budget.py)
and asserts the choices the render's functions make from them, and that what each GPU holds fits the card.
"""

import json
from pathlib import Path

import pytest

from avatar_cli.cli import _app
from avatar_cli.errors import InputError
from avatar_cli.job import resolve
from avatar_cli.plan import GB, GIB, machine, make_plan
from avatar_cli.spec import load_job
from tests.conftest import write_reference, write_wav

CLIP = ["model=wan-s2v-14b", "video.width=832", "video.height=448"]  # the official 480p (16:9)
STREAMING = ["model=wan-s2v-14b", "mode=streaming", "video.width=704", "video.height=384"]  # LiveAvatar's size


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("plan")
    write_reference(d / "ref.png")
    write_wav(d / "speech.wav", 1.0)
    (d / "job.yaml").write_text("reference: ref.png\naudio: speech.wav\noutput: out.mp4\nprompt: a person talking\n")
    return d / "job.yaml"


def plan(job: Path, gpus: str, host: str | None, *overrides: str, mode=CLIP):
    return make_plan(load_job(job, [*mode, *overrides]), machine(gpus, host))


def fits(p) -> bool:
    """What the fullest GPU holds against the card, and the host's need against the host, recomputed here."""
    gpu = max(r.gpu_bytes for r in p.ranks)
    return gpu == p.gpu_bytes and gpu <= p.gpu_capacity and (p.host_capacity is None or p.host_bytes <= p.host_capacity)


def test_the_four_machines_in_clip_mode(job: Path):
    one24 = plan(job, "1x24GB", "32GB")
    assert (one24.parallel, one24.ranks[0].offload, one24.host_tier, one24.decode, one24.text) == \
        ("single", "block", "mmap", "inline", "cache")
    r = one24.ranks[0]
    assert r.models == ["audio", "dit", "vae"]  # a cached prompt: umT5 is not loaded
    # block offload holds the DiT's root (4.48 GB: embedders, 12 audio injectors, head) and two 0.70 GB blocks
    assert 4.4 * GB < r.weights_bytes - 1.26e9 - 0.5e9 < 6 * GB
    assert fits(one24) and one24.gpu_bytes <= 24 * GIB and one24.host_bytes <= 32 * GIB
    assert one24.speed["clip_s"] > 80 * one24.speed["forward_s"] > 0

    one48 = plan(job, "1x48GB", "64GB")
    assert (one48.parallel, one48.ranks[0].offload, one48.host_tier) == ("single", "none", "")
    assert fits(one48) and one48.ranks[0].weights_bytes > 32 * GB  # the whole DiT resident

    five24 = plan(job, "5x24GB", "128GB")
    r = five24.ranks[0]
    assert (five24.parallel, r.count, r.sharded, r.offload, five24.host_tier) == \
        ("sequence", 5, ["dit"], "block", "pinned")
    assert fits(five24) and "all-gathers" in r.shard_why

    eight80 = plan(job, "8x80GB", "1024GB")
    r = eight80.ranks[0]
    assert (eight80.parallel, r.count, r.sharded, r.offload) == ("sequence", 8, [], "none")
    assert fits(eight80) and "replicating dit" in r.shard_why
    # 80 forwards of 1.715 PFLOP over 8 cards at 40 % of 989 TFLOP/s, and the decode: bench/wan_budget.py's 45 s
    assert 40 < eight80.speed["clip_s"] < 50
    assert eight80.speed["clip_s"] < five24.speed["clip_s"] < one24.speed["clip_s"]


def test_the_host_tier_at_full_size_on_one_24gb_card_and_a_32gb_host(job: Path):
    """The DiT's 28.1 GB of blocks: pinned copies (with the rest) need more than a 32 GB host; the mmap tier keeps
    two staging blocks and the root, and fits, on a GPU whose peak stays under 24 GB either way."""
    pinned = plan(job, "1x24GB", "32GB", "runtime.offload_host=pinned")
    mapped = plan(job, "1x24GB", "32GB", "runtime.offload_host=mmap")
    assert pinned.gpu_bytes == mapped.gpu_bytes <= 24 * GIB
    assert pinned.host_bytes > 32 * GIB and not pinned.fits and "host needs" in " ".join(pinned.notes)
    # and what would: the smallest settings, planned on the same machine
    assert "with runtime.weights=int8 runtime.vae_dtype=bfloat16: it fits" in " ".join(pinned.notes)
    assert mapped.host_bytes < 16 * GB and mapped.fits
    assert pinned.host_bytes - mapped.host_bytes > 28 * GB - 2 * 0.71 * GB
    assert "disk" in mapped.speed["forward"]  # a 32 GB host's page cache cannot hold 28 GB of blocks


def test_streaming_mode_plans(job: Path):
    """5 x 24 GB: the timestep pipeline (4 step ranks + a decode rank), each step rank streaming the DiT's blocks
    and holding its own ring. One 24 GB card: the DiT's blocks streamed, so the 4 steps' key/value rings and the
    sink (43.7 GB) wait in pinned host memory (runtime.rings: auto), each layer's brought in for its attention,
    with a 64 GB host; with 32 GB in a memory-mapped scratch file, slower; kept on the device they do not fit."""
    five = plan(job, "5x24GB", "64GB", mode=STREAMING)
    step, dec = five.ranks
    assert (five.parallel, step.count, step.offload, dec.models, five.host_tier) == \
        ("steps", 4, "block", ["vae"], "mmap")  # 4 pinned copies of the DiT would not fit 64 GB; one page cache
    assert fits(five) and 12 * GB < step.state_bytes < 13 * GB  # its ring 10.38 GB and the sink 2.16 GB
    assert five.decode == "inline" and five.speed["fps"] > 0

    one = plan(job, "1x24GB", "64GB", mode=STREAMING)
    r = one.ranks[0]
    assert one.fits and fits(one) and r.offload == "block" and one.host_tier == "mmap"
    assert r.state_bytes < 1 * GB  # no ring on the device: the decode's cache only (a decode worker)
    assert 0.3 * GB < r.work_bytes < 2 * GB  # a forward's activations and one layer's ring and sink (0.31 GB)
    assert 43 * GB < one.host_bytes < 64 * GB and "runtime.rings: host (auto" in " ".join(one.notes)
    assert "rings from host memory" in one.speed["forward"]
    small = plan(job, "1x24GB", "32GB", mode=STREAMING)  # the rings alone are 43.7 GB: in a scratch file
    assert small.fits and fits(small) and "runtime.rings: disk (auto" in " ".join(small.notes)
    assert small.speed["fps"] < one.speed["fps"] and "rings from disk" in small.speed["forward"]
    device = plan(job, "1x24GB", "64GB", "runtime.rings=device", mode=STREAMING)
    assert not device.fits and device.ranks[0].state_bytes > 40 * GB and "does not fit" in " ".join(device.notes)


def test_plan_command_json_and_bad_machines(job: Path, capsys):
    assert _app(["plan", str(job), "--model", "wan-s2v-14b", "--gpus", "8x80GB", "video.width=832",
                 "video.height=448", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["event"] == "plan" and out["machine"] == "8x80GB" and out["fits"] is True
    assert out["ranks"][0]["sharded"] == [] and out["ranks"][0]["gpu_bytes"] <= 80 * GIB
    assert _app(["plan", str(job), "--model", "wan-s2v-14b", "--gpus", "5x"]) == 2
    assert "expected COUNTxSIZE" in capsys.readouterr().err
    assert _app(["plan", str(job), "--model", "wan-s2v-14b", "--gpus", "2x20GB"]) == 2
    assert "--tflops" in capsys.readouterr().err
    assert _app(["plan", str(job), "--gpus", "1x24GB"]) == 2  # the job's model: the shipped mini, no budget
    assert "no budget" in capsys.readouterr().err


def test_a_render_refuses_a_size_named_without_weights(job: Path):
    with pytest.raises(InputError, match="needs the model directory"):
        resolve(load_job(job, CLIP))


def test_a_render_keeps_free_the_working_set_the_plan_counts(job: Path):
    """The render's placement and the plan's are fed the same working set (plan.working_set over the family's
    budget): here for the release's size resolved as a render resolves a job, on 8 ranks."""
    import torch

    from avatar_cli.job import Split, resolve_parallel
    from avatar_cli.plan import job_budget, render_working_bytes, working_set
    from avatar_cli.runtime.device import Runtime

    j = load_job(job, CLIP)
    p8 = plan(job, "8x80GB", None)
    r = p8.ranks[0]
    split, _ = resolve_parallel(j, j.source, 8)

    class Resolved:  # what the render hands render_working_bytes: a ResolvedJob's fields
        model, gen_size, world_size, parallel = j.source, (832, 448), 8, split
        decode = type("D", (), {"value": p8.decode})
    Resolved.job = j
    rt = Runtime(torch.device("cuda"), torch.bfloat16)
    assert render_working_bytes(Resolved, rt, 0) == r.state_bytes + r.work_bytes + r.worker_bytes
    b = job_budget(j, j.source, (832, 448), torch.bfloat16)
    assert working_set(b, j.source.family, Split.sequence, 8, 0, "inline")[1] == max(b.a2v_peak // 8, b.decode_peak)


def test_a_model_directory_plans_from_its_own_config(job: Path, tmp_path: Path):
    """A directory (here the tiny random one `models init` writes) is counted from its config.json: its DiT's bytes,
    not the release's; the release-size plan's bytes are the 14B's."""
    from avatar_cli.families.registry import init_family_dir

    init_family_dir(tmp_path / "wan", "tiny", seed=0, family="wan-s2v")
    tiny = make_plan(load_job(job, [f"model={tmp_path / 'wan'}", "video.width=64", "video.height=64"]),
                     machine("1x24GB"))
    assert tiny.model == str(tmp_path / "wan") and tiny.ranks[0].offload == "none" and tiny.fits
    assert tiny.ranks[0].weights_bytes < 50e6 < 30e9 < plan(job, "8x80GB", None).ranks[0].weights_bytes


def test_the_docs_table_is_what_plan_says():
    """docs/plan.md's table of the four machines is bench/plan_table.py's output today (the README's is its summary)."""
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "bench"))
    try:
        from plan_table import table
    finally:
        sys.path.pop(0)
    doc = (root / "docs" / "plan.md").read_text()
    missing = [line for line in table([]) if line not in doc]
    assert not missing, missing
