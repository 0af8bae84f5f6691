"""Live-session latency where the viewer is: the demo job as a session, a WAV on stdin paced at real time.

    python bench/live_latency.py [--seconds 60] [--outputs stdout rtmp hls] [--set KEY=VALUE ...] [--append]

For each output and length, `avatar render sample_inputs/job.yaml audio=- --json -o OUTPUT` runs in its own
process. From its `ready` event on, the sample speech (looped to the length) is written to its stdin in 20-ms
pieces at the wall clock's pace, as a microphone or a TTS engine would; each piece's send time is noted. A reader of
the output notes when each video frame reached it:
- stdout (`-o -`): every read of the pipe is timed as it returns (a player reads what has arrived); afterwards the
  captured MPEG-TS is demuxed and each video packet's byte position (`packet.pos`) is mapped to the read that
  brought its bytes;
- rtmp: a PyAV RTMP listener (`listen=1`) in a process of its own stands for the server; each video packet is
  timed as it is demuxed;
- hls: the playlist is polled every 20 ms; a segment's frames arrive when the playlist first lists the segment.

The latency of frame k is its arrival at the reader minus the send time of the audio it shows (sample k / fps *
rate of the WAV). Reported: median, 95th percentile and max over the frames, the first frame at the reader against
the first audio byte, the median of the last tenth of the frames against the first tenth (growth), the largest gap
between frame arrivals, and the session's own events (its chunk latency, to the frames handed to the output).
"""

import argparse
import bisect
import io
import json
import multiprocessing
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import wave
from datetime import datetime, timezone
from pathlib import Path

import av

from machine import describe
from run import ROOT, WORK, looped_speech, sample_process

PIECE_S = 0.02
POLL_S = 0.02


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _rtmp_listener(url: str, out: str, ready) -> None:
    """A stand-in RTMP server: accept one publisher, note when each video packet is demuxed (a process of its own:
    the listener blocks in FFmpeg until the publisher connects)."""
    ready.set()
    times = []
    with av.open(url, format="flv", options={"listen": "1", "timeout": "120", "probesize": "32768",
                                             "analyzeduration": "0", "fflags": "nobuffer"}) as c:
        try:
            for packet in c.demux(video=0):
                if packet.size:
                    times.append(time.monotonic())
        except av.error.FFmpegError:  # the publisher hung up: what arrived is counted
            pass
    Path(out).write_text(json.dumps(times))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _HlsWatch:
    """Polls a playlist; each segment's video packets arrive when the playlist first lists the segment."""

    def __init__(self, playlist: Path):
        self.playlist, self.seen, self.arrivals = playlist, set(), []
        self.stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            self.check()
            time.sleep(POLL_S)

    def check(self) -> None:
        try:
            text = self.playlist.read_text()
        except OSError:
            return
        t = time.monotonic()
        for name in re.findall(r"^[^#\s].*$", text, flags=re.M):
            if name in self.seen:
                continue
            self.seen.add(name)
            with av.open(str(self.playlist.parent / name)) as c:
                self.arrivals.extend(t for p in c.demux(video=0) if p.size)


def session(seconds: float, output: str = "stdout", overrides: tuple[str, ...] = ()) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    wav = looped_speech(seconds, WORK / f"live_{int(seconds)}s.wav")
    with wave.open(str(wav)) as w:
        rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    header = wav.read_bytes()[:44]
    listener, times_file = None, WORK / "rtmp_times.json"
    if output == "stdout":
        target = "-"
    elif output == "rtmp":
        target = f"rtmp://127.0.0.1:{_free_port()}/live/k"
        times_file.unlink(missing_ok=True)
        started = multiprocessing.get_context("spawn").Event()
        listener = multiprocessing.get_context("spawn").Process(target=_rtmp_listener,
                                                                 args=(target, str(times_file), started))
        listener.start()
        started.wait(60)
        time.sleep(1.0)  # the listener's socket is bound once av.open has started
    else:
        folder = WORK / "hls"
        folder.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            f.unlink()
        target = str(folder / "live.m3u8")
    cmd = [sys.executable, "-m", "avatar_cli", "render", str(ROOT / "sample_inputs" / "job.yaml"), "audio=-",
           "-o", target, "--json", "--force", *overrides]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reads: list[tuple[int, float, bytes]] = []

    def drain():  # as a player reads a pipe: what has arrived, at once
        total = 0
        while data := os.read(proc.stdout.fileno(), 1 << 16):
            total += len(data)
            reads.append((total, time.monotonic(), data))

    if output == "stdout":  # the stream is stdout, the events go to stderr; else the events are on stdout
        threading.Thread(target=drain, daemon=True).start()
    events: list[dict] = []
    log: list[str] = []
    ready = threading.Event()

    def read_events():
        for line in proc.stderr if output == "stdout" else proc.stdout:
            if not line.startswith(b"{"):
                log.append(line.decode(errors="replace"))
            else:
                e = json.loads(line)
                events.append(e)
                if e["event"] == "ready":
                    ready.set()

    threading.Thread(target=read_events, daemon=True).start()
    if output != "stdout":
        threading.Thread(target=lambda: [log.append(line.decode(errors="replace")) for line in proc.stderr],
                         daemon=True).start()
    samples: list[dict] = []
    stop = threading.Event()
    threading.Thread(target=sample_process, args=(proc.pid, samples, stop), daemon=True).start()
    if not ready.wait(120):
        proc.kill()
        raise SystemExit(f"no ready event: {''.join(log[-20:])}")
    hls = _HlsWatch(Path(target)) if output == "hls" else None
    piece = int(PIECE_S * rate) * 2
    sent: list[tuple[int, float]] = []  # (samples written so far, when that write returned)
    t0 = time.monotonic()
    proc.stdin.write(header)
    proc.stdin.flush()
    first_byte = time.monotonic()
    for i, k in enumerate(range(0, len(pcm), piece)):
        wait = t0 + i * PIECE_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        proc.stdin.write(pcm[k:k + piece])
        proc.stdin.flush()
        sent.append(((k + len(pcm[k:k + piece])) // 2, time.monotonic()))
    proc.stdin.close()
    code = proc.wait()
    stop.set()
    time.sleep(0.2)
    if code != 0:
        raise SystemExit(f"session failed ({code}): {events[-1:]}")
    if output == "stdout":
        ends = [n for n, _, _ in reads]
        with av.open(io.BytesIO(b"".join(d for _, _, d in reads)), format="mpegts") as c:
            positions = [p.pos for p in c.demux(video=0) if p.size and p.pos is not None and p.pos >= 0]
        arrivals = [reads[bisect.bisect_right(ends, pos)][1] for pos in positions]
    elif output == "rtmp":
        listener.join(60)
        arrivals = json.loads(times_file.read_text())
    else:
        hls.stop.set()
        hls.check()
        arrivals = hls.arrivals
    done = [e for e in events if e["event"] == "done"][0]
    fps = done["video_fps"]
    counts = [n for n, _ in sent]

    def audio_sent(k: int) -> float:  # when the WAV writer sent sample k / fps * rate
        s = int(k / fps * rate)
        return sent[min(len(sent) - 1, bisect.bisect_right(counts, s))][1]

    speech_frames = int(len(pcm) // 2 / rate * fps)
    lat = [a - audio_sent(k) for k, a in enumerate(arrivals[:speech_frames])]
    (WORK / f"latency_{output}.json").write_text(json.dumps({"frames": lat, "events": events}))
    tenth = max(1, len(lat) // 10)
    chunk_lat = [e["latency_s"] for e in events if e["event"] == "chunk" and e.get("latency_s") is not None]
    return {"output": output, "seconds": seconds, "frames": done["frames"], "frames_read": len(arrivals),
            "first_frame_s": arrivals[0] - first_byte, "latency_median_s": statistics.median(lat),
            "latency_p95_s": _percentile(lat, 0.95), "latency_max_s": max(lat),
            "first_tenth_median_s": statistics.median(lat[:tenth]),
            "last_tenth_median_s": statistics.median(lat[-tenth:]),
            "largest_gap_s": max((b - a for a, b in zip(arrivals, arrivals[1:])), default=0.0),
            "events_first_frame_s": done["first_frame_s"], "events_latency_median_s": done["latency_median_s"],
            "events_latency_p95_s": done["latency_p95_s"], "chunks": len(chunk_lat), "stalls": done["stalls"],
            "peak_rss_mb": done["peak_rss_mb"],
            "sampled_peak_rss_mb": max((s["rss_mb"] for s in samples), default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, nargs="+", default=[60])
    ap.add_argument("--outputs", nargs="+", default=["stdout", "rtmp", "hls"], choices=["stdout", "rtmp", "hls"])
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="job overrides for every session")
    ap.add_argument("--append", action="store_true", help="add the results to bench/results.md")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    machine = describe()
    started = datetime.now(timezone.utc)
    load = os.getloadavg()
    results = [session(s, o, tuple(args.set)) for s in args.seconds for o in args.outputs]
    for r in results:
        print(json.dumps(r))
    rows = ["| output | session | first frame at the reader | median | p95 | max | first / last tenth (median) | "
            "largest gap | session's events: first frame, median | stalls |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['output']} | {r['seconds']:.0f} s ({r['frames_read']} frames) | {r['first_frame_s']:.2f} s | "
                    f"{r['latency_median_s']:.2f} s | {r['latency_p95_s']:.2f} s | {r['latency_max_s']:.2f} s | "
                    f"{r['first_tenth_median_s']:.2f} / {r['last_tenth_median_s']:.2f} s | "
                    f"{r['largest_gap_s']:.2f} s | {r['events_first_frame_s']:.2f} s, "
                    f"{r['events_latency_median_s']:.2f} s | {r['stalls']} |")
    sets = "".join(f" --set {s}" for s in args.set)
    text = "\n".join([
        f"## Live sessions: latency at the reader, {started:%Y-%m-%d %H:%M} UTC", "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch capability {machine['torch_capability']}; "
        f"load average at the start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min). "
        f"Command: `python bench/live_latency.py --seconds {' '.join(f'{s:g}' for s in args.seconds)} --outputs "
        f"{' '.join(args.outputs)}{sets}`: the demo job (mini, 256 x 256, 25 fps) as a session, `audio=-`, the "
        "sample speech looped to the length and written to stdin in 20-ms pieces at the wall clock's pace from the "
        "`ready` event on. Frame k's latency: its arrival at the reader (stdout: the pipe's read that brought its "
        "bytes; rtmp: demuxed by a PyAV listener; hls: its segment first listed in the playlist, polled every "
        "20 ms) minus the send time of sample k / fps * rate; first frame: against the first audio byte.", "",
        *rows, ""])
    print(text)
    if args.append:
        path = ROOT / "bench" / "results.md"
        old = path.read_text()
        at = old.index("\n## ") + 1  # above the newest section
        path.write_text(old[:at] + text + "\n" + old[at:])


if __name__ == "__main__":
    main()
