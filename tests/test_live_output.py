"""Live outputs (avatar_cli/media/live.py): MPEG-TS on a pipe, HLS, RTMP, each decoded back with PyAV."""

import io
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import av
import numpy as np
import pytest

from avatar_cli.errors import InputError
from avatar_cli.media.live import HLS_LIST_SIZE, LiveWriter, live_target
from tests.conftest import avatar

FPS, RATE, SIZE = 25, 16000, 64


class Tone:
    """An AudioFeed: a 440 Hz tone, handed out in exact sample counts."""

    rate, channels = RATE, 1

    def __init__(self):
        self.taken = 0

    def take(self, n: int) -> np.ndarray:
        t = (self.taken + np.arange(n)) / RATE
        self.taken += n
        return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None]  # (1, n)

    def close(self) -> None:
        pass


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def frames(n: int) -> np.ndarray:
    """(n, H, W, 3) uint8 whose red level encodes the frame index, so order and count can be read back."""
    out = np.zeros((n, SIZE, SIZE, 3), np.uint8)
    out[..., 0] = (np.arange(n) * 9 % 256)[:, None, None]
    return out


def write(target, n: int, **kw) -> LiveWriter:
    w = LiveWriter(target, width=SIZE, height=SIZE, fps=FPS, audio_path=Tone(), **kw)
    w.put(frames(n))
    w.close()
    return w


def test_targets():
    assert live_target("out.mp4") is None and live_target("dir/render.MP4") is None
    assert live_target("-").format == "mpegts" and live_target("-").kind == "stdout"
    assert live_target("rtmp://h/app/key").format == "flv" and live_target("rtmps://h/app/k").kind == "rtmps"
    assert live_target("udp://127.0.0.1:1234").options["pkt_size"] == "1316"
    assert live_target("tcp://127.0.0.1:1234").format == "mpegts"
    hls = live_target("out/live.m3u8")
    assert hls.kind == "hls" and hls.options["hls_list_size"] == str(HLS_LIST_SIZE)
    assert "delete_segments" in hls.options["hls_flags"]
    assert live_target("out/live.m3u8", keep_segments=True).options["hls_playlist_type"] == "event"
    with pytest.raises(InputError, match="srt://h:1"):
        live_target("srt://h:1")


def test_mpegts_on_a_pipe_decodes_to_what_was_written():
    buf = io.BytesIO()
    write(live_target("-"), 2 * FPS + 5, stdout=buf)
    buf.seek(0)
    with av.open(buf, format="mpegts") as c:
        packets = [p for p in c.demux(video=0) if p.size]
    keys = [i for i, p in enumerate(sorted(packets, key=lambda p: p.pts)) if p.is_keyframe]
    assert keys == [0, FPS, 2 * FPS]  # a keyframe every second, exactly
    assert all(p.pts == p.dts for p in packets)  # no B-frames: nothing is reordered
    buf.seek(0)
    with av.open(buf, format="mpegts") as c:
        video = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(video) == 2 * FPS + 5
    red = np.array([f[..., 0].mean() for f in video])
    assert np.abs(red - np.arange(len(video)) * 9 % 256).max() < 4  # every frame, in order
    buf.seek(0)
    with av.open(buf, format="mpegts") as c:
        audio = [f for f in c.decode(audio=0)]
        start = float(audio[0].time)
        samples = np.concatenate([f.to_ndarray().reshape(-1) for f in audio])
    assert abs(start) < 1e-3  # audio and video both start at 0
    # The track covers the video (AAC emits whole 1024-sample frames: at most one more).
    assert len(video) / FPS <= len(samples) / RATE <= len(video) / FPS + 1024 / RATE + 1e-9
    spectrum = np.abs(np.fft.rfft(samples[2048:RATE + 2048]))
    assert abs(np.argmax(spectrum) - 440) <= 1  # the tone, at its pitch


def test_hls_playlist_is_live_then_ended(tmp_path: Path):
    playlist = tmp_path / "hls" / "live.m3u8"
    w = LiveWriter(live_target(str(playlist)), width=SIZE, height=SIZE, fps=FPS, audio_path=Tone(), queue_frames=1)
    w.put(frames(3 * FPS + 2))  # queue of one: put returns once all but the last frame are encoded
    deadline = time.monotonic() + 30
    while not (playlist.exists() and playlist.read_text().count("#EXTINF") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    text = playlist.read_text()
    assert text.count("#EXTINF") >= 2 and "#EXT-X-ENDLIST" not in text  # live: segments listed, not ended
    w.close()
    text = playlist.read_text()
    assert text.rstrip().endswith("#EXT-X-ENDLIST")
    durations = [float(line.split(":")[1].rstrip(",")) for line in text.splitlines() if line.startswith("#EXTINF")]
    assert durations[:3] == [1.0, 1.0, 1.0] and sum(durations) == pytest.approx((3 * FPS + 2) / FPS, abs=0.05)
    with av.open(str(playlist)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 3 * FPS + 2


def test_hls_half_second_segments_cut_on_their_own_keyframes(tmp_path: Path):
    """live.hls_segment_s 0.5 at 25 fps: a keyframe every 13 frames (0.5 s rounded up to whole frames, so the
    muxer's cut is never short of hls_time), and a segment at each."""
    playlist = tmp_path / "live.m3u8"
    target = live_target(str(playlist), hls_segment_s=0.5)
    assert target.options["hls_time"] == "0.5" and target.keyframe_frames(FPS) == 13
    write(target, 2 * FPS)
    durations = [float(line.split(":")[1].rstrip(",")) for line in playlist.read_text().splitlines()
                 if line.startswith("#EXTINF")]
    assert durations[:3] == [0.52, 0.52, 0.52] and sum(durations) == pytest.approx(2, abs=0.05)
    with av.open(str(playlist)) as c:
        keys = [i for i, p in enumerate(sorted((p for p in c.demux(video=0) if p.size), key=lambda p: p.pts))
                if p.is_keyframe]
    assert keys == [0, 13, 26, 39]


def test_a_session_cuts_hls_at_its_hls_segment_s(job_dir: Path):
    """live.hls_segment_s reaches the session's HLS output (the tiny model's job, unpaced)."""
    playlist = job_dir / "hls" / "live.m3u8"
    r = avatar("render", str(job_dir / "job.yaml"), "-o", str(playlist), "live.hls_segment_s=0.5",
               "live.realtime=false", "live.hls_keep_segments=true")
    assert r.returncode == 0, r.stderr
    durations = [line for line in playlist.read_text().splitlines() if line.startswith("#EXTINF")]
    assert len(durations) >= 3 and durations[0] == "#EXTINF:0.520000,"


@pytest.mark.parametrize("keep", [False, True])
def test_hls_old_segments_deleted_or_kept(tmp_path: Path, keep: bool):
    playlist = tmp_path / "live.m3u8"
    seconds = HLS_LIST_SIZE + 3
    write(live_target(str(playlist), keep_segments=keep), seconds * FPS)
    segments = sorted(tmp_path.glob("live_*.ts"))
    listed = [line for line in playlist.read_text().splitlines() if line.endswith(".ts")]
    if keep:
        assert len(segments) == len(listed) == seconds
    else:  # the muxer keeps one segment past the list for players still reading it
        assert len(listed) == HLS_LIST_SIZE and len(segments) <= HLS_LIST_SIZE + 2
        assert listed[-1] == segments[-1].name


class FakeClock:
    """now() and sleep() on a clock the test owns: sleeping advances it, and so does `busy` (work taking time)."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(0.0, s)


def test_realtime_paces_frames_on_the_stream_clock():
    """With realtime, frame i is muxed no earlier than i / fps after frame 0 (a fake clock: no timing here)."""
    from avatar_cli.media.pacing import FramePacer

    clock = FakeClock()
    pacer = FramePacer(FPS, now=clock.now, sleep=clock.sleep)
    write(live_target("-"), FPS, stdout=io.BytesIO(), realtime=True, pacer=pacer)
    assert pacer.first == 100.0 and clock.t == pytest.approx(100.0 + (FPS - 1) / FPS)


def test_a_late_frame_does_not_move_the_clock():
    """Frame k leaves at the first frame's time + k / fps whatever came before it: a frame ready late leaves at
    once, and the frames after it keep their times (the stream catches up instead of drifting later)."""
    from avatar_cli.media.pacing import FramePacer

    clock = FakeClock(0.0)
    pacer = FramePacer(25.0, now=clock.now, sleep=clock.sleep)
    left = [pacer.wait(0)]
    left += [pacer.wait(k) for k in range(1, 10)]
    assert left == pytest.approx([k / 25 for k in range(10)])
    clock.t += 2.0  # the next frame is ready 2 s late (its audio stalled, say)
    left = [pacer.wait(k) for k in range(10, 80)]
    late = 0.36 + 2.0  # frame 10's time was 0.4: it leaves when it is ready, and so do those already due
    assert left[0] == pytest.approx(late)
    assert all(t == pytest.approx(max(late, k / 25)) for t, k in zip(left, range(10, 80)))
    assert pacer.due(100) == pytest.approx(4.0)


LISTENER = textwrap.dedent("""
    import sys, av
    n = 0
    with av.open(sys.argv[1], format="flv", options={"listen": "1", "timeout": "30"}) as c:
        print("up", flush=True)
        try:
            for _ in c.decode(video=0):
                n += 1
        except OSError:  # the publisher hung up
            pass
    print(n, flush=True)
""")


def test_rtmp_to_a_local_listener(unused_port):
    """An RTMP server in another process (PyAV listening), as a streaming platform's ingest would be."""
    url = f"rtmp://127.0.0.1:{unused_port}/live/key"
    server = subprocess.Popen([sys.executable, "-c", LISTENER, url], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                w = LiveWriter(live_target(url), width=SIZE, height=SIZE, fps=FPS, audio_path=Tone())
                break
            except InputError:  # not listening yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        w.put(frames(3 * FPS))
        w.close()
        out = server.communicate(timeout=30)[0].split()
    finally:
        server.kill()
    # The listener loses the last packet or two when the publisher disconnects.
    assert 3 * FPS - 3 <= int(out[-1]) <= 3 * FPS


def test_an_unreachable_server_is_bad_input(unused_port):
    url = f"rtmp://127.0.0.1:{unused_port}/live/key"
    with pytest.raises(InputError, match=f"output: {url}: cannot open the rtmp output"):
        LiveWriter(live_target(url), width=SIZE, height=SIZE, fps=FPS, audio_path=Tone())
