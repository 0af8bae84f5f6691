"""Frame super-resolution in the publish path (stages/sr.py): sizes, every frame out, resume, live, bad input.

The SR model is the test double of tests/toy_sr.py (SwiftVR's interface and chunking), installed by `toy`."""

import json
from pathlib import Path

import av
import numpy as np
import pytest

from tests import toy_sr
from tests.conftest import avatar, write_wav

FRAMES = 58  # round(2.3 s * 25 fps): the job of tests/conftest.write_job


@pytest.fixture
def toy(monkeypatch):
    toy_sr.install(monkeypatch)


@pytest.fixture(scope="session")
def sr_dir(tmp_path_factory) -> Path:
    return toy_sr.init_tiny(tmp_path_factory.mktemp("sr") / "swiftvr", seed=0)


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def frames_of(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])  # (T, H, W, 3)


def render(job_dir: Path, *args: str):
    return avatar("render", str(job_dir / "job.yaml"), "--json", *args)


def test_a_render_with_sr_is_at_the_scaled_size_with_every_frame(job_dir: Path, sr_dir: Path, toy):
    out = job_dir / "sr.mp4"
    result = render(job_dir, f"sr.model={sr_dir}", "-o", str(out))
    assert result.returncode == 0, result.stderr
    done = events(result.stdout)[-1]
    assert done["frames"] == FRAMES
    video = frames_of(out)
    assert video.shape == (FRAMES, 128, 128, 3)  # the tiny mini's 64 x 64, x2
    # The frames are the plain render's, upscaled: the SR double is near the identity.
    plain = job_dir / "plain.mp4"
    assert render(job_dir, "-o", str(plain)).returncode == 0
    small = frames_of(plain).astype(np.float32)
    down = video.astype(np.float32).reshape(FRAMES, 64, 2, 64, 2, 3).mean(axis=(2, 4))
    assert np.abs(down - small).mean() < 12
