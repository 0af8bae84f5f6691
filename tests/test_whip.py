"""WHIP out (avatar_cli/media/whip.py): WebRTC to a real peer on loopback, aiortc behind an HTTP server
(tests/whip_endpoint.py), which receives the tracks; the tests count what it decoded and look for gaps."""

import json
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from avatar_cli.errors import InputError, RenderError
from avatar_cli.media import whip, whip_peer
from avatar_cli.media.live import live_target
from avatar_cli.media.whip import live_writer
from avatar_cli.media.whip import OPUS_RATE, WhipWriter, _Opus48k
from tests.conftest import avatar, write_wav
from tests.test_live_output import FPS, SIZE, Tone, frames
from tests.whip_endpoint import WhipPeer  # aiortc: the test extra

FRAME_S = 1 / FPS


def unused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/live/whip"


def events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def check_stream(report: dict, frames_sent: int) -> None:
    """The peer got both tracks, every frame but the last one or two (the hang-up), with no gap in either."""
    assert sorted(report["kinds"]) == ["audio", "video"]
    video = np.array(report["video_times"])
    assert frames_sent - 2 <= len(video) <= frames_sent
    assert np.allclose(np.diff(video), FRAME_S, atol=1e-3)  # consecutive frames: none lost, none repeated
    audio = np.array(report["audio_times"])
    assert report["audio_rate"] == OPUS_RATE and np.diff(audio).max() < 0.021  # 20-ms Opus frames, none missing
    # The audio covers the video, but for the packets in flight at the hang-up.
    assert abs(report["audio_samples"] / OPUS_RATE - frames_sent / FPS) < 0.15
    assert report["audio_peak"] > 0.1  # sound, not silence


def test_targets():
    t = live_target("http://127.0.0.1:8889/live/whip", bearer_token="s3cret")
    assert t.format == "whip" and t.kind == "whip" and t.options["authorization"] == "s3cret"
    assert "s3cret" not in repr(t)  # the token stays out of logs
    assert "authorization" not in live_target("https://example.com/whip").options
    assert live_target("HTTPS://example.com/whip").format == "whip"


def test_opus_feed_is_48k_stereo_in_exact_counts():
    feed = _Opus48k(Tone())
    counts = (312, 1920, 1921, 7, 4800)
    pieces = [feed.take(n) for n in counts]
    assert [p.shape for p in pieces] == [(2, n) for n in counts]
    x = np.concatenate(pieces, axis=1)  # (2, n)
    assert np.array_equal(x[0], x[1])  # mono, doubled
    assert feed.feed.taken == x.shape[1] * 16000 // OPUS_RATE  # nothing taken ahead of what was handed out
    spectrum = np.abs(np.fft.rfft(x[0, 480:480 + OPUS_RATE // 10]))
    assert abs(np.argmax(spectrum) * 10 - 440) <= 10  # the tone, at its pitch


def test_a_stream_reaches_the_peer_with_the_token_and_ends_with_delete():
    with WhipPeer() as peer:
        w = live_writer(live_target(peer.url, bearer_token="s3cret"), width=SIZE, height=SIZE, fps=FPS,
                        audio_path=Tone(), realtime=True)
        assert isinstance(w, WhipWriter)
        w.put(frames(3 * FPS))
        w.close()
        time.sleep(0.3)  # the last packets' way to the peer
        report = peer.report()
    assert report["authorization"] == ["Bearer s3cret"]
    assert report["deletes"] == ["/resource/1"]  # the relative Location, resolved against the POST URL
    check_stream(report, 3 * FPS)


def test_a_session_past_the_consent_expiry_stays_up():
    """A strict peer checks consent (RFC 7675) and drops a sender that does not answer: here it would after 2 s,
    and the stream runs 5 s (FFmpeg's whip muxer, which answers no consent check, is dropped by then)."""
    seconds = 5
    with WhipPeer(consent_s=2.0) as peer:
        w = live_writer(live_target(peer.url), width=SIZE, height=SIZE, fps=FPS, audio_path=Tone(), realtime=True)
        w.put(frames(seconds * FPS))
        w.close()
        time.sleep(0.3)
        report = peer.report()
    assert report["states"][:2] == ["connecting", "connected"] and "failed" not in report["states"]
    assert report["deletes"] == ["/resource/1"]
    check_stream(report, seconds * FPS)


def test_close_is_bounded_when_the_endpoint_stops_answering(monkeypatch):
    """The endpoint's process stops (SIGSTOP: its sockets stay open, nothing answers, not even the DELETE): close()
    gives up after CLOSE_TIMEOUT_S instead of hanging."""
    monkeypatch.setattr(whip_peer, "CLOSE_TIMEOUT_S", 2.0)
    monkeypatch.setattr(whip_peer, "DRAIN_S", 0.5)
    with WhipPeer() as peer:
        w = live_writer(live_target(peer.url), width=SIZE, height=SIZE, fps=FPS, audio_path=Tone(), realtime=True)
        w.put(frames(FPS))
        while len(peer.report()["video_times"]) < FPS // 2:
            time.sleep(0.05)
        peer.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            w.close()
            took = time.monotonic() - t0
        finally:
            peer.proc.send_signal(signal.SIGCONT)
    assert took < 2.0 + 1.0 + 2.0  # the drain, the bound, and the frames still to pace
    assert not [t for t in threading.enumerate() if t.name in ("mp4-writer", "whip-peer")]


def test_an_endpoint_that_hangs_up_is_gone_and_close_returns():
    """The endpoint closes the connection mid-stream (gracefully: DTLS close_notify): the writer says it went away,
    and closing does not wait on it."""
    with WhipPeer() as peer:
        w = live_writer(live_target(peer.url), width=SIZE, height=SIZE, fps=FPS, audio_path=Tone(), realtime=True)
        w.put(frames(FPS // 2))
        while len(peer.report()["video_times"]) < FPS // 4:
            time.sleep(0.05)
        peer.hang_up()
        with pytest.raises(RenderError, match=f"output: {peer.url}: the WHIP endpoint went away .*closed"):
            w.put(frames(3 * FPS))
            w.close()
        w.abort()
    assert not [t for t in threading.enumerate() if t.name in ("mp4-writer", "whip-peer")]


def test_the_handshake_does_not_stay_in_the_frames_latency(monkeypatch):
    """The frame clock starts with the first frame, before the handshake (here one of 5 s on a fake clock): the
    frames that waited for it leave at once after it, instead of every frame leaving 5 s after its time."""
    from avatar_cli.media.pacing import FramePacer
    from tests.test_live_output import FakeClock

    clock = FakeClock()
    connect = whip._PeerOutput.start_encoding

    def slow_handshake(self):
        connect(self)
        clock.t += 5.0

    monkeypatch.setattr(whip._PeerOutput, "start_encoding", slow_handshake)
    with WhipPeer() as peer:
        pacer = FramePacer(FPS, now=clock.now, sleep=clock.sleep)
        w = live_writer(live_target(peer.url), width=SIZE, height=SIZE, fps=FPS, audio_path=Tone(), realtime=True,
                        pacer=pacer)
        w.put(frames(FPS))
        w.close()
    assert pacer.first == 100.0  # the clock started with frame 0, not after the handshake
    assert clock.t == pytest.approx(105.0)  # every frame was due before the handshake ended: none waited after it


def test_a_refused_offer_is_bad_input_naming_the_url():
    with WhipPeer(refuse=403) as peer:
        w = live_writer(live_target(peer.url), width=SIZE, height=SIZE, fps=FPS, audio_path=Tone())
        with pytest.raises(InputError, match=f"output: {peer.url}: the WHIP endpoint refused the offer .*403"):
            w.put(frames(FPS))
            w.close()
        assert peer.report()["offers"] == 1


def test_an_endpoint_that_does_not_answer_is_bad_input(monkeypatch):
    url = unused_url()  # nothing listens there
    with pytest.raises(InputError, match=f"output: {url}: the WHIP endpoint does not answer"):
        live_writer(live_target(url), width=SIZE, height=SIZE, fps=FPS, audio_path=Tone())
    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/live/whip"
        monkeypatch.setattr(whip_peer, "ANSWER_TIMEOUT_S", 0.5)
        with pytest.raises(InputError, match=f"output: {url}: the WHIP endpoint does not answer .*timed out"):
            live_writer(live_target(url), width=SIZE, height=SIZE, fps=FPS, audio_path=Tone())
    assert not [t for t in threading.enumerate() if t.name == "mp4-writer"]  # nothing left running


# ---- sessions: `avatar render -o http://...` with the tiny model -------------------------------------------


def test_a_session_into_whip(job_dir: Path):
    (job_dir / "token").write_text("s3cret\n")
    with WhipPeer() as peer:
        r = avatar("render", str(job_dir / "job.yaml"), "-o", peer.url, "--json",
                   f"live.bearer_token_file={job_dir / 'token'}")
        assert r.returncode == 0, r.stderr
        time.sleep(0.3)
        report = peer.report()
    done = events(r.stdout)[-1]
    assert done["event"] == "done"
    assert report["authorization"] == ["Bearer s3cret"] and report["deletes"] == ["/resource/1"]
    check_stream(report, done["frames"])


def test_session_bad_input_is_exit_2(job_dir: Path):
    job = str(job_dir / "job.yaml")
    missing = job_dir / "no_token"
    r = avatar("render", job, "-o", unused_url(), f"live.bearer_token_file={missing}")
    assert r.returncode == 2 and f"live.bearer_token_file: {missing}" in r.stderr
    (job_dir / "empty").write_text(" \n")
    r = avatar("render", job, "-o", unused_url(), f"live.bearer_token_file={job_dir / 'empty'}")
    assert r.returncode == 2 and "is empty" in r.stderr
    r = avatar("render", job, "-o", "out.mp4", f"live.bearer_token_file={job_dir / 'empty'}")
    assert r.returncode == 2 and "live.bearer_token_file is for a WHIP output" in r.stderr
    url = unused_url()
    r = avatar("render", job, "-o", url)
    assert r.returncode == 2 and f"output: {url}: the WHIP endpoint does not answer" in r.stderr
    with WhipPeer(refuse=401) as peer:
        r = avatar("render", job, "-o", peer.url)
    assert r.returncode == 2 and f"output: {peer.url}: the WHIP endpoint refused the offer" in r.stderr
    assert "Traceback" not in r.stderr
    assert not [t for t in threading.enumerate() if t.name == "mp4-writer"]  # nothing left running


def test_an_endpoint_gone_mid_session_is_exit_1_with_a_playable_recording(job_dir: Path, tmp_path: Path,
                                                                           monkeypatch):
    """The endpoint's process dies two seconds in: its receiver reports stop (GONE_S, shortened here), the session
    ends with exit 1 naming the URL, and the recording plays."""
    from tests.test_live_session import decode

    monkeypatch.setattr(whip_peer, "GONE_S", 1.5)
    write_wav(job_dir / "speech.wav", 8.0)
    record = tmp_path / "rec.mp4"
    with WhipPeer() as peer:
        def hang_up():
            deadline = time.monotonic() + 60
            # Two seconds in: the peer has sent receiver reports (aiortc: every 0.5 to 1.5 s), whose stop tells.
            while len(peer.report()["video_times"]) < 2 * FPS and time.monotonic() < deadline:
                time.sleep(0.1)
            peer.gone()

        killer = threading.Thread(target=hang_up, daemon=True)
        killer.start()
        r = avatar("render", str(job_dir / "job.yaml"), "-o", peer.url, "--json", f"live.record={record}")
        killer.join(10)
    assert r.returncode == 1, r.stderr
    assert f"output: {peer.url}: the WHIP endpoint went away" in r.stderr and "Traceback" not in r.stderr
    published = max(e["published"] for e in events(r.stdout) if e["event"] == "chunk")
    assert 2 * FPS <= published < 8 * FPS  # ended early, after the hang-up
    assert decode(record, fmt=None)[0] >= FPS  # the recording is finished and plays
