"""Frame super-resolution in the publish path (stages/sr.py): sizes, every frame out, resume, live, bad input.

The SR model is a tiny SwiftVR release of random weights in the official layout (model_dir.init_tiny)."""

import json
from pathlib import Path

import av
import numpy as np
import pytest

from avatar_cli.sr.swiftvr import stream
from avatar_cli.sr.swiftvr.model_dir import init_tiny
from tests.conftest import avatar, write_wav

FRAMES = 58  # round(2.3 s * 25 fps): the job of tests/conftest.write_job


@pytest.fixture
def sr_dir(swiftvr_dir: Path) -> Path:
    return swiftvr_dir


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def frames_of(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])  # (T, H, W, 3)


def render(job_dir: Path, *args: str):
    return avatar("render", str(job_dir / "job.yaml"), "--json", *args)


def test_a_render_with_sr_is_at_the_scaled_size_with_every_frame(job_dir: Path, sr_dir: Path):
    out = job_dir / "sr.mp4"
    result = render(job_dir, f"sr.model={sr_dir}", "-o", str(out))
    assert result.returncode == 0, result.stderr
    done = events(result.stdout)[-1]
    assert done["frames"] == FRAMES
    video = frames_of(out)
    assert video.shape == (FRAMES, 128, 128, 3)  # the tiny mini's 64 x 64, x2
    assert video[-1].std() > 0  # the last frames, which SR held to the end, are pictures, not padding

    # video.width/height size the frames SR reads (mini fits its 64 x 64 to them); SR rounds its output as it needs.
    fitted = job_dir / "fitted.mp4"
    result = render(job_dir, f"sr.model={sr_dir}", "video.width=96", "video.height=54", "-o", str(fitted))
    assert result.returncode == 0, result.stderr
    assert frames_of(fitted).shape == (FRAMES, 96, 192, 3)  # SwiftVR crops 54 to a multiple of 8 first


class StopAt:
    """A reporter that interrupts the render after `n` chunks, as Ctrl-C would (the partial file and its
    checkpoint stay)."""

    def __init__(self, n: int):
        self.n, self.seen, self.lines = n, 0, []

    def chunk(self, **_) -> None:
        self.seen += 1
        if self.seen == self.n:
            raise KeyboardInterrupt

    def info(self, message: str) -> None:
        self.lines.append(message)

    def start(self, **_) -> None:
        pass


@pytest.mark.parametrize("decode", ["inline", "worker"])
def test_an_interrupted_render_with_sr_resumes_bit_identically(job_dir: Path, sr_dir: Path, decode: str):
    """Inline, or in the decode worker (which imports the SR package itself and carries its state back with each
    acknowledgement): the resumed render's frames are the uninterrupted inline render's, bit for bit."""
    from safetensors.torch import load_file

    from avatar_cli import render as rendering
    from avatar_cli.job import resolve
    from avatar_cli.pipeline import checkpoint
    from avatar_cli.spec import load_job

    write_wav(job_dir / "long.wav", 4.0)  # 100 frames, 7 N chunks of 16: SR's chunks of 28 and 24 cut across them
    args = [f"sr.model={sr_dir}", f"audio={job_dir / 'long.wav'}", "chunking.transitions=false"]
    whole = render(job_dir, *args, "-o", str(job_dir / "whole.mp4"))
    assert whole.returncode == 0, whole.stderr

    args.append(f"runtime.decode={decode}")
    job = load_job(job_dir / "job.yaml", args)
    with pytest.raises(KeyboardInterrupt) as stopped:
        rendering.render(resolve(job), StopAt(5), resume="auto")
    assert stopped.value.kept_partial
    found = checkpoint.load_checkpoint(job.partial_output)
    states = [load_file(str(job.output.parent / pt.state_file)) for pt in found.points]
    assert any(len(s["sr.pending"]) for s in states)  # points taken while SR held decoded frames back

    resumed = render(job_dir, *args)
    assert resumed.returncode == 0, resumed.stderr
    done = events(resumed.stdout)[-1]
    assert done["resumed_at"] > 0 and done["frames"] == 100
    assert done["frames_digest"] == events(whole.stdout)[-1]["frames_digest"]
    assert frames_of(job.output).shape == (100, 128, 128, 3)


def test_the_sr_model_and_scale_are_part_of_the_resume_fingerprint(job_dir: Path, sr_dir: Path, tmp_path: Path):
    from avatar_cli.pipeline.fingerprint import describe_change, job_fingerprint
    from avatar_cli.job import resolve
    from avatar_cli.spec import load_job

    def fingerprint(*overrides: str) -> dict[str, str]:
        job = load_job(job_dir / "job.yaml", list(overrides))
        return job_fingerprint(job, resolve(job).model)

    plain = fingerprint()
    assert "sr" not in plain  # a job without SR digests as before the keys existed
    x2 = fingerprint(f"sr.model={sr_dir}")
    other = tmp_path / "other"
    init_tiny(other, seed=1)
    assert describe_change(plain, x2) == "the job spec, the super-resolution model or scale"
    assert describe_change(x2, fingerprint(f"sr.model={sr_dir}", "sr.scale=4")) == \
        "the job spec, the super-resolution model or scale"
    assert describe_change(x2, fingerprint(f"sr.model={other}")) is not None
    assert describe_change(x2, fingerprint(f"sr.model={sr_dir}")) is None


def test_a_live_session_with_sr_makes_the_renders_frames_and_reports_what_sr_holds(job_dir: Path, sr_dir: Path,
                                                                                   tmp_path: Path):
    """The session chunks as the render (live.chunk_frames = chunking.frames in this job); SR holds at most one
    of its chunks (28 input frames, then 24) behind the decode, and each chunk event says how many."""
    file = render(job_dir, f"sr.model={sr_dir}", "-o", str(tmp_path / "file.mp4"))
    assert file.returncode == 0, file.stderr
    playlist = tmp_path / "hls" / "live.m3u8"
    live = render(job_dir, f"sr.model={sr_dir}", "-o", str(playlist), "live.realtime=false")
    assert live.returncode == 0, live.stderr
    evs = events(live.stdout)
    assert evs[0]["event"] == "ready" and evs[0]["size"] == [128, 128]
    done = evs[-1]
    assert done["frames"] == FRAMES and done["frames_digest"] == events(file.stdout)[-1]["frames_digest"]
    chunks = [e for e in evs if e["event"] == "chunk"]
    held = [e["sr_held"] for e in chunks]
    assert max(held) <= stream.FIRST and held[0] == 16  # N0's 16 frames wait for SR's first chunk of 28
    assert chunks[0]["published"] == 0 and chunks[-1]["published"] + held[-1] == FRAMES
    with av.open(str(playlist)) as c:
        assert sum(1 for _ in c.decode(video=0)) == FRAMES


@pytest.fixture(scope="module")
def wan_job(tmp_path_factory) -> Path:
    """A job of the tiny wan-s2v model (its official layout, random weights), 2.5 s of audio: 40 frames at 16 fps."""
    from avatar_cli.families.registry import init_family_dir
    from tests.conftest import write_reference

    folder = tmp_path_factory.mktemp("wan_sr")
    wan = folder / "Wan2.2-S2V-tiny"
    init_family_dir(wan, "tiny", seed=0, family="wan-s2v")
    write_reference(folder / "ref.png")
    write_wav(folder / "speech.wav", 2.5)
    (folder / "job.yaml").write_text(
        f"reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\nmodel: {wan}\nprompt: a person talking\n"
        "seed: 3\nvideo: {width: 80, height: 64}\nsampling: {steps: 2}\n")
    return folder


@pytest.mark.parametrize("mode", ["clip", "streaming"])
def test_wan_s2v_with_sr_through_the_cli(wan_job: Path, swiftvr_official_dir: Path, mode: str):
    """Both wan-s2v modes, with the goldens' release (its transformer written by the official code): the MP4 at
    the generated size times the scale, every frame of the family's there."""
    out = wan_job / f"{mode}.mp4"
    result = render(wan_job, f"mode={mode}", f"sr.model={swiftvr_official_dir}", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert events(result.stdout)[-1]["frames"] == 40
    assert frames_of(out).shape == (40, 128, 160, 3)  # 80 x 64, x2


def test_validate_says_what_sr_resolved_to(job_dir: Path, sr_dir: Path):
    r = avatar("validate", str(job_dir / "job.yaml"), f"sr.model={sr_dir}", "sr.scale=4", "--json")
    assert r.returncode == 0, r.stderr
    valid = events(r.stdout)[-1]
    assert valid["size"] == [256, 256] and valid["sr"] == {"model": str(sr_dir), "scale": 4, "from_size": [64, 64]}
    plain = events(avatar("validate", str(job_dir / "job.yaml"), "--json").stdout)[-1]
    assert plain["size"] == [64, 64] and "sr" not in plain


def test_bad_sr_input_is_exit_2_naming_it_with_nothing_written(job_dir: Path, sr_dir: Path, tmp_path: Path):
    import shutil

    def refused(*overrides: str) -> str:
        r = render(job_dir, *overrides)
        assert r.returncode == 2, (overrides, r.stdout, r.stderr)
        assert not (job_dir / "out").exists()  # nothing written at the output path, not even its folder
        assert "Traceback" not in r.stderr
        return events(r.stdout)[-1]["message"]

    assert "no such folder" in refused(f"sr.model={tmp_path / 'absent'}")
    (tmp_path / "empty").mkdir()
    assert "not a SwiftVR model directory" in refused(f"sr.model={tmp_path / 'empty'}")
    other = shutil.copytree(sr_dir, tmp_path / "other")
    config = other / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "_class_name": "WanS2VTransformer3DModel"}))
    assert "a Wan2.2-S2V transformer" in refused(f"sr.model={other}")
    pickled = shutil.copytree(sr_dir, tmp_path / "pickled")
    (pickled / "reae.safetensors").rename(pickled / "reae.pth")
    assert "pickle" in refused(f"sr.model={pickled}")
    assert "sr.scale must be a positive" in refused(f"sr.model={sr_dir}", "sr.scale=0")
    assert "at most 8192" in refused(f"sr.model={sr_dir}", "sr.scale=4", "video.width=4096", "video.height=4096")


# Mean |diff| of the first chunk's frames against the float ones, in [-1, 1]: measured int8 3.2e-4, fp8 9.2e-4 (e4m3
# keeps 3 bits of mantissa per weight, int8 about 7).
SR_QUANT_BOUNDS = {"int8": 2e-3, "fp8": 5e-3}


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_runtime_weights_quantize_the_sr_dits_linears(sr_dir: Path, weights: str):
    """int8 | fp8: the SR DiT's block Linears hold weights in that format (fp8 on a CPU too: weight-only, each
    forward dequantizes), and the stream's frames stay near the float ones."""
    import torch

    from avatar_cli.runtime.quantize import format_of, linears_under
    from avatar_cli.stages.sr import FrameSR, SRPlan, load_models

    plan = SRPlan(sr_dir, 2, (16, 16), (32, 32))
    cpu = torch.device("cpu")
    full, quantized = load_models(plan, cpu, torch.float32), load_models(plan, cpu, torch.float32, weights)
    assert {format_of(m.weight) for m in linears_under(full.dit, ["blocks"]).values()} == {"bf16"}
    assert {format_of(m.weight) for m in linears_under(quantized.dit, ["blocks"]).values()} == {weights}
    x = torch.rand(29, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    a, b = FrameSR(full, plan, cpu, torch.float32).push(x), FrameSR(quantized, plan, cpu, torch.float32).push(x)
    assert a.shape == b.shape == (25, 3, 32, 32) and not torch.equal(a, b)  # SwiftVR's FIRST chunk: 25 frames
    assert (a - b).abs().mean() < SR_QUANT_BOUNDS[weights]


def test_a_render_with_int8_weights_quantizes_the_sr_model_it_loads(job_dir: Path, sr_dir: Path, monkeypatch):
    from avatar_cli.runtime.quantize import format_of
    from avatar_cli.stages import sr as sr_stage

    loaded = []
    real = sr_stage.load_models
    monkeypatch.setattr("avatar_cli.render.setup.load_sr_models",
                        lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    result = render(job_dir, f"sr.model={sr_dir}", "runtime.weights=int8", "-o", str(job_dir / "int8.mp4"))
    assert result.returncode == 0, result.stderr
    assert len(loaded) == 1 and format_of(loaded[0].dit.blocks[0].attn1.to_q.weight) == "int8"
    assert frames_of(job_dir / "int8.mp4").shape == (FRAMES, 128, 128, 3)


def test_the_frames_sr_held_at_a_resume_point_after_the_last_chunk_still_come_out(sr_dir: Path):
    """A render resumed after its last chunk runs no chunk: its publisher's finish gives the frames the saved SR
    state holds, and the stretch after it takes no resume point (the stream is finished)."""
    from types import SimpleNamespace

    import torch

    from avatar_cli.families.base import RollingState
    from avatar_cli.stages.publish import PublishHere
    from avatar_cli.stages.sr import FrameSR, SRPlan, load_models

    cpu = torch.device("cpu")
    plan = SRPlan(sr_dir, 2, (16, 16), (32, 32))
    models = load_models(plan, cpu, torch.float32)
    first = FrameSR(models, plan, cpu, torch.float32)
    assert len(first.push(torch.rand(20, 3, 16, 16) * 2 - 1)) == 0 and first.held == 20
    state = RollingState(published=0)
    first.keep(state)

    class Sink:
        got = []

        def put(self, frames):
            self.got.append(frames)

    stage = SimpleNamespace(needs=(), family=SimpleNamespace(decode_feeds_back=False))
    out = PublishHere(stage, Sink(), (32, 32), FrameSR(models, plan, cpu, torch.float32))
    [stretch] = out.finish(state)
    assert (stretch.start, stretch.end, stretch.resumable) == (0, 20, False) and state.published == 20
    assert sum(len(f) for f in Sink.got) == 20 and Sink.got[0].shape[1:] == (32, 32, 3)


def test_a_render_placed_from_memory_keeps_sr_s_working_set_free(wan_job: Path, sr_dir: Path):
    """Where placement chooses from free memory (the CPU stands in for a GPU here), the working set kept free
    holds SR's carried state and its chunk's peak (beside the other peaks, which do not coexist with it) as `avatar
    plan` counts them (sr/swiftvr/budget.py) on the rank that runs it."""
    from avatar_cli.job import resolve
    from avatar_cli.render import setup as render_setup
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.runtime.distributed import Dist
    from avatar_cli.runtime.rings import RingStore
    from avatar_cli.sr.swiftvr.budget import sr_budget
    from avatar_cli.spec import load_job
    import torch

    class StandIn:  # a ModelCache whose placement chooses from memory
        transfer = object()

    runtime = Runtime(torch.device("cpu"), torch.float32)
    counted = {}
    for sr in (None, sr_dir):
        p = resolve(load_job(wan_job / "job.yaml", [f"sr.model={sr}"] if sr else []), force=True)
        counted[sr] = render_setup.working_bytes(p, runtime, Dist(), StandIn(), RingStore())
    budget = sr_budget(sr_dir, p.sr.lq, 2, torch.float32)
    # At this size SR's chunk outgrows the DiT's and the decode's peaks: more than its state is added.
    assert counted[None] is not None and counted[sr_dir] - counted[None] > budget.state > 0


def test_auto_decodes_inline_where_its_worker_cannot_hold_sr_beside_the_dit(wan_job: Path, sr_dir: Path):
    """auto's decode worker (what CUDA resolves for the streaming mode) holds SR whole on rank 0's GPU. Where that
    does not fit the free memory and inline does (SR placed with the other models, its blocks streamed under
    block offload), the render decodes inline and says why; where it fits, or the worker was asked for, it stays."""
    from dataclasses import replace

    import torch

    from avatar_cli.job import resolve
    from avatar_cli.render.setup import ModelCache, Opened, fit_decode
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.runtime.distributed import Dist
    from avatar_cli.runtime.job_budget import job_budget, place_rank0
    from avatar_cli.spec import Decode, load_job
    from avatar_cli.sr.swiftvr.budget import sr_budget

    p = resolve(load_job(wan_job / "job.yaml", ["mode=streaming", f"sr.model={sr_dir}"]), force=True)
    auto = replace(p, decode=Decode.worker, decode_why="auto: CUDA, and the family's decode does not feed back")
    runtime = Runtime(torch.device("cpu"), torch.float32)
    job = Opened(runtime, Dist(), p.frames)
    sr = sr_budget(sr_dir, p.sr.lq, p.sr.scale, torch.float32)
    b = job_budget(p.job, p.model, p.gen_size, torch.float32)
    family, rt = p.model.family, p.job.spec.runtime
    models = {n: b.models[n] for n in family.components}

    def need(decode: str, free: int) -> int:
        sizes = models | dict(sr.models) if decode == "inline" else models
        return place_rank0(b, family, rt, p.parallel.value, 1, decode, sizes, free, None, sr).gpu_bytes

    frees = [int(need("worker", 1 << 40) * f) for f in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)]
    tight = [f for f in frees if need("worker", f) > f and need("inline", f) <= f]
    assert tight, [(f, need("worker", f), need("inline", f)) for f in frees]
    inline = fit_decode(auto, job, ModelCache(transfer=object(), free_bytes=tight[0]))
    assert inline.decode == Decode.inline and "whole" in inline.decode_why and inline.sr == p.sr
    roomy = ModelCache(transfer=object(), free_bytes=need("worker", 1 << 40))
    assert fit_decode(auto, job, roomy).decode == Decode.worker
    asked = resolve(load_job(wan_job / "job.yaml", ["mode=streaming", f"sr.model={sr_dir}", "runtime.decode=worker"]),
                    force=True)
    assert fit_decode(asked, job, ModelCache(transfer=object(), free_bytes=tight[0])) is asked
