"""End to end through the real CLI: render, decode the MP4, check streams; interrupt; JSON events."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from avatar_cli.runtime.device import auto_dtype
from tests.conftest import avatar, write_wav

FPS = 25


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return avatar(*args, cwd=cwd)


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def probe(path: Path) -> dict:
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        info = {
            "codec": v.codec_context.name, "pix_fmt": v.codec_context.pix_fmt, "size": (v.width, v.height),
            "audio_codec": a.codec_context.name,
        }
        vpts, keys, apts, a_end = [], [], [], 0.0
        for packet in c.demux(v, a):
            if packet.pts is None:
                continue
            t = float(packet.pts * packet.time_base)
            if packet.stream.type == "video":
                vpts.append(t)
                if packet.is_keyframe:
                    keys.append(t)
            else:
                apts.append(t)
                a_end = max(a_end, t + float(packet.duration * packet.time_base))
        info.update(video_start=min(vpts), video_end=max(vpts) + 1 / FPS, audio_start=min(apts), audio_end=a_end,
                    keyframes=keys)
    with av.open(str(path)) as c:
        info["frames"] = sum(1 for _ in c.decode(video=0))
    return info


def test_render_end_to_end(job_dir: Path):
    """The entry point in a fresh interpreter (the other run-to-end tests call the CLI in-process)."""
    out = job_dir / "out" / "video.mp4"
    result = subprocess.run([sys.executable, "-m", "avatar_cli", "render", str(job_dir / "job.yaml"), "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    evs = events(result.stdout)
    assert [e["event"] for e in evs][-1] == "done" and all(e["event"] == "chunk" for e in evs[:-1])

    total = 58  # round(2.3 s * 25 fps)
    chunks = [e for e in evs if e["event"] == "chunk"]
    assert [f"{e['kind']}{e['index']}" for e in chunks] == ["N0", "N1", "I0", "N2", "I1", "N3", "I2"]
    kept = sorted(f for e in chunks for f in range(e["start"], e["end"]))
    assert kept == list(range(total))  # every output frame is covered by exactly one chunk's kept frames

    done = evs[-1]
    assert done["frames"] == total and done["output"] == str(out)
    assert done["duration_s"] == pytest.approx(total / FPS)
    assert done["rtf"] > 0 and done["render_fps"] > 0 and done["ttff_s"] > 0 and done["peak_rss_mb"] > 0
    assert not (job_dir / "out" / "video.partial.mp4").exists()
    # dtype auto: the choice, why, and the CPU level it was made on are reported (log line and done event)
    expected, _ = auto_dtype("cpu")
    assert done["dtype"] == str(expected).removeprefix("torch.") and done["dtype_reason"].startswith("auto: ")
    assert done["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert f"dtype: {done['dtype']} (auto: " in result.stderr

    info = probe(out)
    assert info["frames"] == total
    assert (info["codec"], info["pix_fmt"], info["audio_codec"]) == ("h264", "yuv420p", "aac")
    assert info["size"] == (64, 64)  # the tiny model's native size
    assert info["video_start"] == 0.0 and abs(info["audio_start"]) < 1e-6
    assert abs(info["video_end"] - total / FPS) < 1e-6
    assert abs(info["audio_end"] - info["video_end"]) <= 1 / FPS
    assert info["keyframes"] == [0.0, 1.0, 2.0]  # one keyframe per second

    # What the other tests rely on: the CLI run in this process (tests/conftest.avatar) makes what a fresh
    # interpreter makes.
    in_process = run_cli("render", str(job_dir / "job.yaml"), "-o", str(job_dir / "in_process.mp4"), "--json")
    assert in_process.returncode == 0, in_process.stderr
    assert events(in_process.stdout)[-1]["frames_digest"] == done["frames_digest"]


def test_output_size_and_fps_overrides(job_dir: Path, tmp_path: Path):
    out = tmp_path / "o.mp4"
    result = run_cli("render", str(job_dir / "job.yaml"), "video.fps=30", "video.width=96", "video.height=54",
                     "chunking.transitions=auto", "-o", str(out), "--json")
    assert result.returncode == 0, result.stderr
    # auto on a CPU: no I chunks, said in the log and the done event
    assert [e["kind"] for e in events(result.stdout)[:-1]] == ["N"] * 5
    assert events(result.stdout)[-1]["transitions"] is False
    assert "transitions: off (auto: off on a CPU" in result.stderr
    with av.open(str(out)) as c:
        v = c.streams.video[0]
        assert (v.width, v.height) == (96, 54)
        assert sum(1 for _ in c.decode(video=0)) == 69  # round(2.3 * 30)


def test_same_seed_same_video_other_seed_differs(job_dir: Path, tmp_path: Path):
    def frames(out: Path, *extra: str) -> np.ndarray:
        assert run_cli("render", str(job_dir / "job.yaml"), "-o", str(out), "--json", *extra).returncode == 0
        with av.open(str(out)) as c:
            return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])

    # The trained model: the tiny random one's DiT starts with a zero output layer (adaLN-Zero), so in float32
    # every seed lands on the same frames (it predicts the same clean frame whatever the noise).
    short = f"audio={write_wav(tmp_path / 'short.wav', 1.0)}"  # 25 frames: two chunks
    a = frames(tmp_path / "a.mp4", "model=mini", short)
    b = frames(tmp_path / "b.mp4", "model=mini", short)
    c = frames(tmp_path / "c.mp4", "model=mini", short, "seed=4")
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_interrupted_render_leaves_playable_partial(job_dir: Path):
    write_wav(job_dir / "long.wav", 40.0)
    out = job_dir / "out" / "video.mp4"
    proc = subprocess.Popen([sys.executable, "-m", "avatar_cli", "render", str(job_dir / "job.yaml"),
                             "audio=" + str(job_dir / "long.wav"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = 0
        for line in proc.stdout:  # wait until a few chunks are published
            if json.loads(line)["event"] == "chunk":
                seen += 1
            if seen == 8:
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert events(rest)[-1]["event"] == "error" and events(rest)[-1]["code"] == 130
    assert not out.exists()
    partial = job_dir / "out" / "video.partial.mp4"
    with av.open(str(partial)) as c:
        n = sum(1 for _ in c.decode(video=0))
    assert 16 <= n < 1000  # everything published before the interrupt, and not the whole video


def test_killed_render_partial_is_playable(job_dir: Path):
    """SIGKILL gives no chance to clean up: the fragmented MP4 must still decode."""
    write_wav(job_dir / "long.wav", 40.0)
    proc = subprocess.Popen([sys.executable, "-m", "avatar_cli", "render", str(job_dir / "job.yaml"),
                             "audio=" + str(job_dir / "long.wav"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if json.loads(line)["event"] == "chunk" and json.loads(line)["end"] > 100:
                break
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    partial = job_dir / "out" / "video.partial.mp4"
    with av.open(str(partial)) as c:
        assert sum(1 for _ in c.decode(video=0)) >= 25  # at least the first whole fragment (1 s)
    assert not (job_dir / "out" / "video.mp4").exists()


def test_validate_opens_inputs_without_rendering(job_dir: Path):
    result = run_cli("validate", str(job_dir / "job.yaml"), "--json")
    assert result.returncode == 0, result.stderr
    info = events(result.stdout)[0]
    assert info["event"] == "valid" and info["frames"] == 58 and info["reference_size"] == [120, 160]
    assert not (job_dir / "out" / "video.mp4").exists()


def test_models_lists_shipped_and_init_writes_a_dir(tmp_path: Path):
    result = run_cli("models", "--json")
    assert result.returncode == 0, result.stderr
    names = [e["name"] for e in events(result.stdout)]
    assert "mini" in names
    assert all(e["params"] > 1_000_000 for e in events(result.stdout) if e["name"] == "mini")
    result = run_cli("models", "init", str(tmp_path / "m"), "--size", "tiny", "--json")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m" / "config.json").is_file()


def test_a_prompt_longer_than_the_text_encoder_reads_is_warned_about(job_dir: Path):
    """The text encoder reads a fixed number of tokens and the family cuts the rest (as the official code does):
    validate and render say so, naming the counts, instead of dropping words silently."""
    long = "prompt=" + "smiling " * 17  # 17 known words, 17 tokens: mini reads 16
    result = run_cli("validate", str(job_dir / "job.yaml"), long, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["warnings"] == [
        "warning: prompt: 17 tokens; the mini family's text encoder reads the first 16 and ignores the rest"]
    fits = run_cli("validate", str(job_dir / "job.yaml"), "prompt=" + "smiling " * 16, "--json")
    assert json.loads(fits.stdout)["warnings"] == []


def test_validate_warns_about_a_tiny_reference(job_dir: Path):
    from avatar_cli.media.image import save_png

    save_png(job_dir / "tiny.png", np.full((8, 8, 3), 128, np.uint8))
    result = run_cli("validate", str(job_dir / "job.yaml"), f"reference={job_dir / 'tiny.png'}", "--json")
    assert result.returncode == 0, result.stderr
    assert "only 8x8 px" in result.stderr and len(json.loads(result.stdout)["warnings"]) == 1
    assert json.loads(run_cli("validate", str(job_dir / "job.yaml"), "--json").stdout)["warnings"] == []


@pytest.mark.parametrize("value, kinds, device, want", [
    (True, ("N", "I"), "cpu", (True, "")),  # asked for: as asked, nothing to say
    (False, ("N", "I"), "cuda", (False, "")),
    ("auto", ("N", "I"), "cuda", (True, "auto: a GPU renders, where I chunks cost little")),
    ("auto", ("N", "I"), "cpu", (False, "auto: off on a CPU")),
    ("auto", ("N",), "cuda", (False, "")),  # wan-s2v has no I chunks: auto is off, silently
])
def test_auto_transitions_on_a_gpu_off_on_a_cpu(value, kinds, device, want):
    from avatar_cli.pipeline.schedule import choose_transitions

    on, why = choose_transitions(value, kinds, device)
    assert on is want[0] and why.startswith(want[1]) and bool(why) == bool(want[1])
