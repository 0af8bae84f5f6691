"""Live-session latency where the viewer is: the demo job as a session, a WAV on stdin paced at real time.

    python bench/live_latency.py [--seconds 60] [--outputs stdout rtmp hls] [--set KEY=VALUE ...] [--append]
    python bench/live_latency.py --outputs-only [--seconds 20] [--outputs stdout rtmp hls] [--hls-segment-s 0.5]
    python bench/live_latency.py --seconds 12 --outputs stdout rtmp --pause 6:4 [--pause AT:SECONDS ...] [--pace 0.5]

For each output and length, `avatar render sample_inputs/job.yaml audio=- --json -o OUTPUT` runs in its own
process. From its `ready` event on, the sample speech (looped to the length) is written to its stdin in 20-ms
pieces at the wall clock's pace, as a microphone or a TTS engine would; each piece's send time is noted. A reader of
the output notes when each video frame reached it:
- stdout (`-o -`): every read of the pipe is timed as it returns (a player reads what has arrived); afterwards the
  captured MPEG-TS is demuxed and each video packet's byte position (`packet.pos`) is mapped to the read that
  brought its bytes;
- rtmp: a PyAV RTMP listener (`listen=1`) in a process of its own stands for the server, reading as a low-delay
  player does (the smallest probe, `probesize` 32 and `analyzeduration` 0, so the packets it reads while probing
  are handed on at once; `fflags nobuffer` would drop them instead); each video packet is timed as it is demuxed;
- hls: the playlist is polled every 20 ms; a segment's frames arrive when the playlist first lists the segment;
- whip: the tests' WHIP endpoint (tests/whip_endpoint.py, an aiortc peer in a process of its own)
  notes when each video frame is decoded (the monotonic clock is the machine's, the same in both processes).

A frame is known by its timestamp (pts * fps), not by its place among the packets read, so a reader that misses
frames (a probe that drops them) cannot shift the later ones' latencies; frames that never arrived are counted.
The latency of frame k is its arrival at the reader minus the send time of the audio it shows (sample k / fps *
rate of the WAV). Where stdout ran in the same invocation, each other output's median is also given less
stdout's: what that output's muxer, protocol and reader add over a pipe.

`--outputs-only` leaves the model out: frames are put into a LiveWriter (media/live.py) on the frame clock, one at
its time, as the renderer hands them over, and frame k's latency is its arrival at the reader minus its put. That
is what stands between the renderer and the viewer (encoder, muxer, packetisation, pipe or socket, HLS segments),
light enough to measure on a loaded machine. Reported: median, 95th percentile and max over the frames, the first frame at the reader against
the first audio byte, the median of the last tenth of the frames against the first tenth (growth), the largest gap
between frame arrivals, and the session's own events (its chunk latency, to the frames handed to the output).

`--pause AT:SECONDS` makes the source fall silent: the writer stops sending when it reaches AT seconds of the
speech and goes on SECONDS later (a speaker who pauses, a TTS engine that stalls). Such a run reports what a viewer
sees of the pause: the largest gap between frame arrivals at the reader (the frame clock's promise: at most
`live.stall_s` + 0.5 s), the stalls, the silence the session inserted (the stream's length less the speech), and the
latency of the frames before the first pause. `--pace 0.5` sends at half the speaker's pace (a source that
trickles), reported the same way.
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

sys.path.insert(0, str(ROOT))  # tests/whip_endpoint.py, the WHIP reader

PIECE_S = 0.02
POLL_S = 0.02


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# A low-delay player's read of a live stream: the smallest probe, whose packets are kept and handed on (with
# `fflags nobuffer` FFmpeg drops the packets it read while probing: a 32-KB probe of this stream is over a second
# of frames, lost).
PLAYER_OPTIONS = {"probesize": "32", "analyzeduration": "0"}


def _by_frame(arrivals: list[tuple[float, float]], fps: float, origin: float | None = None) -> dict[int, float]:
    """{frame index: its first arrival} from (pts in seconds, arrival) pairs. `origin` is frame 0's pts: FLV's
    timestamps start at 0; MPEG-TS's at the muxer's offset, which the earliest packet of a whole capture gives."""
    if origin is None:
        origin = min((pts for pts, _ in arrivals), default=0.0)
    out: dict[int, float] = {}
    for pts, t in arrivals:
        out.setdefault(round((pts - origin) * fps), t)
    return out


def _rtmp_listener(url: str, out: str, ready) -> None:
    """A stand-in RTMP server: accept one publisher, note when each video packet is demuxed, with its pts (a
    process of its own: the listener blocks in FFmpeg until the publisher connects)."""
    ready.set()
    times = []
    with av.open(url, format="flv", options={"listen": "1", "timeout": "120", **PLAYER_OPTIONS}) as c:
        try:
            for packet in c.demux(video=0):
                if packet.size and packet.pts is not None:
                    times.append((float(packet.pts * packet.time_base), time.monotonic()))
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
        self.playlist, self.seen, self.arrivals = playlist, set(), []  # arrivals: (pts in seconds, listed at)
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Stop polling (the poll in progress completes its segment) and read the playlist once more."""
        self.stop.set()
        self._thread.join()
        self.check()

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
                self.arrivals.extend((float(p.pts * p.time_base), t) for p in c.demux(video=0)
                                     if p.size and p.pts is not None)


class _Reader:
    """A reader of one output: `target` is what avatar writes to; `start()` once the writer is about to write,
    `arrivals(fps)` afterwards: {frame index: when the reader had it}."""

    def __init__(self, output: str):
        self.output, self.reads, self.hls, self.listener, self.peer = output, [], None, None, None
        self.times_file = WORK / "rtmp_times.json"
        if output == "stdout":
            self.target = "-"
        elif output == "whip":
            from tests.whip_endpoint import WhipPeer  # noqa: PLC0415 (aiortc: the whip extra)

            self.peer = WhipPeer()
            self.target = self.peer.url
        elif output == "rtmp":
            self.target = f"rtmp://127.0.0.1:{_free_port()}/live/k"
            self.times_file.unlink(missing_ok=True)
            started = multiprocessing.get_context("spawn").Event()
            self.listener = multiprocessing.get_context("spawn").Process(
                target=_rtmp_listener, args=(self.target, str(self.times_file), started))
            self.listener.start()
            started.wait(60)
            time.sleep(1.0)  # the listener's socket is bound once av.open has started
        else:
            folder = WORK / "hls"
            folder.mkdir(parents=True, exist_ok=True)
            for f in folder.iterdir():
                f.unlink()
            self.target = str(folder / "live.m3u8")

    def drain(self, fd: int) -> None:
        """As a player reads a pipe: what has arrived, at once (a thread of its own)."""
        def read():
            total = 0
            while data := os.read(fd, 1 << 16):
                total += len(data)
                self.reads.append((total, time.monotonic(), data))

        threading.Thread(target=read, daemon=True).start()

    def start(self) -> None:
        if self.output == "hls":
            self.hls = _HlsWatch(Path(self.target))

    def arrivals(self, fps: float) -> dict[int, float]:
        if self.output == "stdout":  # each video packet's bytes: the read that brought them
            ends = [n for n, _, _ in self.reads]
            with av.open(io.BytesIO(b"".join(d for _, _, d in self.reads)), format="mpegts") as c:
                packets = [(float(p.pts * p.time_base), p.pos) for p in c.demux(video=0)
                           if p.size and p.pts is not None and p.pos is not None and p.pos >= 0]
            return _by_frame([(pts, self.reads[bisect.bisect_right(ends, pos)][1]) for pts, pos in packets], fps)
        if self.output == "whip":
            time.sleep(0.5)  # the last packets' way to the peer
            report = self.peer.report()
            self.peer.close()
            return _by_frame(list(zip(report["video_times"], report["video_arrivals"])), fps)
        if self.output == "rtmp":
            self.listener.join(60)
            return _by_frame(json.loads(self.times_file.read_text()), fps, origin=0.0)
        self.hls.finish()
        return _by_frame(self.hls.arrivals, fps)


def _figures(output: str, arrived: dict[int, float], due: list[float], start: float) -> dict:
    """Latency of each frame that arrived (its arrival less `due[k]`), the first frame's against `start`, the
    frames that never arrived, growth and the largest gap."""
    ks = sorted(k for k in arrived if 0 <= k < len(due))
    lat = [arrived[k] - due[k] for k in ks]
    times = [arrived[k] for k in ks]
    tenth = max(1, len(lat) // 10)
    return {"output": output, "frames_read": len(ks), "frames_missing": len(due) - len(ks),
            "first_frame_s": min(times) - start, "latency_median_s": statistics.median(lat),
            "latency_p95_s": _percentile(lat, 0.95), "latency_max_s": max(lat),
            "first_tenth_median_s": statistics.median(lat[:tenth]),
            "last_tenth_median_s": statistics.median(lat[-tenth:]),
            "largest_gap_s": max((b - a for a, b in zip(times, times[1:])), default=0.0)}


def session(seconds: float, output: str = "stdout", overrides: tuple[str, ...] = (),
            pauses: tuple[tuple[float, float], ...] = (), pace: float = 1.0) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    wav = looped_speech(seconds, WORK / f"live_{int(seconds)}s.wav")
    with wave.open(str(wav)) as w:
        rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    header = wav.read_bytes()[:44]
    reader = _Reader(output)
    cmd = [sys.executable, "-m", "avatar_cli", "render", str(ROOT / "sample_inputs" / "job.yaml"), "audio=-",
           "-o", reader.target, "--json", "--force", *overrides]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if output == "stdout":  # the stream is stdout, the events go to stderr; else the events are on stdout
        reader.drain(proc.stdout.fileno())
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
    reader.start()
    piece = int(PIECE_S * rate) * 2
    sent: list[tuple[int, float]] = []  # (samples written so far, when that write returned)
    t0 = time.monotonic()
    proc.stdin.write(header)
    proc.stdin.flush()
    first_byte = time.monotonic()
    to_pause, paused = sorted(pauses), 0.0
    for i, k in enumerate(range(0, len(pcm), piece)):
        if to_pause and k // 2 >= to_pause[0][0] * rate:  # the source falls silent here
            paused += to_pause.pop(0)[1]
        wait = t0 + paused + i * PIECE_S / pace - time.monotonic()
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
    done = [e for e in events if e["event"] == "done"][0]
    fps = done["video_fps"]
    arrived = reader.arrivals(fps)
    counts = [n for n, _ in sent]

    def audio_sent(k: int) -> float:  # when the WAV writer sent sample k / fps * rate
        s = int(k / fps * rate)
        return sent[min(len(sent) - 1, bisect.bisect_right(counts, s))][1]

    speech_s = len(pcm) // 2 / rate
    # With pauses, frame k after the first shows inserted silence or speech moved by it: latency is counted before.
    due = [audio_sent(k) for k in range(int(min([speech_s, *(at for at, _ in pauses)]) * fps))]
    figures = _figures(output, arrived, due, first_byte)
    if pauses or pace != 1.0:
        times = [arrived[k] for k in sorted(arrived)]
        figures.update(pauses=list(pauses), pace=pace, speech_s=speech_s, silence_s=done["frames"] / fps - speech_s,
                       frames_read=len(arrived), frames_missing=done["frames"] - len(arrived),
                       largest_gap_s=max(b - a for a, b in zip(times, times[1:])))
    (WORK / f"latency_{output}.json").write_text(json.dumps({"arrived": sorted(arrived.items()), "due": due,
                                                             "events": events}))
    chunk_lat = [e["latency_s"] for e in events if e["event"] == "chunk" and e.get("latency_s") is not None]
    return {**figures, "seconds": seconds, "frames": done["frames"],
            "events_first_frame_s": done["first_frame_s"], "events_latency_median_s": done["latency_median_s"],
            "events_latency_p95_s": done["latency_p95_s"], "chunks": len(chunk_lat), "stalls": done["stalls"],
            "peak_rss_mb": done["peak_rss_mb"],
            "sampled_peak_rss_mb": max((s["rss_mb"] for s in samples), default=0.0)}


def outputs_only(seconds: float, output: str, hls_segment_s: float | None = None, fps: int = 25,
                 size: int = 256) -> dict:
    """The output alone (module docstring): frames put into a LiveWriter one at its time, frame k's latency its
    arrival at the reader less its put. The frames are a moving gradient, about as costly to encode as a face."""
    import numpy as np  # noqa: PLC0415

    from avatar_cli.media.live import live_target  # noqa: PLC0415
    from avatar_cli.media.whip import live_writer  # noqa: PLC0415

    class Tone:  # an AudioFeed: the track's cost, without a file
        rate, channels, taken = 16000, 1, 0

        def take(self, n: int):
            t = (self.taken + np.arange(n)) / self.rate
            self.taken += n
            return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)[None]  # (1, n)

        def close(self) -> None:
            pass

    WORK.mkdir(parents=True, exist_ok=True)
    reader = _Reader(output)
    stdout = None
    if output == "stdout":
        r, w = os.pipe()
        reader.drain(r)
        stdout = os.fdopen(w, "wb", buffering=0)
    kw = {} if hls_segment_s is None else {"hls_segment_s": hls_segment_s}
    writer = live_writer(live_target(reader.target, **kw), width=size, height=size, fps=fps, audio_path=Tone(),
                         realtime=True, stdout=stdout)
    yy, xx = np.mgrid[0:size, 0:size]
    base = np.stack([(xx + yy) % 256, xx % 256, yy % 256], -1).astype(np.uint8)  # (H, W, 3)
    reader.start()
    n = int(seconds * fps)
    put: list[float] = []
    t0 = time.monotonic()
    for k in range(n):
        wait = t0 + k / fps - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        put.append(time.monotonic())
        writer.put(np.roll(base, 2 * k, axis=1)[None])  # (1, H, W, 3)
    writer.close()
    if stdout is not None:
        stdout.close()
        time.sleep(0.2)  # the drain's last read
    return {**_figures(output, reader.arrivals(fps), put, put[0]), "seconds": seconds, "frames": n,
            "hls_segment_s": hls_segment_s}


def _less_stdout(results: list[dict]) -> None:
    """Each output's median less stdout's of the same length, where stdout ran too."""
    pipe = {r["seconds"]: r["latency_median_s"] for r in results if r["output"] == "stdout"}
    for r in results:
        if r["seconds"] in pipe:
            r["median_less_stdout_s"] = r["latency_median_s"] - pipe[r["seconds"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, nargs="+", default=None, help="session lengths (default 60; 20 with "
                                                                            "--outputs-only)")
    ap.add_argument("--outputs", nargs="+", default=["stdout", "rtmp", "hls"],
                    choices=["stdout", "rtmp", "hls", "whip"])
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="job overrides for every session")
    ap.add_argument("--outputs-only", action="store_true", help="no model: frames into a LiveWriter at their time")
    ap.add_argument("--hls-segment-s", type=float, default=None, help="with --outputs-only: HLS segment length")
    ap.add_argument("--pause", action="append", default=[], metavar="AT:SECONDS",
                    help="the source falls silent at AT seconds of its speech for SECONDS (repeatable)")
    ap.add_argument("--pace", type=float, default=1.0,
                    help="the source sends at this times the speaker's pace (0.5: it trickles at half)")
    ap.add_argument("--append", action="store_true", help="add the results to bench/results.md")
    args = ap.parse_args()
    pauses = tuple(tuple(float(x) for x in p.split(":")) for p in args.pause)
    pace = args.pace
    seconds = args.seconds or ([20] if args.outputs_only else [60])
    WORK.mkdir(parents=True, exist_ok=True)
    machine = describe()
    started = datetime.now(timezone.utc)
    load = os.getloadavg()
    if args.outputs_only:
        results = [outputs_only(s, o, args.hls_segment_s) for s in seconds for o in args.outputs]
    else:
        results = [session(s, o, tuple(args.set), pauses, pace) for s in seconds for o in args.outputs]
    _less_stdout(results)
    for r in results:
        print(json.dumps(r))

    def less(r: dict) -> str:
        return f"{r['median_less_stdout_s']:+.2f} s" if "median_less_stdout_s" in r else ""

    if pauses or pace != 1.0:
        stall_s = next((float(v.split("=")[1]) for v in args.set if v.startswith("live.stall_s=")), 1.0)
        rows = ["| output | speech | source's pace | pauses (at: length) | frames read (missing) | stalls | silence inserted | "
                "largest gap between frames | limit (stall_s + 0.5 s) | median latency before the first pause |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        rows += [f"| {r['output']} | {r['speech_s']:.1f} s | x{r['pace']:g} | "
                 + (", ".join(f"{at:g} s: {n:g} s" for at, n in r["pauses"]) or "none")
                 + f" | {r['frames_read']} ({r['frames_missing']}) | {r['stalls']} | {r['silence_s']:.2f} s | "
                 f"{r['largest_gap_s']:.2f} s | {stall_s + 0.5:.2f} s | "
                 + (f"{r['latency_median_s']:.2f} s |" if r["pace"] == 1.0 else "(the source is late) |")
                 for r in results]
        what = ("the demo job (mini, 256 x 256, 25 fps) as a session, `audio=-`, the sample speech written to stdin "
                "in 20-ms pieces at the wall clock's pace (times the source's pace) from the `ready` event on, the "
                "writer silent for each pause; the gap: between consecutive frames' arrivals at the reader")
    elif args.outputs_only:
        rows = ["| output | frames read / put | first frame | median | p95 | max | median less stdout's | "
                "largest gap |", "|---|---|---|---|---|---|---|---|"]
        rows += [f"| {r['output']} | {r['frames_read']} / {r['frames']} | {r['first_frame_s']:.2f} s | "
                 f"{r['latency_median_s']:.3f} s | {r['latency_p95_s']:.3f} s | {r['latency_max_s']:.3f} s | "
                 f"{less(r)} | {r['largest_gap_s']:.2f} s |" for r in results]
        what = ("the outputs alone: frames (256 x 256, 25 fps, a moving gradient, a tone) put into a LiveWriter one "
                "at its time; frame k's latency: its arrival at the reader (as below) minus its put"
                + (f"; HLS segments of {args.hls_segment_s:g} s" if args.hls_segment_s else ""))
    else:
        rows = ["| output | session | frames read (missing) | first frame at the reader | median | p95 | max | "
                "median less stdout's | first / last tenth (median) | largest gap | session's events: first frame, "
                "median | stalls |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        rows += [f"| {r['output']} | {r['seconds']:.0f} s | {r['frames_read']} ({r['frames_missing']}) | "
                 f"{r['first_frame_s']:.2f} s | {r['latency_median_s']:.2f} s | {r['latency_p95_s']:.2f} s | "
                 f"{r['latency_max_s']:.2f} s | {less(r)} | "
                 f"{r['first_tenth_median_s']:.2f} / {r['last_tenth_median_s']:.2f} s | "
                 f"{r['largest_gap_s']:.2f} s | {r['events_first_frame_s']:.2f} s, "
                 f"{r['events_latency_median_s']:.2f} s | {r['stalls']} |" for r in results]
        what = ("the demo job (mini, 256 x 256, 25 fps) as a session, `audio=-`, the sample speech looped to the "
                "length and written to stdin in 20-ms pieces at the wall clock's pace from the `ready` event on. "
                "Frame k's latency: its arrival at the reader minus the send time of sample k / fps * rate; first "
                "frame: against the first audio byte")
    sets = "".join(f" --set {s}" for s in args.set)
    flags = (" --outputs-only" if args.outputs_only else "") + \
        (f" --hls-segment-s {args.hls_segment_s:g}" if args.hls_segment_s else "") + \
        "".join(f" --pause {p}" for p in args.pause) + (f" --pace {pace:g}" if pace != 1.0 else "")
    text = "\n".join([
        f"## Live sessions: latency at the reader, {started:%Y-%m-%d %H:%M} UTC", "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch capability {machine['torch_capability']}; "
        f"load average at the start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min). "
        f"Command: `python bench/live_latency.py{flags} --seconds {' '.join(f'{s:g}' for s in seconds)} --outputs "
        f"{' '.join(args.outputs)}{sets}`: {what}. Readers: stdout, the pipe's read that brought a frame's bytes; "
        "rtmp, demuxed by a PyAV listener reading as a low-delay player (probesize 32, analyzeduration 0); hls, its "
        "segment first listed in the playlist, polled every 20 ms; whip, decoded by the tests' aiortc endpoint. "
        "Frames are known by their timestamps.", "",
        *rows, ""])
    print(text)
    if args.append:
        path = ROOT / "bench" / "results.md"
        old = path.read_text()
        at = old.index("\n## ") + 1  # above the newest section
        path.write_text(old[:at] + text + "\n" + old[at:])


if __name__ == "__main__":
    main()
