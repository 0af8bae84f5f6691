"""runtime.decode=thread (stages/publish.py PublishThread, runtime/device.py CoreShare): the same frames as inline,
an interrupted render resumes to the same digest, an error in the thread comes back as inline's, and the loop's
thread count follows the decode thread's work."""

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from avatar_cli import render as rendering
from avatar_cli.errors import InputError, RenderError
from avatar_cli.families.mini.family import MiniFamily
from avatar_cli.families.wan_s2v.family import WanS2VFamily
from avatar_cli.job import resolve
from avatar_cli.pipeline import checkpoint as ckpt
from avatar_cli.report import QuietReporter
from avatar_cli.runtime.device import CoreShare, Runtime
from avatar_cli.spec import load_job
from avatar_cli.stages import decode_worker as dw
from tests.conftest import write_wav
from tests.test_decode_worker import DiskFullAt2  # its decode fails as a full disk would, at stretch 2


class Notes(QuietReporter):
    """Records notes; with `stop_when_resumable` (the partial output), interrupts the render (as Ctrl-C does) at
    the first chunk after which a resume point is on disk."""

    def __init__(self, stop_when_resumable: Path | None = None):
        super().__init__(0)
        self.notes: list[str] = []
        self.partial = stop_when_resumable

    def info(self, message: str) -> None:
        self.notes.append(message)

    def chunk(self, published: int = 0, **_) -> None:
        if self.partial is None:
            return
        saved = ckpt.load_checkpoint(self.partial)
        if saved is not None and ckpt.resumable(self.partial, saved, 25):
            raise KeyboardInterrupt


def render(job: Path, reporter: Notes, *overrides: str, resume: str = "never") -> dict:
    # Two torch threads, so the loop's count has a thread to lend (the test session may run on one).
    return rendering.render(resolve(load_job(job, ["runtime.threads=2", *overrides]), force=resume == "never"),
                            reporter, resume=resume)


@pytest.fixture
def long_job(job_dir: Path) -> Path:
    write_wav(job_dir / "speech.wav", 4.0)  # 100 frames
    return job_dir / "job.yaml"


def test_thread_frames_equal_inline_and_an_interrupted_render_resumes_to_the_same_digest(long_job: Path):
    inline = render(long_job, Notes(), "runtime.decode=inline", f"output={long_job.parent / 'inline.mp4'}")

    partial = long_job.parent / "out" / "video.partial.mp4"
    notes = Notes(stop_when_resumable=partial)
    with pytest.raises((KeyboardInterrupt, RenderError)):
        render(long_job, notes, "runtime.decode=thread")
    assert "decode: thread (asked for)" in notes.notes
    assert not any(t.name == "avatar-decode" for t in threading.enumerate())  # the abort stopped the thread
    assert ckpt.load_checkpoint(partial).points

    again = Notes()
    resumed = render(long_job, again, "runtime.decode=thread", resume="strict")
    assert 0 < resumed["resumed_at"] < resumed["frames"], again.notes
    assert resumed["frames_digest"] == inline["frames_digest"]
    assert not any("differ from the interrupted render" in n for n in again.notes)
    # the thread's own seconds: the super-resolution and the decode both ran there
    assert resumed["compute_s"]["sr"] > 0 and resumed["compute_s"]["decode"] > 0
    assert "decode_wait" in resumed["compute_s"]
    assert torch.get_num_threads() == 2  # the loop's count back whole after the render

    whole = render(long_job, Notes(), "runtime.decode=thread", f"output={long_job.parent / 'thread.mp4'}")
    assert whole["frames_digest"] == inline["frames_digest"]


def test_an_error_in_the_thread_comes_back_as_inline_s(job_dir: Path):
    write_wav(job_dir / "speech.wav", 2.0)
    errors = []
    for mode in ("inline", "thread"):
        DiskFullAt2.calls = 0
        p = resolve(load_job(job_dir / "job.yaml", ["runtime.threads=2", f"runtime.decode={mode}"]), force=True)
        p.model.__dict__["family"] = DiskFullAt2(p.model.config)
        with pytest.raises(BaseException) as err:
            rendering.render(p, Notes())
        errors.append((type(err.value), str(err.value)))
    assert errors[0] == errors[1] and "No space left on device" in errors[1][1], errors
    assert not any(t.name == "avatar-decode" for t in threading.enumerate())


def test_a_decode_that_feeds_back_refuses_the_thread():
    clip = WanS2VFamily.__new__(WanS2VFamily)
    with pytest.raises(InputError, match="runtime.decode: thread: the wan-s2v family .* feeds back"):
        dw.check_setting("thread", clip)
    mini = MiniFamily.__new__(MiniFamily)
    dw.check_setting("thread", mini)
    cpu = Runtime(torch.device("cpu"), torch.float32)
    assert dw.choose("thread", mini, cpu) == ("thread", "asked for")
    # auto: the thread on a CPU of 2 to 4 threads in bf16 (measured to pay at 2), inline on one thread or many, and
    # in float32 (no gain measured, and the loop's float32 kernels round by thread count)
    bf16 = Runtime(torch.device("cpu"), torch.bfloat16)
    assert [dw.choose("auto", mini, bf16, n)[0] for n in (1, 2, 4, 5, 64)] == ["inline", "thread", "thread",
                                                                               "inline", "inline"]
    assert dw.choose("auto", mini, cpu, 2)[0] == "inline" and "float32" in dw.choose("auto", mini, cpu, 2)[1]
    assert dw.choose("auto", clip, bf16, 2)[0] == "inline"  # a decode that feeds back stays with the DiT


def test_core_share_lends_a_thread_while_the_helper_works_and_takes_it_back_at_the_next_block():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
        model[1][0].register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
        cores = CoreShare(2, [model])
        cores.open()
        helper = []

        def work() -> None:
            cores.helper_thread()
            cores.sync()  # another thread's sync changes nothing
            helper.append(torch.get_num_threads())
            cores.returned()

        cores.lend()
        assert torch.get_num_threads() == 1  # the loop: one fewer while the helper works
        model(torch.zeros(1, 4))
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert helper == [1] and torch.get_num_threads() == 1  # not changed until the loop's next block
        model(torch.zeros(1, 4))
        assert seen == [1, 2]  # the block after the helper finished ran on both threads
        cores.lend()
        cores.close()
        model(torch.zeros(1, 4))
        assert torch.get_num_threads() == 2 and seen == [1, 2, 2]
        assert not model[0]._forward_pre_hooks and not model._forward_pre_hooks  # the hooks are gone
    finally:
        torch.set_num_threads(before)


def test_frame_super_resolution_keeps_the_decode_inline(job_dir: Path, swiftvr_dir: Path):
    """The thread has no frame SR after its decode: a job with sr.model that asks for it decodes inline, and
    says why."""
    p = resolve(load_job(job_dir / "job.yaml", ["runtime.decode=thread", f"sr.model={swiftvr_dir}"]), force=True)
    assert p.decode.value == "inline" and "super-resolution" in p.decode_why
    assert resolve(load_job(job_dir / "job.yaml", ["runtime.decode=thread"]), force=True).decode.value == "thread"


def test_auto_resolves_to_the_thread_for_a_bf16_file_render_on_two_cpu_threads(job_dir: Path):
    p = resolve(load_job(job_dir / "job.yaml", ["runtime.threads=2", "runtime.dtype=bfloat16"]), force=True)
    assert p.decode.value == "thread" and "2 threads in bf16" in p.decode_why
    for other in (["runtime.threads=1", "runtime.dtype=bfloat16"], ["runtime.threads=2", "runtime.dtype=float32"]):
        assert resolve(load_job(job_dir / "job.yaml", other), force=True).decode.value == "inline"
