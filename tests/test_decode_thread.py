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
from tests.conftest import write_reference, write_wav
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
    # auto: the thread on a CPU of 2 to 4 threads (measured to pay at 2), inline on one thread or many; in float32
    # only for a family whose bits do not follow the thread count
    bf16 = Runtime(torch.device("cpu"), torch.bfloat16)
    for runtime in (bf16, cpu):
        assert [dw.choose("auto", mini, runtime, n)[0] for n in (1, 2, 4, 5, 64)] == ["inline", "thread", "thread",
                                                                                      "inline", "inline"]
    variant_family = type("Variant", (MiniFamily,), {"thread_count_invariant": False})
    variant = variant_family.__new__(variant_family)
    assert dw.choose("auto", variant, bf16, 2)[0] == "thread"
    assert dw.choose("auto", variant, cpu, 2)[0] == "inline" and "float32" in dw.choose("auto", variant, cpu, 2)[1]
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


def test_auto_resolves_to_the_thread_for_a_file_render_on_two_cpu_threads(job_dir: Path):
    for dtype in ("bfloat16", "float32"):
        p = resolve(load_job(job_dir / "job.yaml", ["runtime.threads=2", f"runtime.dtype={dtype}"]), force=True)
        assert p.decode.value == "thread" and f"2 threads in {dtype}" in p.decode_why
        one = resolve(load_job(job_dir / "job.yaml", ["runtime.threads=1", f"runtime.dtype={dtype}"]), force=True)
        assert one.decode.value == "inline"


def test_float32_frames_are_the_same_on_one_thread_two_and_with_the_decode_thread(tmp_path: Path):
    """The decode thread borrows one of the loop's two threads while it works, so a chunk's DiT may run on either
    count. The shipped model (trained: its modulation is not zero, as a random init's is), 1.2 s: a last chunk of
    6 frames and 4 motion frames, 10 rows, where a float32 GEMM's sum order follows the thread count unless the
    family pads them (mini: layers.per_row); a prompt of 5 words, the same for the text encoder."""
    write_reference(tmp_path / "ref.png")
    write_wav(tmp_path / "speech.wav", 1.2)
    (tmp_path / "job.yaml").write_text("reference: ref.png\naudio: speech.wav\noutput: out.mp4\nmodel: mini\n"
                                       "prompt: smiling calm lively talking person\n")
    digests = {}
    for threads, mode in ((1, "inline"), (2, "inline"), (2, "thread")):
        done = render(tmp_path / "job.yaml", Notes(), "runtime.dtype=float32", "runtime.text_cache=off",
                      f"runtime.threads={threads}", f"runtime.decode={mode}",
                      f"output={tmp_path / f'{threads}{mode}.mp4'}")
        digests[threads, mode] = done["frames_digest"]
    assert len(set(digests.values())) == 1, digests
