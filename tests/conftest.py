"""Shared fixtures: a tiny model directory of the real architecture, and small generated inputs."""

import contextlib
import os
import signal
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from avatar_cli.cli import _app
from avatar_cli.media.image import save_png
from avatar_cli.families.mini.model_dir import init_model_dir


def write_wav(path: Path, seconds: float, rate: int = 16_000, channels: int = 1, freq: float = 220.0) -> Path:
    """A tone whose loudness pulses 3 times a second, like syllables."""
    t = np.arange(int(round(seconds * rate))) / rate
    x = 0.3 * np.sin(2 * np.pi * freq * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))  # (n,)
    data = np.repeat(x[:, None], channels, axis=1)  # (n, channels)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((data * 32767).astype("<i2").tobytes())
    return path


def write_reference(path: Path, width: int = 120, height: int = 160) -> Path:
    img = np.zeros((height, width, 3), np.uint8)
    img[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None]
    img[height // 4: 3 * height // 4, width // 4: 3 * width // 4] = 255
    save_png(path, img)
    return path


@pytest.fixture(autouse=True, scope="session")
def _private_cache_folder(tmp_path_factory) -> None:
    """The text-encoding cache defaults to the user's cache folder: tests (and the renders they start) get a
    folder of their own instead, so they neither read nor leave entries there."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))


@pytest.fixture(autouse=True)
def _process_state_kept():
    """The CLI runs in the test process (avatar below): each test must leave the working folder and the SIGINT and
    SIGTERM handlers as it found them, and gets torch's thread count back (a job's runtime.threads sets it for the
    process, as a batch's next job sets its own)."""
    import torch

    cwd, threads = os.getcwd(), torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    torch.set_num_threads(threads)
    assert os.getcwd() == cwd, f"the test left the working folder at {os.getcwd()}"
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "the test left SIGINT/SIGTERM handlers changed"


@contextlib.contextmanager
def _working_folder(cwd: Path | None):
    before = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(before)


def avatar(*args: str, cwd: Path | None = None, env: dict[str, str | None] | None = None
           ) -> subprocess.CompletedProcess:
    """`avatar ARGS` run to its end in this process: Typer's CliRunner captures its stdout and stderr (and sets
    env's variables, None unsets one, for the run), cwd is the working folder meanwhile, and cli._app is what the
    `avatar` command runs, so usage errors and exit codes are a user's. The result reads as subprocess.run's.

    For a test about processes (signals, kill -9, torchrun, the entry point), start_avatar, avatar_process or
    torchrun start a fresh interpreter instead."""
    with _working_folder(cwd), CliRunner().isolation(env=env) as (out, err, _):
        code = _app(list(args))
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode("utf-8", "backslashreplace")
    return subprocess.CompletedProcess(["avatar", *args], code, stdout, stderr)


def start_avatar(*args: str, cwd: Path | None = None, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """`python -m avatar_cli ARGS` started in a fresh interpreter and left running (text pipes by default)."""
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.Popen([sys.executable, "-m", "avatar_cli", *args], text=True, cwd=cwd, env=env, **kwargs)


def avatar_process(*args: str, timeout: float = 300, cwd: Path | None = None, env: dict | None = None
                   ) -> subprocess.CompletedProcess:
    """`python -m avatar_cli ARGS` in a fresh interpreter, run to its end, output captured as text: for the
    tests about processes (`--nproc` launches torchrun's agent and its workers)."""
    return subprocess.run([sys.executable, "-m", "avatar_cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def torchrun(*args: str, timeout: float = 300, cwd: Path | None = None, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run ARGS` (a fresh interpreter, as are the workers its agent starts)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "tiny"
    init_model_dir(directory, "tiny", seed=0)
    return directory


@pytest.fixture(scope="session")
def swiftvr_official_dir(tmp_path_factory) -> Path:
    """The SwiftVR goldens' tiny release (tests/golden/swiftvr): transformer and prompt as the official code wrote
    them, the ReAE from the goldens' seeded rule."""
    from tests.golden.swiftvr_weights import write_release

    return write_release(tmp_path_factory.mktemp("swiftvr_official") / "release")


@pytest.fixture(scope="session")
def swiftvr_dir(tmp_path_factory) -> Path:
    """A tiny SwiftVR release of random weights in the official layout (`sr.model`)."""
    from avatar_cli.sr.swiftvr.model_dir import init_tiny

    directory = tmp_path_factory.mktemp("sr") / "swiftvr"
    init_tiny(directory, seed=0)
    return directory


def write_job(folder: Path, model: Path) -> Path:
    """ref.png, speech.wav (2.3 s) and job.yaml using `model`, in folder.

    I chunks on, as a GPU's `auto` has them, so the tests on this CPU run the whole schedule; a live session of it
    chunks as its render does (live.chunk_frames), so its frames are the render's."""
    write_reference(folder / "ref.png")
    write_wav(folder / "speech.wav", 2.3)
    (folder / "job.yaml").write_text(
        "reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\n"
        f"model: {model}\nseed: 3\nchunking:\n  frames: 16\n  motion_frames: 3\n  transitions: true\n"
        "  transition_frames: 4\nlive:\n  chunk_frames: 16\n")
    return folder


@pytest.fixture
def job_dir(tmp_path: Path, tiny_model: Path) -> Path:
    """A folder with the tiny model's job (write_job)."""
    return write_job(tmp_path, tiny_model)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 6 MB tmpfs, for the tests of a disk that fills up mid-render."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> None:
    """Another process fills the disk: write until there is no space left (the render may have filled it first:
    then even creating the file fails)."""
    try:
        with open(disk / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    except OSError:
        pass
