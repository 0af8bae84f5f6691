"""runtime.decode=worker (stages/decode_worker.py): the same frames as inline, a killed worker stops the render and
a rerun resumes to the same digest, an error inside the worker comes back named, no worker outlives its render."""

import errno
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from avatar_cli import render as rendering

from avatar_cli.job import resolve

from avatar_cli.errors import InputError, RenderError
from avatar_cli.families.mini.family import MiniFamily
from avatar_cli.families.wan_s2v.family import WanS2VFamily
from avatar_cli.families.wan_s2v.live import LiveAvatarFamily
from avatar_cli.pipeline import checkpoint as ckpt
from avatar_cli.stages import decode_worker as dw
from avatar_cli.report import QuietReporter
from avatar_cli.runtime.device import Runtime
from avatar_cli.spec import load_job
from tests.conftest import start_avatar, write_wav

CPU = Runtime(torch.device("cpu"), torch.float32)


class Notes(QuietReporter):
    """Records notes; with `kill_when_resumable` (the partial output), SIGKILLs the decode worker after the first chunk
    at which a rerun could continue (a resume point whose frames the worker's encoder has flushed to disk), and
    counts the stretches the render hands over after that (`handed_after_kill`: chunks that published frames)."""

    def __init__(self, kill_when_resumable: Path | None = None):
        super().__init__(0)
        self.notes: list[str] = []
        self.partial, self.killed, self.published, self.handed_after_kill = kill_when_resumable, False, 0, 0

    def info(self, message: str) -> None:
        self.notes.append(message)

    @property
    def worker_pid(self) -> int:
        return int(next(re.search(r"pid (\d+)", n)[1] for n in self.notes if n.startswith("decode: worker")))

    def chunk(self, published: int = 0, **_) -> None:
        if self.killed and published > self.published:
            self.handed_after_kill += 1
        self.published = published
        if self.partial is None or self.killed:
            return
        saved = ckpt.load_checkpoint(self.partial)
        if saved is not None and ckpt.resumable(self.partial, saved, 25):
            os.kill(self.worker_pid, signal.SIGKILL)
            self.killed = True


def render(job: Path, reporter: Notes, *overrides: str, resume: str = "never") -> dict:
    return rendering.render(resolve(load_job(job, list(overrides)), force=resume == "never"), reporter,
                         resume=resume)


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_slots_keep_values_dtypes_and_memory_layouts():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "z": torch.randn(5, 4, 6, 6, generator=g).contiguous(memory_format=torch.channels_last),  # (T, C, h, w)
        "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "permuted": torch.randn(2, 3, 4, generator=g).permute(2, 0, 1),  # dense, not contiguous
        "strided": torch.randn(4, 8, generator=g)[:, ::2],  # not dense: sent contiguous
    }
    buf = dw._shared_buffer(dw._nbytes(tensors))
    back = dw.unpack(buf, dw.pack(buf, tensors))
    for name, t in tensors.items():
        assert torch.equal(back[name], t) and back[name].dtype == t.dtype, name
    assert back["z"].stride() == tensors["z"].stride() and back["permuted"].stride() == tensors["permuted"].stride()
    assert back["strided"].is_contiguous()


def test_choice_and_the_spec_error():
    cuda = Runtime(torch.device("cuda", 0), torch.bfloat16)
    mini, clip, live = MiniFamily.__new__(MiniFamily), WanS2VFamily.__new__(WanS2VFamily), \
        LiveAvatarFamily.__new__(LiveAvatarFamily)
    assert dw.choose("auto", mini, CPU)[0] == "inline"  # never the worker on a CPU: measured slower (bench/results.md)
    assert "worker" not in {dw.choose("auto", mini, CPU, n)[0] for n in (1, 2, 8)}
    assert dw.choose("auto", mini, cuda)[0] == dw.choose("auto", live, cuda)[0] == "worker"
    assert dw.choose("auto", clip, cuda)[0] == "inline"  # its next clip's motion latents are decoded frames
    assert dw.choose("worker", mini, CPU) == ("worker", "asked for")
    dw.check_setting("worker", live)
    with pytest.raises(InputError, match="runtime.decode: worker: the wan-s2v family .* feeds back"):
        dw.check_setting("worker", clip)
    assert [live.is_decode_state(k) for k in ("vae.enc0", "kv.ring0", "sink_frame")] == [True, False, False]
    assert mini.is_decode_state("decode_cache") and not mini.is_decode_state("tail")


@pytest.fixture
def long_job(job_dir: Path) -> Path:
    write_wav(job_dir / "speech.wav", 4.0)  # 100 frames, 4 keyframes
    return job_dir / "job.yaml"


def test_worker_frames_equal_inline_and_a_killed_worker_resumes_to_the_same_digest(long_job: Path):
    inline = render(long_job, Notes(), "runtime.decode=inline", f"output={long_job.parent / 'inline.mp4'}")

    partial = long_job.parent / "out" / "video.partial.mp4"
    notes = Notes(kill_when_resumable=partial)
    with pytest.raises(RenderError) as err:
        render(long_job, notes, "runtime.decode=worker")
    assert re.match(r"the decode worker \(pid \d+\) died \(killed by SIGKILL\) while rendering; the partial file "
                    "and its checkpoint are kept", str(err.value)), str(err.value)
    # It stops at the first hand-over that has to wait on the dead worker: at most the queue's depth more.
    assert 0 < notes.handed_after_kill <= dw.DEPTH, notes.handed_after_kill
    kept = ckpt.load_checkpoint(partial)
    assert kept.points and all((partial.parent / pt.state_file).is_file() for pt in kept.points)

    again = Notes()
    resumed = render(long_job, again, "runtime.decode=worker", resume="strict")
    assert 0 < resumed["resumed_at"] < resumed["frames"], again.notes  # killed mid-render, resumed from there
    # The stretches the killed worker wrote (their digests are in the checkpoint's chain) and the ones the new
    # worker made, all equal to the inline render's.
    assert resumed["frames_digest"] == inline["frames_digest"]
    assert not any("differ from the interrupted render" in n for n in again.notes)
    assert gone(notes.worker_pid) and gone(again.worker_pid)
    assert resumed["compute_s"]["decode"] > 0 and "decode_wait" in resumed["compute_s"]


class DiskFullAt2(MiniFamily):
    """The worker's decode fails as a full disk would, at the second stretch."""

    calls = 0

    def decode(self, models, final, state, put):
        DiskFullAt2.calls += 1
        if DiskFullAt2.calls == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/out/video.partial.mp4")
        return super().decode(models, final, state, put)


def test_an_error_inside_the_worker_comes_back_named(job_dir: Path):
    write_wav(job_dir / "speech.wav", 1.0)
    p = resolve(load_job(job_dir / "job.yaml", ["runtime.decode=worker"]), force=True)
    p.model.__dict__["family"] = DiskFullAt2(p.model.config)  # what the worker process unpickles, too
    notes = Notes()
    with pytest.raises(RenderError, match=r"^decode worker: OSError: \[Errno 28\] No space left on device"):
        rendering.render(p, notes)
    assert gone(notes.worker_pid)


def test_a_killed_render_takes_its_worker_with_it(job_dir: Path):
    write_wav(job_dir / "long.wav", 10.0)
    proc = start_avatar("render", str(job_dir / "job.yaml"), f"audio={job_dir / 'long.wav'}", "runtime.decode=worker",
                        "--json")
    try:
        pid = None
        for line in proc.stderr:
            if m := re.match(r"decode: worker \(asked for\), pid (\d+)", line):
                pid = int(m[1])
                break
        assert pid is not None, "no decode worker started"
        saved = ckpt.paths(job_dir / "out" / "video.partial.mp4")[0]
        for line in proc.stdout:  # until the worker has written and acknowledged a stretch
            if json.loads(line)["event"] == "chunk" and saved.exists():
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    deadline = time.monotonic() + 60  # a guard against a worker that never goes, not a speed bound
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid), "the decode worker outlived its render"
    partial = job_dir / "out" / "video.partial.mp4"
    size = partial.stat().st_size
    time.sleep(0.5)
    assert partial.stat().st_size == size  # nothing more written


def test_a_spilled_snapshot_is_the_state_on_disk_and_leaves_nothing(tmp_path: Path):
    tensors = {"ring": torch.randn(3, 5, 7).to(torch.bfloat16), "count": torch.arange(11),
               "cache": torch.randn(2, 9, dtype=torch.float64), "empty": torch.zeros(0, 4)}
    out = dw.spill(tensors, tmp_path)
    assert list(out) == list(tensors)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v)
        assert v.numel() == 0 or out[k].data_ptr() != v.data_ptr()  # a copy: the render goes on changing its own
    assert list(tmp_path.iterdir()) == []  # the file's name is gone once mapped


@pytest.mark.parametrize("spilled", [False, True])
def test_only_scheduled_stretches_keep_a_snapshot_and_get_resume_points(long_job: Path, monkeypatch, spilled):
    """With resume points allowed after every third block only (pipeline/checkpoint.py resume_schedule, as for a big
    rolling state), the worker's render keeps no snapshot for the other stretches and writes its points only after
    the scheduled blocks; its frames are the inline render's. spilled: the snapshots wait on disk (as a big one
    does), and the points are written from there."""
    inline = render(long_job, Notes(), "runtime.decode=inline", f"output={long_job.parent / 'inline.mp4'}")
    if spilled:
        monkeypatch.setattr(dw, "SPILL_BYTES", 0)
    monkeypatch.setattr(ckpt, "resume_schedule", lambda state_bytes: lambda block: (block + 1) % 3 == 0)
    snapshots: list[tuple[int, int]] = []  # (block, tensors kept) per stretch handed over
    submit = dw.DecodeWorker.submit

    def counting(self, final, next_chunk, state):
        done = submit(self, final, next_chunk, state)
        snapshots.append((next_chunk - 1, len(self._sent[-1].tensors)))
        return done

    monkeypatch.setattr(dw.DecodeWorker, "submit", counting)
    partial = long_job.parent / "out" / "video.partial.mp4"
    points: set[int] = set()

    class Points(Notes):
        def chunk(self, **_) -> None:
            saved = ckpt.load_checkpoint(partial)
            points.update(pt.next_chunk for pt in (saved.points if saved else []))

    done = render(long_job, Points(), "runtime.decode=worker")
    assert done["frames_digest"] == inline["frames_digest"]
    assert len(snapshots) > 6
    assert all((kept > 0) == ((block + 1) % 3 == 0) for block, kept in snapshots), snapshots
    assert points and all(n % 3 == 0 for n in points), points
