"""Live sessions (avatar_cli/render/live.py) through `avatar render`: audio on stdin, streams out, stalls, signals.

The sessions that read stdin or write stdout run in a fresh interpreter (they are about pipes); the others in-process.
A session's frames are those of a render of the same audio: the plan grows into the file's plan, and the features
read the same samples (16-kHz mono input, so nothing is resampled)."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import av
import numpy as np
import pytest

from tests.conftest import avatar, fill

FPS = 25.0


def start_avatar(*args: str, **kwargs) -> subprocess.Popen:
    """`python -m avatar_cli ARGS` in a fresh interpreter, with binary pipes (the stream is bytes)."""
    kwargs.pop("text", None)
    return subprocess.Popen([sys.executable, "-m", "avatar_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kwargs)


def events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def decode(data_or_path, fmt: str | None = "mpegts") -> tuple[int, np.ndarray, int]:
    """(video frames, mono audio samples, audio rate) of a stream or file."""
    import io

    src = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else str(data_or_path)
    with av.open(src, format=fmt if isinstance(data_or_path, bytes) else None) as c:
        video = sum(1 for _ in c.decode(video=0))
    if isinstance(src, io.BytesIO):
        src.seek(0)
    with av.open(src, format=fmt if isinstance(data_or_path, bytes) else None) as c:
        frames = [f for f in c.decode(audio=0)]
    return video, np.concatenate([f.to_ndarray().reshape(-1) for f in frames]), frames[0].sample_rate


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, tiny_model: Path):
    """The job rendered to an MP4 as usual: its done event (the reference frames and digest)."""
    from tests.conftest import write_job

    folder = write_job(tmp_path_factory.mktemp("file_render"), tiny_model)
    r = avatar("render", str(folder / "job.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    return folder, [e for e in events(r.stdout) if e["event"] == "done"][0]


def session(folder: Path, stdin: bytes | None, *overrides: str, timeout: float = 120):
    proc = start_avatar("render", str(folder / "job.yaml"), "audio=-", "-o", "-", "--json", *overrides,
                        stdin=subprocess.PIPE, text=False)
    out, err = proc.communicate(stdin, timeout=timeout)
    return proc.returncode, out, err.decode()


def wait_ready(proc: subprocess.Popen) -> str:
    """stderr up to the session's ready event (a line of its own)."""
    lines = []
    for line in iter(proc.stderr.readline, b""):
        lines.append(line.decode())
        if line.startswith(b'{"event": "ready"'):
            return "".join(lines)
    raise AssertionError(f"no ready event: {''.join(lines)}")


def test_wav_on_stdin_to_stdout_is_the_renders_frames(rendered):
    folder, done = rendered
    code, out, err = session(folder, (folder / "speech.wav").read_bytes())
    assert code == 0, err
    ev = events(err)  # stdout carries the stream alone; the events go to stderr
    assert ev[0]["event"] == "ready"
    last = ev[-1]
    assert last["event"] == "done" and last["frames"] == done["frames"]
    assert last["frames_digest"] == done["frames_digest"]  # the same frames, bit for bit
    chunks = [e for e in ev if e["event"] == "chunk"]
    publishing = [e for e, before in zip(chunks, [{"published": 0}, *chunks]) if e["published"] > before["published"]]
    assert publishing and all(e["latency_s"] is not None and e["latency_s"] >= 0 for e in publishing)
    assert last["first_frame_s"] > 0 and last["latency_p95_s"] >= last["latency_median_s"]
    video, audio, rate = decode(out)
    assert video == done["frames"]
    assert abs(len(audio) / rate - video / FPS) <= 1024 / rate + 1e-6  # in step, to one AAC frame


def test_a_sessions_own_chunk_is_a_renders_chunking_at_any_pace(rendered, tmp_path: Path):
    """live.chunk_frames is the session's chunking.frames: its frames are a file render's with that chunking.frames,
    whether the audio comes at once or at the speaker's pace; a chunk too short for the job's other keys is refused."""
    folder, done = rendered
    r = avatar("render", str(folder / "job.yaml"), "chunking.frames=8", "-o", str(tmp_path / "eight.mp4"), "--json")
    assert r.returncode == 0, r.stderr
    eight = [e for e in events(r.stdout) if e["event"] == "done"][0]
    assert eight["frames"] == done["frames"] and eight["frames_digest"] != done["frames_digest"]
    wav = (folder / "speech.wav").read_bytes()
    code, _, err = session(folder, wav, "live.chunk_frames=8")  # all at once
    assert code == 0, err
    assert events(err)[-1]["frames_digest"] == eight["frames_digest"]
    proc = start_avatar("render", str(folder / "job.yaml"), "audio=-", "-o", "-", "--json", "live.chunk_frames=8",
                        "live.stall_s=5", stdin=subprocess.PIPE, text=False)
    import threading

    head = wait_ready(proc)
    reads: list = []
    reader = threading.Thread(target=timed_reads, args=(proc.stdout, reads), daemon=True)
    reader.start()
    proc.stdin.write(wav[:44])
    paced(proc.stdin, wav[44:], 1 / (16000 * 2))  # at the speaker's pace
    proc.stdin.close()
    reader.join(timeout=120)
    out, err = b"".join(d for _, _, d in reads), head + proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    last = events(err)[-1]
    assert last["stalls"] == 0 and last["frames_digest"] == eight["frames_digest"]
    assert decode(out)[0] == eight["frames"]
    short = avatar("validate", str(folder / "job.yaml"), "audio=-", "-o", "-", "live.chunk_frames=3")
    assert short.returncode == 2 and "live.chunk_frames" in short.stderr


def test_raw_pcm_on_stdin(rendered):
    folder, done = rendered
    pcm = (folder / "speech.wav").read_bytes()[44:]  # the conftest's WAV: a 44-byte header, s16le mono 16 kHz
    code, out, err = session(folder, pcm, "live.raw_audio.format=s16le", "live.raw_audio.rate=16000")
    assert code == 0, err
    last = events(err)[-1]
    assert last["frames"] == done["frames"] and last["frames_digest"] == done["frames_digest"]
    assert decode(out)[0] == done["frames"]


def paced(stdin, data: bytes, seconds_per_byte: float, piece: int = 640) -> None:
    """Write `data` at the speaker's pace: each piece once its last sample has been spoken."""
    t0 = time.monotonic()
    for i in range(0, len(data), piece):
        time.sleep(max(0.0, t0 + (i + piece) * seconds_per_byte - time.monotonic()))
        stdin.write(data[i:i + piece])
        stdin.flush()


def timed_reads(stream, reads: list) -> None:
    """Read a pipe as a player does (what has arrived, at once), noting (bytes so far, time) after each read."""
    total = 0
    while data := os.read(stream.fileno(), 1 << 16):
        total += len(data)
        reads.append((total, time.monotonic(), data))


def video_arrivals(reads: list) -> list[float]:
    """When each video packet of an MPEG-TS stream read as `reads` had reached the reader."""
    import bisect
    import io

    ends = [n for n, _, _ in reads]
    with av.open(io.BytesIO(b"".join(d for _, _, d in reads)), format="mpegts") as c:
        positions = [p.pos for p in c.demux(video=0) if p.size and p.pos is not None and p.pos >= 0]
    return [reads[bisect.bisect_right(ends, pos)][1] for pos in positions]


def test_a_stall_inserts_silence_and_the_stream_goes_on(rendered, tmp_path: Path):
    """Speech at the speaker's pace, a 3-s pause, then the rest: the reader of the stream never waits more than
    stall_s + 0.5 s for a frame, the pause is silence in the track, and the recording holds the same session."""
    import threading

    folder, _ = rendered
    wav = (folder / "speech.wav").read_bytes()
    header, pcm = wav[:44], wav[44:]
    second, stall_s = 16000 * 2, 0.4
    proc = start_avatar("render", str(folder / "job.yaml"), "audio=-", "-o", "-", "--json", f"live.stall_s={stall_s}",
                        f"live.record={tmp_path / 'rec.mp4'}", stdin=subprocess.PIPE, text=False)
    unknown = bytearray(header)
    unknown[4:8] = unknown[40:44] = b"\xff\xff\xff\xff"  # as a TTS engine writes a WAV of unknown length
    head = wait_ready(proc)  # models loaded, the input being read
    reads: list = []
    reader = threading.Thread(target=timed_reads, args=(proc.stdout, reads), daemon=True)
    reader.start()
    proc.stdin.write(bytes(unknown))
    paced(proc.stdin, pcm[:second], 1 / second)  # 1 s
    time.sleep(3.0)  # the source stalls
    paced(proc.stdin, pcm[second:], 1 / second)
    proc.stdin.close()
    reader.join(timeout=120)
    out = b"".join(d for _, _, d in reads)
    err = head + proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    ev = events(err)
    stalls = [e for e in ev if e["event"] == "stall"]
    done = ev[-1]
    assert stalls and done["stalls"] == len(stalls) and done["silence_s"] > 0
    assert all(e["at_s"] >= 1.0 - 1e-3 for e in stalls)  # nothing is inserted before the audio that arrived
    assert 3.0 - stall_s - 0.1 <= done["silence_s"] <= 3.0 + 0.1  # the pause, less at most stall_s
    total_s = len(pcm) / second + done["silence_s"]  # the input with the silences inserted
    assert done["frames"] == round(total_s * FPS)
    arrivals = video_arrivals(reads)
    assert len(arrivals) == done["frames"]
    assert max(b - a for a, b in zip(arrivals, arrivals[1:])) <= stall_s + 0.5  # the picture never froze longer
    video, audio, rate = decode(out)
    assert video == done["frames"]
    assert abs(len(audio) / rate - video / FPS) <= 1024 / rate + 1e-6  # the audio track stays in step
    at = int(stalls[0]["at_s"] * rate)
    gap = audio[at + 1024: at + int(stalls[0]["silence_s"] * rate) - 1024]
    assert gap.size > 0 and np.abs(gap).max() < 0.01  # the inserted silence is in the track
    assert np.abs(audio[:at - 1024]).max() > 0.1  # and the speech before it
    rec_video, rec_audio, _ = decode(tmp_path / "rec.mp4", fmt=None)
    assert rec_video == video  # the recording holds the same session


def test_sigint_ends_the_session_cleanly(rendered, tmp_path: Path):
    folder, _ = rendered
    record = tmp_path / "rec.mp4"
    proc = start_avatar("render", str(folder / "job.yaml"), "audio=-", "-o", "-", "--json",
                        f"live.record={record}", stdin=subprocess.PIPE, text=False)
    wav = (folder / "speech.wav").read_bytes()
    proc.stdin.write(wav[:44 + 32000])  # 1 s, then nothing more: the session waits on
    proc.stdin.flush()
    out = bytearray()
    deadline = time.monotonic() + 120
    while not out and time.monotonic() < deadline:  # the first frames are out
        os.set_blocking(proc.stdout.fileno(), False)
        chunk = proc.stdout.read()
        if chunk:
            out += chunk
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    os.set_blocking(proc.stdout.fileno(), True)
    out += proc.stdout.read()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 130, err
    assert "interrupted" in err and "Traceback" not in err
    video, _, _ = decode(bytes(out))
    assert video > 0  # the stream was closed cleanly: it decodes
    assert decode(record, fmt=None)[0] == video  # the recording is finished and holds the same frames


def test_garbage_on_stdin_is_exit_2(rendered):
    folder, _ = rendered
    code, out, err = session(folder, os.urandom(1 << 16))
    assert code == 2, err
    assert "audio: stdin: not audio FFmpeg can read" in err and "Traceback" not in err


def test_a_source_that_sends_nothing_is_exit_1(rendered):
    folder, _ = rendered
    proc = start_avatar("render", str(folder / "job.yaml"), "audio=-", "-o", "-", "live.first_audio_s=1",
                        stdin=subprocess.PIPE, text=False)
    try:
        proc.wait(timeout=60)  # stdin held open, never written
        err = proc.stderr.read()
    finally:
        proc.kill()
        proc.stdin.close()
    assert proc.returncode == 1, err
    assert b"no audio arrived in 1 s" in err


def test_a_file_into_hls_is_paced_and_ended(rendered, tmp_path: Path):
    folder, done = rendered
    playlist = tmp_path / "hls" / "live.m3u8"
    r = avatar("render", str(folder / "job.yaml"), "-o", str(playlist), "--json", "live.hls_keep_segments=true")
    assert r.returncode == 0, r.stderr
    last = events(r.stdout)[-1]
    assert last["event"] == "done" and last["frames_digest"] == done["frames_digest"]
    # Paced at real time (a server gets a stream, not a burst): the first frame leaves at once, frame k k / fps
    # after it, so the session lasts at least (frames - 1) / fps.
    assert last["wall_s"] >= (done["frames"] - 1) / FPS
    text = playlist.read_text()
    assert text.rstrip().endswith("#EXT-X-ENDLIST")
    assert decode(playlist, fmt=None)[0] == done["frames"]
    again = avatar("render", str(folder / "job.yaml"), "-o", str(playlist))
    assert again.returncode == 2 and "already exists" in again.stderr  # nothing is overwritten by accident


LISTENER = textwrap.dedent("""
    import sys, av
    n = 0
    with av.open(sys.argv[1], format="flv", options={"listen": "1", "timeout": "60"}) as c:
        try:
            for _ in c.decode(video=0):
                n += 1
        except OSError:
            pass
    print(n, flush=True)
""")


def test_rtmp_push_to_a_local_server(rendered):
    folder, done = rendered
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"rtmp://127.0.0.1:{port}/live/key"
    server = subprocess.Popen([sys.executable, "-c", LISTENER, url], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # listening
        r = avatar("render", str(folder / "job.yaml"), "-o", url, "--json")
        assert r.returncode == 0, r.stderr
        received = int(server.communicate(timeout=60)[0].split()[-1])
    finally:
        server.kill()
    assert done["frames"] - 3 <= received <= done["frames"]  # the listener loses a packet or two at the hang-up


def test_an_unreachable_rtmp_server_is_exit_2(rendered):
    folder, _ = rendered
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = avatar("render", str(folder / "job.yaml"), "-o", f"rtmp://127.0.0.1:{port}/live/key")
    assert r.returncode == 2 and f"rtmp://127.0.0.1:{port}/live/key" in r.stderr


def test_an_rtmp_server_that_goes_away_ends_the_session(job_dir: Path, tmp_path: Path):
    """The server dies mid-session: exit 1 naming the URL, and the recording stays playable."""
    from tests.conftest import write_wav

    write_wav(job_dir / "speech.wav", 8.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"rtmp://127.0.0.1:{port}/live/key"
    server = subprocess.Popen([sys.executable, "-c", LISTENER, url], stdout=subprocess.PIPE, text=True)
    record = tmp_path / "rec.mp4"
    try:
        time.sleep(1.0)
        proc = start_avatar("render", str(job_dir / "job.yaml"), "-o", url, "--json", f"live.record={record}")
        for line in proc.stdout:  # the stream is paced: kill the server two chunks in
            if line.startswith(b'{"event": "chunk"') and json.loads(line)["published"] >= 32:
                server.kill()
                break
        code = proc.wait(timeout=120)
        err = proc.stderr.read().decode()
    finally:
        server.kill()
    assert code == 1, err
    assert url in err and "Traceback" not in err
    assert decode(record, fmt=None)[0] >= 32  # what was published is in the recording, which plays


def test_two_ranks_run_the_session_one_process_runs(rendered, tmp_path: Path):
    """Under torchrun rank 0 reads stdin and relays each chunk's audio: the session's frames are those of the same
    job rendered from the file on two ranks, bit for bit, and within the two-rank tolerance of one process's."""
    folder, one = rendered
    two_file = tmp_path / "two.mp4"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                "avatar_cli", "render", str(folder / "job.yaml"), "--json"]
    r = subprocess.run([*launcher, "-o", str(two_file)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    file_done = [e for e in events(r.stdout) if e["event"] == "done"][0]
    proc = subprocess.Popen([*launcher, "audio=-", "-o", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    out, err = proc.communicate((folder / "speech.wav").read_bytes(), timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    done = [e for e in events(err.decode()) if e["event"] == "done"][0]
    assert done["frames"] == file_done["frames"] == one["frames"]
    assert done["frames_digest"] == file_done["frames_digest"]
    video, _, _ = decode(out)
    assert video == one["frames"]


def test_wan_s2v_live_input_and_file_into_a_live_output(tmp_path: Path):
    """A live input renders with the live features (audio.LiveAudioFeatures: no whole audio to normalise over), the
    same frames whether the audio arrives at once or in pieces; a file into HLS renders in the streaming mode."""
    import threading

    from avatar_cli.families.registry import init_family_dir
    from tests.conftest import write_reference, write_wav

    init_family_dir(tmp_path / "wan", "tiny", seed=0, family="wan-s2v")
    write_reference(tmp_path / "ref.png")
    write_wav(tmp_path / "speech.wav", 2.0)
    # 64x64: what is tested (the features, the mode) does not depend on the frame size.
    (tmp_path / "job.yaml").write_text("reference: ref.png\naudio: speech.wav\noutput: out.mp4\nmodel: wan\n"
                                       "mode: streaming\nvideo: {width: 64, height: 64}\n")
    wav = (tmp_path / "speech.wav").read_bytes()
    digests = []
    for pieces in (1, 8):
        fifo = tmp_path / f"speech_{pieces}.fifo"
        os.mkfifo(fifo)

        def feed(fifo=fifo, pieces=pieces):
            with open(fifo, "wb") as f:
                step = -(-len(wav) // pieces)
                for k in range(0, len(wav), step):
                    f.write(wav[k:k + step])
                    f.flush()
                    time.sleep(0.05)

        threading.Thread(target=feed, daemon=True).start()
        r = avatar("render", str(tmp_path / "job.yaml"), f"audio={fifo}", "-o", str(tmp_path / f"live_{pieces}.mp4"),
                   "--json")
        assert r.returncode == 0, r.stderr
        done = events(r.stdout)[-1]
        assert done["event"] == "done" and done["frames"] == 32
        digests.append(done["frames_digest"])
    assert digests[0] == digests[1]
    r = avatar("render", str(tmp_path / "job.yaml"), "-o", str(tmp_path / "hls" / "live.m3u8"), "--json")
    assert r.returncode == 0, r.stderr
    done = events(r.stdout)[-1]
    assert done["event"] == "done" and decode(tmp_path / "hls" / "live.m3u8", fmt=None)[0] == done["frames"] == 32


PUBLISHER = textwrap.dedent("""
    import sys, time, wave, av, numpy as np
    url, path = sys.argv[1], sys.argv[2]
    with wave.open(path) as w:
        rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    deadline = time.time() + 60
    while True:  # until avatar listens
        try:
            out = av.open(url, "w", format="flv")
            stream = out.add_stream("aac", rate=rate, layout="mono")
            out.start_encoding()
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    for i in range(0, pcm.size, 1024):
        frame = av.AudioFrame.from_ndarray(pcm[None, i:i + 1024].copy(), format="s16", layout="mono")
        frame.sample_rate, frame.pts = rate, i
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode(None):
        out.mux(packet)
    out.close()
""")


def test_audio_pushed_over_rtmp(rendered, tmp_path: Path):
    """`audio: rtmp://...` listens; a publisher pushes AAC speech to it; the session renders what it received."""
    folder, done = rendered
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"rtmp://127.0.0.1:{port}/live/in"
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, url, str(folder / "speech.wav")],
                                 stderr=subprocess.PIPE, text=True)
    try:
        r = avatar("render", str(folder / "job.yaml"), f"audio={url}", "-o", str(tmp_path / "out.mp4"), "--json")
        assert publisher.wait(timeout=60) == 0, publisher.stderr.read()
    finally:
        publisher.kill()
    assert r.returncode == 0, r.stderr
    last = events(r.stdout)[-1]
    # AAC's priming and padding, and the listener losing the last packet at the hang-up: a frame or two either way.
    assert last["event"] == "done" and abs(last["frames"] - done["frames"]) <= 3
    assert decode(tmp_path / "out.mp4", fmt=None)[0] == last["frames"]


def test_a_full_disk_under_hls_is_exit_1(job_dir: Path, small_disk: Path):
    from tests.conftest import write_wav

    write_wav(job_dir / "long.wav", 60.0)
    playlist = small_disk / "live.m3u8"
    proc = start_avatar("render", str(job_dir / "job.yaml"), f"audio={job_dir / 'long.wav'}", "-o", str(playlist),
                        "--json", "live.hls_keep_segments=true", "live.realtime=false")
    try:
        for line in proc.stdout:  # a few segments out, then another process fills the disk
            if line.startswith(b'{"event": "chunk"') and json.loads(line)["published"] >= 100:
                break
        fill(small_disk)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err.decode()[-2000:]
    assert "disk full" in err.decode() and "Traceback" not in err.decode()


def test_validate_a_live_job(rendered):
    """validate checks a live job as far as it can before it runs: its length is unknown, its output a stream."""
    folder, _ = rendered
    r = avatar("validate", str(folder / "job.yaml"), "audio=-", "-o", "-", "--json")
    assert r.returncode == 0, r.stderr
    info = events(r.stdout)[-1]
    assert info["event"] == "valid" and info["audio"] == "-" and info["audio_s"] is None and info["frames"] is None
    bad = avatar("validate", str(folder / "job.yaml"), "audio=-", "-o", "-", "live.raw_audio.format=s24")
    assert bad.returncode == 2 and "live.raw_audio.format" in bad.stderr
    refused = avatar("validate", str(folder / "job.yaml"), "-o", "out.mp4", "live.preview=true")
    assert refused.returncode == 2 and "live.preview (--preview) serves an HLS output" in refused.stderr
