"""Batch reliability: resume after kill -9, signals, bulk runs, sharding, idempotent reruns, full disks."""

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import av
import numpy as np
import pytest

from avatar_cli.batch import expand_jobs, take_shard
from avatar_cli.media.writer import count_video_frames
from tests.conftest import avatar, fill, start_avatar, write_wav


def cli(*args: str) -> subprocess.CompletedProcess:
    return avatar(*args)


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def decoded(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(np.float32)


def start_render(*args: str) -> subprocess.Popen:
    """A render in a process of its own, for the tests that kill or signal it."""
    return start_avatar("render", *args, "--json")


def wait_chunks(proc: subprocess.Popen, n: int) -> None:
    seen = 0
    for line in proc.stdout:
        if json.loads(line)["event"] == "chunk":
            seen += 1
            if seen >= n:
                return
    raise AssertionError(f"render ended before {n} chunks: {proc.stderr.read()}")


def checkpoint_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if ".ckpt" in p.name]


def test_kill_9_then_resume_is_bit_identical(job_dir: Path, tmp_path: Path):
    write_wav(job_dir / "long.wav", 8.0)  # 25 chunks: any kill point below leaves some to resume
    job = str(job_dir / "job.yaml")
    full = cli("render", job, f"audio={job_dir / 'long.wav'}", "-o", str(tmp_path / "full.mp4"), "--json")
    assert full.returncode == 0, full.stderr
    reference = events(full.stdout)[-1]

    kill_at = random.Random().randint(8, 20)  # a random chunk, different every run (past the first fragment)
    out = job_dir / "out" / "video.mp4"
    proc = start_render(job, f"audio={job_dir / 'long.wav'}")
    try:
        wait_chunks(proc, kill_at)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert not out.exists() and checkpoint_files(out.parent), f"killed at chunk {kill_at}"

    resumed = cli("render", job, f"audio={job_dir / 'long.wav'}", "--resume", "--json")
    assert resumed.returncode == 0, f"killed at chunk {kill_at}: {resumed.stderr}"
    assert "differ from the interrupted render" not in resumed.stderr  # regenerated stretches matched
    done = events(resumed.stdout)[-1]
    assert done["resumed_at"] > 0, f"killed at chunk {kill_at}: resumed from scratch"
    # Every published stretch, before and after the kill, hashes the same as the uninterrupted render's.
    assert done["frames_digest"] == reference["frames_digest"], f"killed at chunk {kill_at}"
    a, b = decoded(tmp_path / "full.mp4"), decoded(out)
    assert a.shape == b.shape
    assert np.abs(a - b).mean() < 0.5, f"killed at chunk {kill_at}: mean abs diff {np.abs(a - b).mean():.3f}"
    assert not checkpoint_files(out.parent)  # a successful render removes its checkpoint
    assert not (out.parent / "video.resume-src.mp4").exists()


def test_resume_refuses_when_the_job_changed(job_dir: Path):
    write_wav(job_dir / "long.wav", 4.0)  # 13 chunks: killed after 3
    job = str(job_dir / "job.yaml")
    proc = start_render(job, f"audio={job_dir / 'long.wav'}")
    try:
        wait_chunks(proc, 3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    changed = cli("render", job, f"audio={job_dir / 'long.wav'}", "seed=99", "--resume", "--json")
    assert changed.returncode == 2
    assert "the job spec changed" in events(changed.stdout)[-1]["message"]
    write_wav(job_dir / "long.wav", 4.0, freq=330.0)  # same name, new content
    changed = cli("render", job, f"audio={job_dir / 'long.wav'}", "--resume", "--json")
    assert changed.returncode == 2 and "the audio changed" in events(changed.stdout)[-1]["message"]
    assert checkpoint_files(job_dir / "out")  # refusing loses nothing
    # Without --resume the user asked for this (changed) job: the stale render is dropped, with a note.
    fresh = cli("render", job, f"audio={job_dir / 'long.wav'}", "--json")
    assert fresh.returncode == 0 and "the audio changed since" in fresh.stderr
    assert events(fresh.stdout)[-1]["resumed_at"] == 0 and not checkpoint_files(job_dir / "out")


def test_resume_with_nothing_to_resume_renders_and_skips_what_is_done(job_dir: Path):
    """--resume over a batch (the restart line of a Slurm or Kubernetes job): new jobs render, done ones skip."""
    jobs = make_batch(job_dir, ["a", "b"])
    first = cli("render", str(jobs / "a.yaml"), "--resume", "--json")
    assert first.returncode == 0 and "nothing to resume" in first.stderr
    both = cli("render", str(jobs), "--resume", "--json")
    assert both.returncode == 0, both.stdout
    assert events(both.stdout)[-1] == {"event": "batch", "jobs": 2, "done": 1, "skipped": 1, "failed": 0,
                                       "interrupted": 0, "not_started": 0}
    assert any(e["event"] == "skipped" and e["job"].endswith("a.yaml") for e in events(both.stdout))
    # A shard (or folder, or glob) of one job is still a batch: the same events, whatever the share's size.
    one = cli("render", str(jobs), "--shard", "0/2", "--json")
    assert [e["event"] for e in events(one.stdout)] == ["skipped", "job", "batch"]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_leaves_partial_and_checkpoint(job_dir: Path, sig, code):
    write_wav(job_dir / "long.wav", 5.0)  # 15 chunks: signalled after 6
    proc = start_render(str(job_dir / "job.yaml"), f"audio={job_dir / 'long.wav'}")
    try:
        wait_chunks(proc, 6)
        proc.send_signal(sig)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert events(rest)[-1] == {"event": "error", "code": code, "message": events(rest)[-1]["message"]}
    out = job_dir / "out"
    assert not (out / "video.mp4").exists()
    with av.open(str(out / "video.partial.mp4")) as c:
        assert sum(1 for _ in c.decode(video=0)) >= 16
    assert (out / "video.partial.ckpt.json").is_file()
    assert "checkpoint were kept" in events(rest)[-1]["message"]
    # A plain rerun (what a restarted cron or Slurm job does) continues; it does not throw the work away.
    resumed = cli("render", str(job_dir / "job.yaml"), f"audio={job_dir / 'long.wav'}", "--json")
    assert resumed.returncode == 0 and events(resumed.stdout)[-1]["resumed_at"] > 0


@pytest.mark.parametrize("when", ["saving the first checkpoint", "after the first chunk"])
def test_stopped_before_a_checkpoint_a_rerun_can_use_leaves_nothing(job_dir: Path, monkeypatch, when):
    """Ctrl-C before there is a point to continue from: before the first checkpoint is saved, or after it
    but while the file holds no keyframe past it (the first fragment not yet on disk). Nothing stays."""
    from avatar_cli import render as rendering
    from avatar_cli.job import resolve
    from avatar_cli.pipeline import checkpoint
    from avatar_cli.spec import load_job

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    class StopAtFirstChunk(Recorder):
        chunk = interrupted

    if when == "saving the first checkpoint":
        monkeypatch.setattr(checkpoint.CheckpointWriter, "save", interrupted)
    job = load_job(job_dir / "job.yaml")
    with pytest.raises(KeyboardInterrupt) as stopped:
        rendering.render(resolve(job), StopAtFirstChunk() if when == "after the first chunk" else Recorder(),
                      resume="auto")
    assert stopped.value.kept_partial is False
    assert not job.output.exists() and os.listdir(job.output.parent) == []


def make_batch(job_dir: Path, names: list[str]) -> Path:
    jobs = job_dir / "jobs"
    jobs.mkdir()
    base = (job_dir / "job.yaml").read_text()
    for name in names:
        (jobs / f"{name}.yaml").write_text(base.replace("output: out/video.mp4", f"output: ../out/{name}.mp4")
                                           .replace("ref.png", "../ref.png").replace("speech.wav", "../speech.wav"))
    return jobs


def test_bulk_one_bad_job_does_not_sink_the_batch(job_dir: Path):
    jobs = make_batch(job_dir, ["a", "b", "c"])
    (jobs / "b.yaml").write_text((jobs / "b.yaml").read_text().replace("../speech.wav", "../missing.wav"))
    result = cli("render", str(jobs), "--json")
    assert result.returncode == 2  # only bad input failed
    evs = events(result.stdout)
    status = {Path(e["job"]).stem: e["status"] for e in evs if e["event"] == "job"}
    assert status == {"a": "done", "b": "failed", "c": "done"}
    bad = [e for e in evs if e["event"] == "job" and e["status"] == "failed"][0]
    assert "missing.wav" in bad["error"]
    assert evs[-1] == {"event": "batch", "jobs": 3, "done": 2, "skipped": 0, "failed": 1,
                      "interrupted": 0, "not_started": 0}
    assert (job_dir / "out" / "a.mp4").exists() and (job_dir / "out" / "c.mp4").exists()

    # --fail-fast stops at the bad job.
    shutil.rmtree(job_dir / "out")
    result = cli("render", str(jobs), "--json", "--fail-fast")
    assert result.returncode == 2
    assert [e["status"] for e in events(result.stdout) if e["event"] == "job"] == ["done", "failed", "not_started"]
    assert events(result.stdout)[-1]["jobs"] == 3  # every job of the list is accounted for


class Recorder:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, message: str) -> None:
        self.lines.append(message)

    def error(self, code: int, message: str) -> None:
        self.lines.append(f"error {code}: {message}")

    def done(self, summary: dict) -> None:
        self.lines.append("done")

    def start(self, **_) -> None:
        pass

    def chunk(self, **_) -> None:
        pass

    def skipped(self, job: str, output: str, reason: str) -> None:
        self.lines.append(f"skipped {job}")

    def batch(self, results: list) -> None:
        self.lines.append("batch: " + " ".join(r.status for r in results))


def test_an_interrupted_batch_still_reports_what_it_did(job_dir: Path, monkeypatch):
    from avatar_cli import render as rendering
    from avatar_cli.batch import run_batch

    jobs = make_batch(job_dir, ["a", "b", "c"])

    def fake_render(p, reporter, models, resume="never"):
        if p.job.path.stem == "b":
            raise KeyboardInterrupt
        return {"output": str(p.job.output)}

    monkeypatch.setattr(rendering, "render", fake_render)
    rec = Recorder()
    with pytest.raises(KeyboardInterrupt):
        run_batch(sorted(jobs.glob("*.yaml")), [], None, False, False, False, rec)
    assert rec.lines[-1] == "batch: done interrupted not_started"


def test_under_torchrun_a_failed_render_ends_the_batch_but_bad_input_does_not(job_dir: Path, monkeypatch):
    from avatar_cli import render as rendering
    from avatar_cli.batch import run_batch
    from avatar_cli.runtime import distributed

    jobs = make_batch(job_dir, ["a", "b", "c", "d"])
    (jobs / "a.yaml").write_text((jobs / "a.yaml").read_text().replace("../speech.wav", "../missing.wav"))
    rendered = []

    def fake_render(p, reporter, models, resume="never"):
        rendered.append(p.job.path.stem)
        if p.job.path.stem == "c":
            raise RuntimeError("gloo: connection closed by peer")
        return {"output": str(p.job.output)}

    monkeypatch.setattr(rendering, "render", fake_render)
    monkeypatch.setattr(distributed, "launched_by_torchrun", lambda: True)
    rec = Recorder()
    results = run_batch(sorted(jobs.glob("*.yaml")), [], None, False, False, False, rec)
    assert rendered == ["b", "c"]  # a: bad input, found before any collective; d: never started
    assert [r.status for r in results] == ["failed", "done", "failed", "not_started"]
    assert "batch stopped (a render failed under torchrun, so the ranks may be out of step): 1 job(s) not started" \
        in rec.lines

    monkeypatch.setattr(distributed, "launched_by_torchrun", lambda: False)  # one process: the batch goes on
    rendered.clear()
    assert [r.status for r in run_batch(sorted(jobs.glob("*.yaml")), [], None, False, False, False, rec)] == \
        ["failed", "done", "failed", "done"]


def test_rerun_skips_finished_jobs_and_force_redoes_them(job_dir: Path):
    jobs = make_batch(job_dir, ["a", "b"])
    assert cli("render", str(jobs), "--json").returncode == 0
    mtimes = {p.name: p.stat().st_mtime_ns for p in (job_dir / "out").glob("*.mp4")}
    again = cli("render", str(jobs / "*.yaml"), "--json")
    assert again.returncode == 0
    assert events(again.stdout)[-1] == {"event": "batch", "jobs": 2, "done": 0, "skipped": 2, "failed": 0,
                                         "interrupted": 0, "not_started": 0}
    assert {p.name: p.stat().st_mtime_ns for p in (job_dir / "out").glob("*.mp4")} == mtimes
    # A job whose spec changed is not "finished": without --force its old output is protected.
    (jobs / "a.yaml").write_text((jobs / "a.yaml").read_text() + "prompt: smiling\n")
    changed = cli("render", str(jobs), "--json")
    assert changed.returncode == 2 and "--force" in changed.stdout
    resumed = cli("render", str(jobs), "--json", "--resume")  # --resume is no licence to overwrite it either
    assert resumed.returncode == 2 and "--force" in resumed.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (job_dir / "out").glob("*.mp4")} == mtimes
    forced = cli("render", str(jobs), "--json", "--force")
    assert forced.returncode == 0
    assert events(forced.stdout)[-1]["done"] == 2


def test_shards_partition_the_batch(tmp_path: Path):
    for i in range(11):
        (tmp_path / f"job{i:02d}.yaml").write_text("")
    jobs = expand_jobs([str(tmp_path)])
    for n in (1, 2, 3, 4, 11, 13):
        parts = [take_shard(jobs, (i, n)) for i in range(n)]
        flat = [j for part in parts for j in part]
        assert sorted(flat) == sorted(jobs) and len(flat) == len(set(flat)), n
    # The same list from a glob, as another host would give it, shards the same way.
    assert take_shard(expand_jobs([str(tmp_path / "*.yaml")]), (1, 3)) == take_shard(jobs, (1, 3))


def test_bad_shard_argument(job_dir: Path):
    result = cli("render", str(job_dir / "job.yaml"), "--shard", "3/3", "--json")
    assert result.returncode == 2 and "--shard" in result.stdout


def test_disk_full_mid_render_loses_nothing(job_dir: Path, small_disk: Path):
    write_wav(job_dir / "long.wav", 8.0)  # 25 chunks: the disk fills after 8
    out = small_disk / "video.mp4"
    proc = start_render(str(job_dir / "job.yaml"), f"audio={job_dir / 'long.wav'}", "-o", str(out))
    try:
        wait_chunks(proc, 8)
        fill(small_disk)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, rest + err
    message = events(rest)[-1]["message"]
    assert "disk full" in message, message
    assert not out.exists()
    assert "checkpoint are kept" in message, message
    (small_disk / "filler").unlink()  # space again: what was kept must be intact and resumable
    # The write that hit the full disk may have torn the last fragment; everything before it decodes.
    assert count_video_frames(small_disk / "video.partial.mp4") >= 25
    json.loads((small_disk / "video.partial.ckpt.json").read_text())  # intact, not half-written
    resumed = cli("render", str(job_dir / "job.yaml"), f"audio={job_dir / 'long.wav'}", "-o", str(out), "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert events(resumed.stdout)[-1]["resumed_at"] > 0


def test_disk_too_small_is_refused_before_starting(job_dir: Path, small_disk: Path):
    write_wav(job_dir / "long.wav", 3600.0, rate=8000)
    result = cli("render", str(job_dir / "job.yaml"), f"audio={job_dir / 'long.wav'}", "-o",
                 str(small_disk / "video.mp4"), "--json")
    assert result.returncode == 2
    assert "not enough disk space" in events(result.stdout)[-1]["message"]
    assert os.listdir(small_disk) == []


def test_jobs_sharing_a_model_load_it_once(job_dir: Path, monkeypatch):
    from typer.testing import CliRunner



    from avatar_cli.render import setup as render_setup
    from avatar_cli.cli import app

    jobs = make_batch(job_dir, ["a", "b", "c"])
    calls = []
    real = render_setup.load_modules
    monkeypatch.setattr(render_setup, "load_modules", lambda source, **kw: calls.append(source.name) or real(source, **kw))
    result = CliRunner().invoke(app, ["render", str(jobs), "--json"])
    assert result.exit_code == 0, result.output
    assert len(calls) == 1
    assert len(list((job_dir / "out").glob("*.mp4"))) == 3


def test_render_checkpoints_get_the_mode_open_gives(tmp_path: Path):
    """A shared render folder: the checkpoint's state files are as readable as the partial MP4 beside them."""
    import torch

    from avatar_cli.pipeline import checkpoint
    from avatar_cli.families.base import RollingState

    partial = tmp_path / "video.partial.mp4"
    partial.write_bytes(b"")
    old = os.umask(0o022)
    try:
        writer = checkpoint.CheckpointWriter(partial, checkpoint.Checkpoint({}, 10, 0))
        writer.save(1, RollingState(tensors={"tail": torch.zeros(2)}, held=[], published=4))
    finally:
        os.umask(old)
    state_files = list(tmp_path.glob("*.safetensors"))
    assert len(state_files) == 1 and state_files[0].stat().st_mode & 0o777 == 0o644


def test_render_checkpoint_does_not_grow_with_the_video(tmp_path: Path):
    """Hours of video: the checkpoint keeps the stretches its resume points need and folds the rest into
    the chain digest, so its JSON (rewritten every stretch) and its memory stay bounded, and the digest is
    the one the whole list would give."""
    import json

    import torch

    from avatar_cli.families.base import RollingState
    from avatar_cli.pipeline import checkpoint

    partial = tmp_path / "video.partial.mp4"
    partial.write_bytes(b"")
    ckpt = checkpoint.Checkpoint({}, 10**6, 0)
    writer = checkpoint.CheckpointWriter(partial, ckpt)
    every, sizes = [], []
    for i in range(300):
        stretch = [24 * i, 24 * (i + 1), f"{i:064x}"]
        every.append(stretch)
        writer.add_stretch(*stretch)
        writer.save(i + 1, RollingState(tensors={"tail": torch.zeros(2)}, published=24 * (i + 1)))
        sizes.append(len(checkpoint.paths(partial)[0].read_text()))
    assert len(ckpt.stretches) <= checkpoint.RING and ckpt.folded == 300 - len(ckpt.stretches)
    assert sizes[-1] - sizes[100] < 100  # only wider numbers: a growing list would add ~90 bytes a stretch
    assert ckpt.frames_digest == checkpoint.chain_digest(every)
    # What a rerun reads back continues the same chain.
    found = checkpoint.load_checkpoint(partial)
    assert found.frames_digest == ckpt.frames_digest
    point = found.points[0]
    assert found.since(point.digests) == every[point.digests:]
    assert json.loads(checkpoint.paths(partial)[0].read_text())["folded"] == ckpt.folded


def test_expensive_resume_points_are_paced_and_big_ones_are_not_kept_eight_deep(tmp_path: Path, monkeypatch):
    """Resume points that take long to write (LiveAvatar's ~46 GB state at full size) are written only while
    they take <= BUDGET of the render's time; cheap ones after every stretch; big ones are kept 2 deep."""
    import torch

    from avatar_cli.families.base import RollingState
    from avatar_cli.pipeline import checkpoint

    def simulate(save_s: float, state_floats: int) -> tuple[checkpoint.CheckpointWriter, list[int], float]:
        now = [0.0]
        partial = tmp_path / f"{save_s}-{state_floats}" / "video.partial.mp4"
        partial.parent.mkdir()
        partial.write_bytes(b"")
        writer = checkpoint.CheckpointWriter(partial, checkpoint.Checkpoint({}, 10**6, 0), clock=lambda: now[0])
        real = writer._save

        def slow(*args):
            real(*args)
            now[0] += save_s

        writer._save = slow
        saved = []
        for i in range(200):
            now[0] += 0.5  # a stretch rendered
            writer.add_stretch(24 * i, 24 * (i + 1), f"{i:064x}")
            if writer.due():
                writer.save(i + 1, RollingState(tensors={"rings": torch.zeros(state_floats)}, published=24 * (i + 1)))
                saved.append(i)
        return writer, saved, now[0]

    writer, saved, total = simulate(0.01, 16)  # cheap: every stretch, 8 points kept
    assert len(saved) == 200 and len(writer.ckpt.points) == checkpoint.RING
    writer, saved, total = simulate(2.0, 16)  # 2 s a point, 0.5 s a stretch: ~1 point in 45 stretches
    assert saved[0] == 0 and 3 <= len(saved) <= 8, saved
    assert writer.spent <= checkpoint.BUDGET * total + 2.0  # over the budget by at most the last point
    assert len(writer.ckpt.points) == len(saved)  # fewer than RING: all kept
    monkeypatch.setattr(checkpoint, "KEEP_BYTES", 3000)
    writer, saved, _ = simulate(0.01, 256)  # 1 KiB a point: only the newest 2 fit with the rest
    points = writer.ckpt.points
    assert len(points) == 2 and [p.next_chunk for p in points] == [199, 200]
    assert sorted(f.name for f in writer.partial.parent.glob("*.safetensors")) == sorted(p.state_file for p in points)


def test_a_render_whose_resume_points_are_slow_writes_fewer_and_still_finishes(job_dir: Path, monkeypatch):
    from avatar_cli import render as rendering
    from avatar_cli.job import resolve
    from avatar_cli.pipeline import checkpoint
    from avatar_cli.spec import load_job

    written, real = [], checkpoint.CheckpointWriter._save

    def slow(self, next_chunk, state):
        real(self, next_chunk, state)
        written.append(next_chunk)
        time.sleep(0.3)

    monkeypatch.setattr(checkpoint.CheckpointWriter, "_save", slow)
    job = load_job(job_dir / "job.yaml")
    stretches = []
    monkeypatch.setattr(checkpoint.CheckpointWriter, "add_stretch",
                        lambda self, *a: (stretches.append(a), self.ckpt.stretches.append(list(a))))
    rendering.render(resolve(job), Recorder(), resume="auto")
    assert job.output.exists() and len(stretches) >= 4
    assert written[:1] == [1] and len(written) < len(stretches), (written, len(stretches))


def test_terminal_messages_keep_brackets(capsys):
    """Rich reads '[take]' as markup: a path with brackets must reach the terminal as it is."""
    from avatar_cli.batch import JobResult
    from avatar_cli.report import RichReporter

    rich = RichReporter()
    rich.error(2, "audio: /x/clips[take]/a.wav: not found")
    rich.info("note: [bold] stays")
    rich.batch([JobResult("jobs/[a].yaml", "failed", 1.0, 2, "expected one of [auto, cpu]")])
    out = capsys.readouterr()
    assert "/x/clips[take]/a.wav" in out.err and "[bold] stays" in out.err
    assert "[a].yaml" in out.out and "[auto, cpu]" in out.out.replace("\n", "")


def test_a_second_render_of_the_same_output_is_refused_while_the_first_runs(job_dir: Path):
    """Overlapping cron runs or a Slurm requeue: the second must not move the first's partial file away."""
    from avatar_cli.pipeline.checkpoint import OutputLock

    partial = job_dir / "out" / "video.partial.mp4"
    partial.parent.mkdir(parents=True, exist_ok=True)
    first = OutputLock(partial)
    assert first.acquire() is None
    try:
        assert f"pid {os.getpid()}" in OutputLock(partial).acquire()
        second = cli("render", str(job_dir / "job.yaml"), "--json")
        assert second.returncode == 2
        assert "another avatar process" in events(second.stdout)[-1]["message"]
        assert not (job_dir / "out" / "video.mp4").exists()
    finally:
        first.release()
    assert not first.path.exists()  # no lock file left behind
    again = cli("render", str(job_dir / "job.yaml"), "--json")
    assert again.returncode == 0, again.stderr
    assert sorted(os.listdir(job_dir / "out")) == ["video.mp4"]


@pytest.mark.parametrize("outcome", [0, 2])
def test_once_the_outcome_is_decided_a_signal_no_longer_changes_the_exit_code(outcome, monkeypatch):
    """A Slurm SIGTERM while the interpreter winds down after `done` must not fail a finished job: in the
    process's own entry (main), _run leaves SIGINT/SIGTERM ignored."""
    import typer

    from avatar_cli import cli as cli_module
    from avatar_cli.errors import InputError

    def action(reporter):
        if outcome:
            raise InputError("bad")
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)  # live while working
        return 0

    monkeypatch.setattr(cli_module, "_process_ends_after_run", True)  # as main() sets it
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            cli_module._run(action, True, False)
        except typer.Exit as e:
            assert e.exit_code == outcome
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@pytest.mark.parametrize("outcome", ["valid", "bad input", "usage error"])
def test_the_cli_run_in_process_leaves_the_signal_handlers_as_it_found_them(job_dir: Path, outcome):
    """Called in-process (Typer's CliRunner, a program that runs the app), a command hands SIGINT and SIGTERM
    back as they were, whatever its outcome: Ctrl-C still stops the caller afterwards."""
    from typer.testing import CliRunner

    from avatar_cli.cli import app

    if outcome == "bad input":
        (job_dir / "ref.png").unlink()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    args = ["validate", str(job_dir / "job.yaml"), "--json"] + (["--bogus"] if outcome == "usage error" else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == {"valid": 0, "bad input": 2, "usage error": 2}[outcome], result.output
    assert {s: signal.getsignal(s) for s in before} == before
    assert cli("validate", str(job_dir / "job.yaml"), "--json").returncode == (2 if outcome == "bad input" else 0)
    assert {s: signal.getsignal(s) for s in before} == before


def test_failure_messages_are_one_line_and_a_lost_peer_is_said_in_words():
    from avatar_cli.errors import failure_message

    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
                        "[127.0.0.1]:41234: Connection reset by peer")
    assert failure_message(gloo) == "render failed: lost the connection to another rank (it stopped or was killed)"
    assert failure_message(ValueError("bad\nsecond line")) == "render failed: ValueError: bad"


@pytest.mark.parametrize("args", [["render", "--bogus"], ["render"], ["render", "job.yaml", "--nproc", "abc"]])
def test_usage_errors_are_one_line_and_json_when_asked(args):
    result = cli(*args, "--json")
    assert result.returncode == 2
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["event"] == "error"
    assert "render --help" in json.loads(lines[0])["message"]
    assert len(result.stderr.strip().splitlines()) == 1 and "Usage" not in result.stderr


def test_other_ranks_leave_the_interrupt_message_to_rank_0(capsys):
    from avatar_cli.report import QuietReporter

    QuietReporter(1).error(130, "interrupted")
    QuietReporter(1).error(1, "render failed: boom")
    assert capsys.readouterr().err == "error (rank 1): render failed: boom\n"


def test_an_interrupted_checkpoint_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch):
    from avatar_cli.files import atomic_write

    target = tmp_path / "video.partial.ckpt.json"
    target.write_text("old")

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, b"new")  # how pipeline/checkpoint.py writes its record
    assert os.listdir(tmp_path) == ["video.partial.ckpt.json"] and target.read_text() == "old"


def test_a_live_session_checks_its_outputs_once_and_runs_alone(job_dir: Path, monkeypatch):
    import avatar_cli.job

    playlist = job_dir / "hls" / "live.m3u8"
    playlist.parent.mkdir()
    playlist.write_text("#EXTM3U\n")
    calls = []
    check_live = avatar_cli.job.check_live
    monkeypatch.setattr(avatar_cli.job, "check_live", lambda job, force: (calls.append(force), check_live(job, force)))
    r = cli("render", str(job_dir / "job.yaml"), "-o", str(playlist))
    assert r.returncode == 2 and "already exists; pass --force" in r.stderr
    assert calls == [False]  # with --force as given, once
    assert playlist.read_text() == "#EXTM3U\n"
    both = cli("render", str(job_dir / "job.yaml"), str(job_dir / "job.yaml"), f"output={playlist}")
    assert both.returncode == 2 and "runs alone, not in a batch" in both.stderr
