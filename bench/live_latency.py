"""Live-session latency on this machine: the demo job as a session, a WAV on stdin paced at real time, `-o -`.

    python bench/live_latency.py [--seconds 60 600] [--append]

For each length, `avatar render sample_inputs/job.yaml audio=- -o - --json` runs in its own process. From its
`ready` event on, the sample speech (looped to the length) is written to its stdin in 20-ms pieces at the wall
clock's pace, as a microphone or a TTS engine would; its stdout (the MPEG-TS stream) is read and counted. Reported
from the session's own events: the time from the first audio sample in to the first frame out, each chunk's latency
(its last audio sample in -> its frames handed to the output), their median and 95th percentile, the latency of the
last tenth of the session against the first tenth (growth), and peak RSS; the ratio of the long session's peak RSS
to the short one's. The process's RSS is also sampled once a second.
"""

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import wave
from datetime import datetime, timezone
from pathlib import Path

from machine import describe
from run import ROOT, WORK, looped_speech, sample_process

PIECE_S = 0.02


def session(seconds: float, overrides: tuple[str, ...] = ()) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    wav = looped_speech(seconds, WORK / f"live_{int(seconds)}s.wav")
    with wave.open(str(wav)) as w:
        rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    header = wav.read_bytes()[:44]
    cmd = [sys.executable, "-m", "avatar_cli", "render", str(ROOT / "sample_inputs" / "job.yaml"), "audio=-",
           "-o", "-", "--json", *overrides]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stream_bytes = [0]

    def drain():
        for block in iter(lambda: proc.stdout.read(1 << 16), b""):
            stream_bytes[0] += len(block)

    threading.Thread(target=drain, daemon=True).start()
    events: list[dict] = []
    ready = threading.Event()

    def read_events():
        for line in proc.stderr:
            if line.startswith(b"{"):
                e = json.loads(line)
                e["_t"] = time.monotonic()
                events.append(e)
                if e["event"] == "ready":
                    ready.set()

    threading.Thread(target=read_events, daemon=True).start()
    samples: list[dict] = []
    stop = threading.Event()
    threading.Thread(target=sample_process, args=(proc.pid, samples, stop), daemon=True).start()
    if not ready.wait(120):
        proc.kill()
        raise SystemExit(f"no ready event: {events}")
    piece = int(PIECE_S * rate) * 2
    t0 = time.monotonic()
    proc.stdin.write(header)
    for i, k in enumerate(range(0, len(pcm), piece)):
        wait = t0 + i * PIECE_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        proc.stdin.write(pcm[k:k + piece])
        proc.stdin.flush()
    proc.stdin.close()
    code = proc.wait()
    stop.set()
    time.sleep(0.2)
    if code != 0:
        raise SystemExit(f"session failed ({code}): {events[-1:]}")
    done = [e for e in events if e["event"] == "done"][0]
    lat = [e["latency_s"] for e in events if e["event"] == "chunk" and e.get("latency_s") is not None]
    tenth = max(1, len(lat) // 10)
    return {"seconds": seconds, "frames": done["frames"], "first_frame_s": done["first_frame_s"],
            "latency_median_s": statistics.median(lat), "latency_p95_s": done["latency_p95_s"],
            "latency_max_s": max(lat), "first_tenth_median_s": statistics.median(lat[:tenth]),
            "last_tenth_median_s": statistics.median(lat[-tenth:]), "chunks": len(lat),
            "stalls": done["stalls"], "peak_rss_mb": done["peak_rss_mb"],
            "sampled_peak_rss_mb": max((s["rss_mb"] for s in samples), default=0.0),
            "stream_mb": stream_bytes[0] / 2**20,
            "warnings": sorted({e.get("realtime_factor", "latency") for e in events if e["event"] == "warning"},
                               key=str)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, nargs="+", default=[60, 600])
    ap.add_argument("--append", action="store_true", help="add the results to bench/results.md")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    machine = describe()
    started = datetime.now(timezone.utc)
    results = [session(s) for s in args.seconds]
    for r in results:
        print(json.dumps(r))
    rows = ["| session | first frame out | latency median | p95 | max | first tenth / last tenth (median) | "
            "peak RSS | stalls |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['seconds']:.0f} s ({r['chunks']} chunks) | {r['first_frame_s']:.2f} s | "
                    f"{r['latency_median_s']:.2f} s | {r['latency_p95_s']:.2f} s | {r['latency_max_s']:.2f} s | "
                    f"{r['first_tenth_median_s']:.2f} / {r['last_tenth_median_s']:.2f} s | "
                    f"{r['peak_rss_mb']:.0f} MB | {r['stalls']} |")
    ratio = results[-1]["peak_rss_mb"] / results[0]["peak_rss_mb"] if len(results) > 1 else None
    text = "\n".join([
        f"## Live sessions: latency and memory, {started:%Y-%m-%d %H:%M} UTC", "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch capability {machine['torch_capability']}. "
        f"Command: `python bench/live_latency.py --seconds {' '.join(f'{s:g}' for s in args.seconds)}`: the demo "
        "job (mini, 256 x 256, 25 fps) as a session, `audio=- -o -`, the sample speech looped to the length and "
        "written to stdin at the wall clock's pace from the `ready` event on; figures from the session's events.", "",
        *rows, "",
        *([f"Peak RSS of the {results[-1]['seconds']:.0f}-s session / the {results[0]['seconds']:.0f}-s one: "
           f"{ratio:.3f}."] if ratio else []), ""])
    print(text)
    if args.append:
        path = ROOT / "bench" / "results.md"
        old = path.read_text()
        at = old.index("\n## ") + 1  # above the newest section
        path.write_text(old[:at] + text + "\n" + old[at:])


if __name__ == "__main__":
    main()
