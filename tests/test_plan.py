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
from avatar_cli.plan import GB, GIB, format_plan, machine, make_plan
from avatar_cli.runtime.job_budget import job_budget
from avatar_cli.spec import load_job
from tests.conftest import write_reference, write_wav

CLIP = ["model=wan-s2v-14b", "video.width=832", "video.height=448"]  # the official 480p (16:9)
# One test process counts every full-size budget of this file (each is counted once per process and cached): the
# Makefile's `--dist loadgroup` keeps the group on one pytest-xdist worker instead of counting them twice.
pytestmark = pytest.mark.xdist_group("full-size budgets")

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


def budget_of(job: Path, mode=CLIP):
    """The family's budget the plan counted with (bf16 on a GPU, at the mode's size)."""
    import torch

    j = load_job(job, mode)
    return job_budget(j, j.source, (832, 448) if mode is CLIP else (704, 384), torch.bfloat16)


def test_the_four_machines_in_clip_mode(job: Path):
    one24 = plan(job, "1x24GB", "32GB")
    assert (one24.parallel, one24.ranks[0].offload, one24.host_tier, one24.decode, one24.text) == \
        ("single", "block", "mmap", "inline", "cache")
    r = one24.ranks[0]
    assert r.models == ["audio", "dit", "vae"]  # a cached prompt: umT5 is not loaded
    # block offload holds the DiT's root and two blocks (the running one and the next), beside the next stage's
    # model (the larger of the others): the parts add up to what the plan says the GPU holds
    dit = budget_of(job).models["dit"]
    assert dit.total == one24.model_bytes["dit"] == dit.root + dit.blocks_total and dit.blocks == 40
    others = max(one24.model_bytes[n] for n in r.models if n != "dit")
    assert r.weights_bytes == dit.root + 2 * dit.block + others < one24.model_bytes["dit"]
    assert r.gpu_bytes == 1 * GB + r.weights_bytes + r.state_bytes + r.work_bytes + r.worker_bytes
    assert fits(one24) and one24.gpu_bytes <= 24 * GIB and one24.host_bytes <= 32 * GIB
    # a clip is its forwards, then the decode (nothing overlaps in the clip mode)
    assert one24.speed["clip_s"] == pytest.approx(80 * one24.speed["forward_s"] + one24.speed["decode_s"], abs=0.1)

    one48 = plan(job, "1x48GB", "64GB")
    assert (one48.parallel, one48.ranks[0].offload, one48.host_tier) == ("single", "none", "")
    r = one48.ranks[0]  # nothing offloaded: every loaded model resident, whole
    assert fits(one48) and r.weights_bytes == sum(one48.model_bytes[n] for n in r.models)

    five24 = plan(job, "5x24GB", "128GB")
    r = five24.ranks[0]
    assert (five24.parallel, r.count, r.sharded, r.offload, five24.host_tier) == \
        ("sequence", 5, ["dit"], "block", "pinned")
    assert fits(five24) and "all-gathers" in r.shard_why

    eight80 = plan(job, "8x80GB", "1024GB")
    r = eight80.ranks[0]
    assert (eight80.parallel, r.count, r.sharded, r.offload) == ("sequence", 8, [], "none")
    assert fits(eight80) and "replicating dit" in r.shard_why
    # More GPUs never need more of each: the fullest GPU of 8 ranks holds at most what one rank's does.
    one80 = plan(job, "1x80GB", "1024GB")
    assert one80.ranks[0].offload == "none" and r.gpu_bytes <= one80.ranks[0].gpu_bytes
    assert r.weights_bytes == one80.ranks[0].weights_bytes and r.work_bytes <= one80.ranks[0].work_bytes
    # Replicated and resident, a forward is its compute alone, split over the ranks: 8 cards take an eighth of
    # one's time, and half the utilisation twice the time.
    assert eight80.speed["forward_s"] == pytest.approx(one80.speed["forward_s"] / 8, rel=1e-3)
    slow = make_plan(load_job(job, CLIP), machine("8x80GB", "1024GB"), util=0.2)
    assert slow.speed["forward_s"] == pytest.approx(2 * eight80.speed["forward_s"], rel=1e-3)
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
    b = budget_of(job, STREAMING)
    # a step rank holds its own step's ring and the sink: the 4 steps' rings and one sink make the whole state
    assert fits(five) and step.state_bytes == b.step_state and b.state == 4 * (b.step_state - b.sink) + b.sink
    assert five.decode == "inline" and five.speed["fps"] > 0

    one = plan(job, "1x24GB", "64GB", mode=STREAMING)
    r = one.ranks[0]
    assert one.fits and fits(one) and r.offload == "block" and one.host_tier == "mmap"
    assert r.state_bytes == 0  # no ring on the device, and the decode's cache with the decode worker
    assert r.worker_bytes > 0 and r.work_bytes == b.a2v_peak + b.ring_layer  # a forward's, and one layer's ring
    assert one.host_bytes >= b.state + 4 * GB and "runtime.rings: host (auto" in " ".join(one.notes)  # pinned
    assert "rings from host memory" in one.speed["forward"]
    small = plan(job, "1x24GB", "32GB", mode=STREAMING)  # the rings alone are 43.7 GB: in a scratch file
    assert small.fits and fits(small) and "runtime.rings: disk (auto" in " ".join(small.notes)
    assert small.speed["fps"] < one.speed["fps"] and "rings from disk" in small.speed["forward"]
    device = plan(job, "1x24GB", "64GB", "runtime.rings=device", mode=STREAMING)
    assert not device.fits and device.ranks[0].state_bytes >= b.state and "does not fit" in " ".join(device.notes)


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
    """The render's placement and the plan's are fed the same working set (runtime/budget.py working_set over the
    family's budget): here for the release's size resolved as a render resolves a job, on 8 ranks."""
    import torch

    from avatar_cli.job import Split, resolve_parallel
    from avatar_cli.runtime.budget import working_set
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.runtime.job_budget import render_working_bytes

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
    assert working_set(b, Split.sequence, 8, 0, "inline", ())[1] == max(b.a2v_peak // 8, b.decode_peak)


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


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory) -> Path:
    from avatar_cli.families.registry import init_family_dir

    d = tmp_path_factory.mktemp("wan") / "wan"
    init_family_dir(d, "tiny", seed=0, family="wan-s2v")
    return d


@pytest.mark.parametrize("kind", ["gguf", "fp8"])
def test_a_dit_file_is_counted_in_its_own_format(job: Path, tiny_wan: Path, tmp_path: Path, kind: str):
    """A job's `dit:` file (GGUF Q8_0, ComfyUI's scaled FP8): the plan counts the DiT as the render's load holds it
    in bf16, from the file's header (its quantized tensors at their stored bytes, the rest at 2 bytes a value), not
    as a bf16 DiT; and, as placement does, never shards its quantized weights."""
    import gguf
    import torch

    from avatar_cli.families.wan_s2v import dit_file
    from avatar_cli.families.wan_s2v import model_dir as wan
    from avatar_cli.families.wan_s2v.family import QUANTIZED
    from avatar_cli.modules.tensor_files import read_header
    from avatar_cli.runtime.placement import model_sizes
    from tests.fp8_files import fp8_file
    from tests.gguf_files import T, write_dit_gguf

    state = wan._read_safetensors(tiny_wan / "diffusion_pytorch_model.safetensors.index.json")
    f = tmp_path / ("dit-Q8_0.gguf" if kind == "gguf" else "dit_fp8_scaled.safetensors")
    if kind == "gguf":
        write_dit_gguf(f, state, T.Q8_0)
    else:
        fp8_file(state, f)
    size = [f"model={tiny_wan}", "video.width=64", "video.height=64"]
    plain = make_plan(load_job(job, size), machine("2x24GB"))
    filed = make_plan(load_job(job, [*size, f"dit={f}"]), machine("2x24GB"))
    bf16 = sum(t.numel() * 2 for t in state.values())
    assert plain.model_bytes["dit"] == bf16 and plain.weights == "bf16"

    # From the header, as this test reads it: what stays quantized, and the rest in bf16.
    if kind == "gguf":
        tensors = gguf.GGUFReader(str(f)).tensors
        quantized = [t for t in tensors if t.tensor_type not in (T.F32, T.F16, T.BF16)]
        held = sum(int(t.n_bytes) + 2 for t in quantized) + sum(2 * int(t.n_elements) for t in tensors
                                                                if t not in quantized)
    else:
        header = {k.removeprefix("model.diffusion_model."): v for k, v in read_header(f).items()}
        kept = ("blocks.", "audio_injector.injector.")  # the Linears the load keeps in FP8
        held = 0
        for name in state:
            info = header[name]
            if info.dtype == torch.float8_e4m3fn and name.startswith(kept):
                held += info.numel + 4 * header[name.removesuffix(".weight") + ".scale_weight"].numel
            else:
                held += 2 * info.numel
    assert filed.model_bytes["dit"] == held < bf16
    # ... which is what the render's load of the file holds once placed in bf16, as placement counts it.
    module = dit_file.load(dit_file.inspect(f), wan.read_config(tiny_wan).dit, dict(QUANTIZED)["dit"])
    module.to("cpu", torch.bfloat16)
    if module.after_load is not None:
        module.after_load(module.model)
    assert model_sizes(module.model).total == held
    # Every other model as before; on two GPUs the DiT replicated, and the weights line names the file's format.
    assert {n: b for n, b in filed.model_bytes.items() if n != "dit"} == \
        {n: b for n, b in plain.model_bytes.items() if n != "dit"}
    r = filed.ranks[0]
    assert "dit" not in r.sharded and "quantized weights are not sharded" in r.shard_why
    assert r.offload == "none" and r.weights_bytes == sum(filed.model_bytes[n] for n in r.models)
    assert filed.weights == ("GGUF Q8_0" if kind == "gguf" else "scaled FP8") and str(f) in filed.weights_why


def test_a_dit_file_is_checked_against_the_size_named_without_weights(job: Path, tiny_wan: Path, tmp_path: Path):
    """`model: wan-s2v-14b` with a `dit:` file: the file is planned against the release's DiT (here a tiny one's
    file, which does not fit it: exit 2 naming the file), not refused for want of a model directory."""
    from tests.gguf_files import T, write_dit_gguf
    from avatar_cli.families.wan_s2v import model_dir as wan

    f = tmp_path / "tiny.gguf"
    write_dit_gguf(f, wan._read_safetensors(tiny_wan / "diffusion_pytorch_model.safetensors.index.json"), T.Q8_0)
    with pytest.raises(InputError, match=f"dit: {f}: the file does not fit the wan-s2v DiT"):
        plan(job, "1x24GB", None, f"dit={f}")


SR = ["sr.model=swiftvr"]  # SwiftVR at the release's size, named without weights


@pytest.fixture(scope="module")
def sr_pair(job: Path):
    """The clip mode on 8 x 80 GB, without and with SwiftVR x2 (the layout the same: nothing offloaded)."""
    return plan(job, "8x80GB", "1024GB"), plan(job, "8x80GB", "1024GB", *SR)


def test_super_resolution_adds_its_models_meta_count_on_the_rank_that_decodes(sr_pair):
    """SwiftVR's transformer and ReAE built on meta at the release's size (4,999,787,712 and 40,946,364 parameters,
    counted from the official code's shapes), in the runtime dtype, with its prompt embedding: exactly what the
    plan adds to the decoding rank's weights; its state and its first chunk's activations join that rank's."""
    import torch

    from avatar_cli.runtime.meta_count import n_bytes
    from avatar_cli.sr.swiftvr.dit import SwiftVRDiT, SwiftVRParams
    from avatar_cli.sr.swiftvr.reae import ReAE, ReAEParams
    from avatar_cli.sr.swiftvr.budget import PROMPT_SHAPE

    base, sr = sr_pair
    with torch.device("meta"):
        dit = SwiftVRDiT(SwiftVRParams.release())
        reae = ReAE(ReAEParams.release())
    params = n_bytes(dit.to(torch.bfloat16)) // 2, n_bytes(reae.to(torch.bfloat16)) // 2
    assert params == (4_999_787_712, 40_946_364)
    counted = 2 * (sum(params) + PROMPT_SHAPE[0] * PROMPT_SHAPE[1])  # bf16
    assert sr.sr["weights_bytes"] == counted == sr.model_bytes["sr_dit"] + sr.model_bytes["sr_reae"]
    b, s = base.ranks[0], sr.ranks[0]
    assert (base.decode, b.offload, s.offload) == ("inline", "none", "none")
    assert s.weights_bytes - b.weights_bytes == counted
    assert s.state_bytes - b.state_bytes == sr.sr["state_bytes"] > 0
    assert s.work_bytes == max(b.work_bytes, sr.sr["work_bytes"])
    assert sr.sr["where"] == "rank 0" and sr.sr["size"] == [2 * 832, 2 * 448] and fits(sr)
    # the decode's time grows by the super-resolution's, the forwards' not at all
    assert sr.speed["forward_s"] == base.speed["forward_s"] and sr.speed["sr_s"] > 0
    assert sr.speed["clip_s"] == pytest.approx(base.speed["clip_s"] + sr.speed["sr_s"], abs=0.1)
    assert "sr_s" not in base.speed and base.sr is None


def test_super_resolution_scale_and_weights():
    """x4 makes its activations larger (the output has 4 times the pixels), not its weights; int8 makes its
    transformer's Linears smaller. (The release's size, at a small frame: the rule, not the 480p figure.)"""
    import torch

    from avatar_cli.sr.swiftvr.budget import sr_budget

    x2, x4 = (sr_budget(None, (128, 64), scale, torch.bfloat16) for scale in (2, 4))
    assert (x2.out_size, x4.out_size) == ((256, 128), (512, 256)) and x4.models == x2.models
    assert x4.peak > x2.peak and x4.flops > 2 * x2.flops and x4.state > x2.state
    int8 = sr_budget(None, (128, 64), 2, torch.bfloat16, "int8")
    assert int8.models["sr_dit"].total < 0.6 * x2.models["sr_dit"].total
    assert int8.models["sr_reae"] == x2.models["sr_reae"] and int8.peak == x2.peak


def test_super_resolution_sits_on_the_decode_rank_of_the_timestep_pipeline(job: Path):
    """5 x 24 GB streaming: the step ranks hold what they held; the decode rank adds SwiftVR beside the VAE."""
    base = plan(job, "5x24GB", "128GB", mode=STREAMING)
    sr = plan(job, "5x24GB", "128GB", *SR, mode=STREAMING)
    (bstep, bdec), (sstep, sdec) = base.ranks, sr.ranks
    assert sr.parallel == "steps" and sr.sr["where"] == "the decode rank"
    assert sstep.models == bstep.models and sstep.gpu_bytes == bstep.gpu_bytes
    assert sdec.models == sorted([*bdec.models, "sr_dit", "sr_reae"]) and sdec.gpu_bytes > bdec.gpu_bytes
    assert sdec.state_bytes == bdec.state_bytes + sr.sr["state_bytes"]
    assert sr.speed["fps"] <= base.speed["fps"]
    assert fits(sr) and "sr        x2" in format_plan(sr)


def test_auto_decodes_inline_where_the_worker_cannot_hold_super_resolution(job: Path):
    """1 x 24 GB streaming: the worker that auto takes without SR would hold SwiftVR whole beside the DiT and not
    fit; the plan decodes inline (SR placed with the other models), says why, and fits. Asked for, the worker stays
    and does not fit."""
    base = plan(job, "1x24GB", "32GB", mode=STREAMING)
    sr = plan(job, "1x24GB", "32GB", *SR, mode=STREAMING)
    assert base.decode == "worker" and (sr.decode, sr.sr["where"]) == ("inline", "the GPU")
    assert "whole" in sr.decode_why and fits(sr)
    asked = plan(job, "1x24GB", "32GB", *SR, "runtime.decode=worker", mode=STREAMING)
    assert asked.decode == "worker" and asked.decode_why == "asked for" and not asked.fits


def test_a_super_resolution_directory_is_counted_from_its_own_files(job: Path, tiny_wan: Path, tmp_path: Path):
    """A SwiftVR directory (the tiny one `models init --family swiftvr` writes) is counted from its config and
    headers: its tensors at 2 bytes a value; a broken one, or a path that is no directory, is exit 2 naming it."""
    from safetensors.torch import load_file, save_file

    from avatar_cli.sr.swiftvr.model_dir import init_tiny

    init_tiny(tmp_path / "sr", seed=0)
    size = [f"model={tiny_wan}", "video.width=64", "video.height=64"]
    p = make_plan(load_job(job, [*size, f"sr.model={tmp_path / 'sr'}"]), machine("1x24GB"))
    files = [tmp_path / "sr" / "reae.safetensors", tmp_path / "sr" / "prompt_embedding.safetensors",
             tmp_path / "sr" / "transformer" / "diffusion_pytorch_model.safetensors"]
    assert p.sr["weights_bytes"] == sum(2 * t.numel() for f in files for t in load_file(str(f)).values())
    assert p.sr["size"] == [128, 128] and p.sr["model"] == str(tmp_path / "sr") and p.fits

    reae = load_file(str(files[0]))
    name = sorted(reae)[0]
    reae[name] = reae[name].flatten()[1:]  # mis-shaped
    save_file(reae, str(files[0]))
    with pytest.raises(InputError, match=name.replace(".", r"\.")):
        make_plan(load_job(job, [*size, f"sr.model={tmp_path / 'sr'}"]), machine("1x24GB"))
    with pytest.raises(InputError, match="sr.model: .*nowhere: not a directory"):
        make_plan(load_job(job, [*size, f"sr.model={tmp_path / 'nowhere'}"]), machine("1x24GB"))
