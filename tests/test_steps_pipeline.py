"""The timestep pipeline (runtime.parallel: steps, pipeline/steps.py): the choice of the way ranks split the work,
and a 2-clip tiny wan-s2v streaming render with a 2-step schedule on 3 gloo ranks (a decode rank and one per step)
whose frames equal one process's; a pipeline render killed mid-way resumes in one process, bit-identically; and one
batch on 2 ranks of two jobs that differ only in runtime.parallel, each placed as its spec says. The 3-rank job has
frame super-resolution (sr.model, a tiny SwiftVR), which runs on the decode rank alone."""

import io
import json
import signal
from pathlib import Path

import pytest

from avatar_cli.families.mini.family import MiniFamily
from avatar_cli.families.wan_s2v.live import LiveAvatarFamily
from avatar_cli.families.registry import init_family_dir
from avatar_cli.pipeline.steps import choose_parallel, rank_skips
from tests.conftest import avatar, avatar_process, start_avatar, write_reference, write_wav

REPO = Path(__file__).resolve().parent.parent
SECONDS = 5.8  # round(5.8 x 16) = 93 frames = 9 + 7 x 12: 8 blocks, two of their clips, across the block-4 refresh
SR_SIZE = 128  # the job's 64 x 64 frames, x2 by its frame super-resolution


def live() -> LiveAvatarFamily:
    return LiveAvatarFamily(None)


# --- choosing --------------------------------------------------------------------------------------------------

def test_auto_picks_the_timestep_pipeline_when_ranks_are_steps_plus_one():
    how, why = choose_parallel("auto", live(), 4, 5)
    assert how == "steps" and "4 denoising steps + a decode rank" in why
    how, why = choose_parallel("auto", live(), 4, 2)
    assert how == "sequence" and "2 ranks, not 4 steps + 1" in why
    assert choose_parallel("auto", live(), 4, 1)[0] == "single"
    how, why = choose_parallel("auto", MiniFamily(None), 4, 5)
    assert how == "sequence" and "no timestep pipeline" in why


def test_steps_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="no timestep pipeline"):
        choose_parallel("steps", MiniFamily(None), 4, 5)
    with pytest.raises(ValueError, match=r"4 denoising steps need 5 ranks .* not 3: launch with --nproc 5"):
        choose_parallel("steps", live(), 4, 3)


def test_each_rank_loads_only_what_its_role_runs(job: Path):
    from avatar_cli.families.registry import resolve_model, with_mode
    from avatar_cli.job import resolve
    from avatar_cli.render.setup import runs_sr
    from avatar_cli.spec import load_job

    f = with_mode(resolve_model(str(job.parent / "tiny"), job.parent), "streaming").family
    assert rank_skips(f, 0) == {"text", "audio", "dit"}  # the decode rank: the VAE alone
    assert rank_skips(f, 1) == rank_skips(f, 4) == set()  # a step rank encodes the reference with the VAE too
    # Frame super-resolution: loaded by the rank that writes the frames alone, the decode rank under the pipeline
    for world, how, loads in ((3, "steps", [True, False, False]), (2, "sequence", [True, False])):
        p = resolve(load_job(job, [f"runtime.parallel={how}"], str(job.parent / "out" / "plan.mp4")), force=True,
                    world_size=world)
        assert p.parallel.value == how and p.size == (SR_SIZE, SR_SIZE)
        assert [runs_sr(p, rank) for rank in range(world)] == loads


def test_steps_on_a_family_without_it_is_exit_2(job_dir: Path):
    res = avatar("validate", str(job_dir / "job.yaml"), "runtime.parallel=steps", cwd=REPO)
    assert res.returncode == 2
    assert "runtime.parallel: steps: the mini family's 'clip' mode has no timestep pipeline" in res.stderr
    assert "Traceback" not in res.stderr


# --- 3 gloo ranks, 2 steps -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def job(tmp_path_factory, swiftvr_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("steps")
    init_family_dir(folder / "tiny", "tiny", seed=0, family="wan-s2v")
    write_reference(folder / "ref.png")
    write_wav(folder / "speech.wav", SECONDS)
    # One thread per rank, as the one-process render: kernels that split reductions by thread count would otherwise
    # round differently (the ranks share this host's cores).
    (folder / "job.yaml").write_text(
        "reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\nmodel: tiny\nmode: streaming\n"
        "prompt: a person talking\nseed: 5\nvideo: {width: 64, height: 64, crf: 0}\nsampling: {steps: 2}\n"
        "runtime: {dtype: float32, text_cache: 'off', threads: 1}\n"
        f"sr: {{model: {swiftvr_dir}, scale: 2}}\n")
    return folder / "job.yaml"


def render_here(job: Path, output: Path, resume: str = "never") -> dict:
    from avatar_cli.report import JsonReporter
    from avatar_cli.job import resolve
    from avatar_cli.render import render
    from avatar_cli.spec import load_job

    return render(resolve(load_job(job, [], str(output)), force=True), JsonReporter(io.StringIO()), resume=resume)


@pytest.fixture(scope="module")
def one_rank(job: Path) -> dict:
    return render_here(job, job.parent / "out" / "one.mp4")


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_three_ranks_two_steps_equal_one_process(job: Path, one_rank: dict):
    res = avatar_process("render", str(job), "--nproc", "3", "--json", "-o", str(job.parent / "out" / "tpp.mp4"),
                         cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    done = events(res.stdout)[-1]
    assert one_rank["frames"] == done["frames"] == 93
    assert done["ranks"] == 3
    assert done["frames_digest"] == one_rank["frames_digest"]  # super-resolved on the decode rank as in one process
    assert decoded(job.parent / "out" / "tpp.mp4").shape == (93, SR_SIZE, SR_SIZE, 3)
    # auto chose it (3 ranks = 2 steps + 1) and said why, once.
    assert res.stderr.count("parallel: steps (auto: 3 ranks = 2 denoising steps + a decode rank") == 1


@pytest.mark.slow
def test_killed_pipeline_render_resumes_in_one_process(job: Path, one_rank: dict):
    """The decode rank's checkpoint holds every step's ring (sent by the step ranks after each block) and its frame
    SR's stream: the same state as one process's, so a pipeline render killed mid-way continues in one process with
    the same frames."""
    from safetensors.torch import load_file

    from avatar_cli.pipeline.checkpoint import load_checkpoint

    out = job.parent / "out" / "killed.mp4"
    proc = start_avatar("render", str(job), "--nproc", "3", "--json", "-o", str(out), "runtime.parallel=steps",
                        cwd=REPO)
    try:
        chunks = (e for line in proc.stdout for e in events(line) if e["event"] == "chunk")
        for _ in range(6):  # blocks 0-5 published: past the sink refresh of block 4
            next(chunks)
        proc.send_signal(signal.SIGTERM)  # the launcher stops its workers, which keep their checkpoint
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert not out.exists() and out.with_name("killed.partial.mp4").exists()
    points = load_checkpoint(out.with_name("killed.partial.mp4")).points
    assert any(len(load_file(str(out.parent / pt.state_file))["sr.pending"]) for pt in points)  # SR held frames
    resumed = render_here(job, out, resume="strict")
    assert resumed["resumed_at"] > 0
    assert resumed["frames_digest"] == one_rank["frames_digest"]


def decoded(path: Path):
    import av
    import numpy as np

    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(int)


@pytest.fixture(scope="module")
def one_step_jobs(job: Path) -> tuple[Path, Path]:
    """Two jobs that differ only in runtime.parallel (and where they write). One denoising step: 2 ranks are then
    one step rank and a decode rank for the timestep pipeline, or a degree-2 split of every forward (2 heads)."""
    write_wav(job.parent / "two_seconds.wav", 2.0)  # 32 frames: 3 blocks, enough to place and to compare
    text = (job.read_text().replace("sampling: {steps: 2}", "sampling: {steps: 1}")
            .replace("audio: speech.wav", "audio: two_seconds.wav"))
    text = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("sr:"))  # no frame SR
    paths = []
    for how in ("steps", "sequence"):
        path = job.parent / f"one_step_{how}.yaml"
        path.write_text(text.replace("output: out/video.mp4", f"output: out/one_step_{how}.mp4")
                        .replace("threads: 1}", f"threads: 1, parallel: {how}}}"))
        paths.append(path)
    return paths[0], paths[1]


@pytest.mark.slow
def test_a_batch_of_jobs_differing_only_in_parallel_places_each_as_its_spec_says(one_step_jobs):
    """One batch on 2 ranks: the timestep pipeline (rank 1 the decode rank, loading only what decoding needs), then
    sequence parallel (every rank holding the whole DiT, each block's forward split over heads, the caches
    head-sharded and gathered on rank 0 for its resume points). Had the second job reused the first's load and
    placement, rank 1 would have no DiT to run. Each equals one process's render of the same job: the pipeline
    bit for bit; sequence parallel sums in another order, so the lossless video's values may differ by a level or
    two in a few places, never more."""
    steps_job, sequence_job = one_step_jobs
    res = avatar_process("render", str(steps_job), str(sequence_job), "--nproc", "2", "--json", cwd=REPO,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    done = [e for e in events(res.stdout) if e["event"] == "done"]
    assert [(d["ranks"], d["parallel"]) for d in done] == [(2, "steps"), (2, "sequence")]
    assert res.stderr.count("parallel: steps (asked for; 2 ranks = 1 denoising steps + a decode rank)") == 1
    assert res.stderr.count("parallel: sequence (asked for)") == 1
    one = render_here(steps_job, steps_job.parent / "out" / "one_step_one.mp4")
    assert done[0]["frames"] == done[1]["frames"] == one["frames"] == 32
    assert done[0]["frames_digest"] == one["frames_digest"]
    a, b = decoded(steps_job.parent / "out" / "one_step_sequence.mp4"), decoded(steps_job.parent / "out" / "one_step_one.mp4")
    assert a.shape == b.shape == (32, 64, 64, 3)
    diff = abs(a - b)
    assert diff.max() <= 4 and (diff > 0).mean() < 1e-3


def live_here(job: Path, wav: Path, output: Path) -> dict:
    """A live session in this process, its audio written into a FIFO by a thread (as stdin would bring it)."""
    import os
    import threading

    fifo = wav.with_suffix(".fifo")
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "wb") as f:
            f.write(wav.read_bytes())

    threading.Thread(target=feed, daemon=True).start()
    res = avatar("render", str(job), f"audio={fifo}", "-o", str(output), "--json", cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    return [e for e in events(res.stdout) if e["event"] == "done"][0]


@pytest.mark.slow
def test_three_ranks_run_a_live_session_one_process_runs(job: Path, tmp_path: Path):
    """A live session under the timestep pipeline: rank 0 reads stdin, plans as the audio arrives and sends each
    block's audio to the step ranks, which run ahead of it; its frames, super-resolved on rank 0 after its decode,
    are one process's, bit for bit. 3.5 s: 5 blocks, so block 4 takes the sink frame the last step's rank rolled;
    1.5 s: 2 blocks, the plan ends before any block takes it (the frame sent is taken and dropped at the end), and
    before SR's first chunk (its frames all come out at the end)."""
    import subprocess
    import sys

    from tests.conftest import write_wav

    for seconds in (3.5, 1.5):
        wav = write_wav(tmp_path / f"speech_{seconds}.wav", seconds)
        one = live_here(job, wav, tmp_path / f"live_{seconds}_1.mp4")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
                               "-m", "avatar_cli", "render", str(job), "audio=-", "-o",
                               str(tmp_path / f"live_{seconds}_3.mp4"), "--json", "runtime.parallel=auto"],
                              input=wav.read_bytes(), capture_output=True, timeout=600, cwd=REPO)
        err = proc.stderr.decode()
        assert proc.returncode == 0, err[-3000:]
        done = [e for e in events(proc.stdout.decode() + err) if e["event"] == "done"][0]
        assert done["frames"] == one["frames"] == round(seconds * 16)
        assert "parallel: steps (auto: 3 ranks = 2 denoising steps + a decode rank" in err
        assert done["frames_digest"] == one["frames_digest"]
        assert decoded(tmp_path / f"live_{seconds}_3.mp4").shape == (done["frames"], SR_SIZE, SR_SIZE, 3)
