"""Shared fixtures: a tiny model directory of the real architecture, and small generated inputs."""

import os
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest

from avatar_cli.media.image import save_png
from avatar_cli.families.mini.model_dir import init_model_dir
from tests import forkserver


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


@pytest.fixture(autouse=True, scope="session")
def _fork_server():
    yield
    forkserver.close_server()


def avatar(*args: str, timeout: float = 300, cwd: Path | None = None, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    """`python -m avatar_cli ARGS`, run to its end, output captured as text: a process forked from the test
    process's fork server (tests/forkserver.py), which has torch and avatar_cli imported already."""
    return forkserver.run(list(args), timeout=timeout, cwd=cwd, env=env)


def start_avatar(*args: str, **kwargs) -> forkserver.ForkedCli:
    """`python -m avatar_cli ARGS` started and left running (stdout/stderr pipes, as subprocess.Popen's)."""
    return forkserver.ForkedCli(list(args), **kwargs)


def torchrun(*args: str, timeout: float = 300, cwd: Path | None = None, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run ARGS`, the launcher forked as `avatar` is (its workers are fresh
    interpreters, started by torchrun's agent)."""
    return forkserver.run(list(args), timeout=timeout, cwd=cwd, env=env, entry="torch.distributed.run:main")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "tiny"
    init_model_dir(directory, "tiny", seed=0)
    return directory


def write_job(folder: Path, model: Path) -> Path:
    """ref.png, speech.wav (2.3 s) and job.yaml using `model`, in folder.

    I chunks on, as a GPU's `auto` has them, so the tests on this CPU run the whole schedule."""
    write_reference(folder / "ref.png")
    write_wav(folder / "speech.wav", 2.3)
    (folder / "job.yaml").write_text(
        "reference: ref.png\naudio: speech.wav\noutput: out/video.mp4\n"
        f"model: {model}\nseed: 3\nchunking:\n  frames: 16\n  motion_frames: 3\n  transitions: true\n"
        "  transition_frames: 4\n")
    return folder


@pytest.fixture
def job_dir(tmp_path: Path, tiny_model: Path) -> Path:
    """A folder with the tiny model's job (write_job)."""
    return write_job(tmp_path, tiny_model)
