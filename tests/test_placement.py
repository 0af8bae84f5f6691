"""Offload inside a whole render, with the CPU standing in for the GPU (HostTransfer): the stages bring each
model in and drop it, and the video is the same bytes as without offload."""

import logging
from pathlib import Path

import pytest

from avatar_cli import render as rendering
from avatar_cli.job import resolve
from avatar_cli.pipeline.run import Pipeline
from avatar_cli.report import QuietReporter
from avatar_cli.runtime.offload import HostTransfer
from avatar_cli.runtime.rings import RingStore
from avatar_cli.spec import load_job
from tests.conftest import write_job, write_wav

GIB = 2**30


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_model: Path) -> Path:
    """One job for the module's renders (each writes its own output): 1 s of audio, two N chunks and an I chunk,
    so every stage runs and the DiT runs more than once; what offload does is the same at any length."""
    folder = write_job(tmp_path_factory.mktemp("placement"), tiny_model)
    write_wav(folder / "speech.wav", 1.0)
    return folder


@pytest.fixture(scope="module")
def plain(job_dir: Path) -> dict:
    """The render without offload, that each offloaded one must equal."""
    return render(job_dir, "plain", "none", None)[0]


def render(job_dir: Path, name: str, offload: str, transfer: HostTransfer | None, free_bytes: int | None = None
           ) -> tuple[dict, rendering.ModelCache]:
    # The shipped model: its DiT has enough blocks that streaming them holds less than the whole DiT.
    # No text cache: the text encoder is placed too, and its prompt would be cached after the first render.
    job = load_job(job_dir / "job.yaml", ["model=mini", f"runtime.offload={offload}", "runtime.dtype=float32",
                                          "runtime.text_cache=off"], output=str(job_dir / f"{name}.mp4"))
    cache = rendering.ModelCache(transfer=transfer, free_bytes=free_bytes)
    summary = rendering.render(resolve(job), QuietReporter(0), models=cache)
    return summary, cache


@pytest.mark.parametrize("offload", ["model", "block"])
def test_offloaded_render_equals_resident_and_leaves_nothing_on_the_device(job_dir: Path, plain: dict, offload: str):
    t = HostTransfer()
    off, cache = render(job_dir, offload, offload, t, free_bytes=GIB)
    assert off["frames_digest"] == plain["frames_digest"]  # 0xFF (NaN) device memory would show if a copy were missed
    (_, placement), = cache.loaded.values()
    assert placement.offload == offload and set(placement.offloaders) == {"vae", "dit", "sr", "audio", "text"}
    assert t.live_bytes == 0  # every stage dropped its model when it ended
    assert not any(t.is_device(p) for m in ("dit", "vae") for p in placement.offloaders[m].params())
    # One stage runs at a time, with the next one's copy on its way: never more than the two largest bounds.
    assert 0 < t.peak_bytes <= sum(sorted(o.bound_bytes for o in placement.offloaders.values())[-2:])
    if offload == "block":
        dit_bytes = sum(p.nbytes for p in placement.offloaders["dit"].params())
        assert placement.offloaders["dit"].bound_bytes < 0.6 * dit_bytes  # the DiT is never on the device whole
        # Per model (their copies interleave: the next stage's starts during this one), blocks load in
        # order after each "root" load, wrapping to 0 for the next denoising step.
        per_model: dict[str, list[str]] = {}
        for label in t.loads:
            name, what = label.split(": ")
            per_model.setdefault(name, []).append(what)
        for name, seq in per_model.items():
            if seq[0] == "model":  # no blocks (VAE, audio encoder): whole
                continue
            for run in filter(str.strip, " ".join(seq).split("root")):
                idx = [int(i) for i in run.split()[1::2]]
                assert idx[0] == 0 and all(b in (a + 1, 0) for a, b in zip(idx, idx[1:])), (name, idx)
        assert per_model["dit"].count("root") >= 2 and "block 3" in per_model["dit"]
    else:
        assert {label.split(": ")[1] for label in t.loads} == {"model"}


def test_auto_chooses_from_free_memory_and_logs(job_dir: Path, caplog):
    with caplog.at_level(logging.INFO, logger="avatar_cli.runtime"):
        _, roomy = render(job_dir, "roomy", "auto", HostTransfer(), free_bytes=64 * GIB)
        _, tight = render(job_dir, "tight", "auto", HostTransfer(), free_bytes=1)
    assert [next(iter(c.loaded.values()))[1].offload for c in (roomy, tight)] == ["none", "block"]
    assert "auto chose none" in caplog.text and "auto chose block" in caplog.text


def test_the_model_cache_places_each_ring_store_as_asked(job_dir: Path):
    """Where the rings live is part of the placement and of the model cache's key: a job asking for its rings
    elsewhere gets a placement of its own (its models loaded and placed for it), and the Pipeline hands that
    placement's rings to the denoising stage. The same ask reuses the placement."""
    job = load_job(job_dir / "job.yaml", ["model=mini", "runtime.dtype=float32", "runtime.text_cache=off"],
                   output=str(job_dir / "rings.mp4"))
    p = resolve(job)
    runtime, dist = rendering.setup_runtime(job.spec)
    cache = rendering.ModelCache()

    def get(rings: RingStore | None = None):
        more = {} if rings is None else {"rings": rings}
        return cache.get(p.model, runtime, dist, job.spec.runtime, QuietReporter(0), **more)

    modules, device = get()
    assert device.rings == RingStore() and get(RingStore())[1] is device
    host_modules, host = get(RingStore("host"))
    assert host is not device and host.rings == RingStore("host") and host_modules["dit"] is not modules["dit"]
    assert [key[-1] for key in cache.loaded] == [RingStore("host")]  # one model set resident at a time
    assert Pipeline(host_modules, p.model.family, runtime, host).steps.rings == RingStore("host")
