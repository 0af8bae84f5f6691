"""Pipeline benchmark (`make bench`): the demo settings on this machine, results to bench/results.md.

Each render runs in its own process (`avatar render --json`), so its peak RSS is its own. While
the long render runs, its RSS, open file descriptors and threads are sampled once a second: they
must stay flat. Figures are medians over repeats; ratios compare runs made in this same session.

    python bench/run.py [--short-s 30] [--long-s 600] [--repeats 3]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import wave
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "tmp"


def looped_speech(seconds: float, path: Path) -> Path:
    """The sample speech, repeated to the length asked for (written once, streamed by the renderer)."""
    with wave.open(str(ROOT / "sample_inputs" / "speech.wav")) as w:
        rate, data = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    n = int(seconds * rate)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        done = 0
        while done < n:
            piece = data[: n - done]
            out.writeframes(piece.tobytes())
            done += piece.size
    return path


def sample_process(pid: int, samples: list, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            samples.append({"t": time.time(), "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
                            "threads": int(fields["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd"))})
        except (FileNotFoundError, ProcessLookupError, KeyError):
            pass
        stop.wait(1.0)


def render(seconds: float, tag: str) -> dict:
    audio = looped_speech(seconds, WORK / f"speech_{int(seconds)}s.wav")
    out = WORK / f"{tag}.mp4"
    cmd = [sys.executable, "-m", "avatar_cli", "render", str(ROOT / "sample_inputs" / "job.yaml"),
           f"audio={audio}", "-o", str(out), "--force", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_process, args=(proc.pid, samples, stop), daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    stop.set()
    if proc.returncode != 0:
        raise SystemExit(f"render failed ({proc.returncode}): {stderr.strip().splitlines()[-1:]}")
    done = json.loads(stdout.strip().splitlines()[-1])
    done["compute_total_s"] = sum(done["compute_s"].values())
    done["overhead"] = done["generate_s"] / done["compute_total_s"] - 1
    done["samples"] = samples
    out.unlink(missing_ok=True)
    return done


def flatness(samples: list, key: str) -> tuple[float, float]:
    """Median of the first and last quarter of the samples taken after the first minute."""
    s = [x[key] for x in samples[60:]] or [x[key] for x in samples]
    q = max(1, len(s) // 4)
    return statistics.median(s[:q]), statistics.median(s[-q:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short-s", type=float, default=30.0)
    ap.add_argument("--long-s", type=float, default=600.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)

    shorts = [render(args.short_s, f"short{i}") for i in range(args.repeats)]
    long = render(args.long_s, "long")
    med = lambda key, runs=shorts: statistics.median(r[key] for r in runs)  # noqa: E731
    short_rss = med("peak_rss_mb")
    rss_first, rss_last = flatness(long["samples"], "rss_mb")
    fd_first, fd_last = flatness(long["samples"], "fds")
    th_first, th_last = flatness(long["samples"], "threads")

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    rows = [
        ("time to first frame (after models load)", f"{med('ttff_s'):.2f} s", "<= 2 s"),
        ("render fps (30 s clip)", f"{med('render_fps'):.1f}", ""),
        ("realtime factor (30 s clip)", f"{med('rtf'):.2f}x", ">= 1.0"),
        (f"realtime factor ({args.long_s:g} s render)", f"{long['rtf']:.2f}x", ">= 1.0"),
        ("pipeline overhead: generate wall / sum of model compute - 1 (30 s)", f"{100 * med('overhead'):.1f} %", "<= 10 %"),
        (f"pipeline overhead ({args.long_s:g} s render)", f"{100 * long['overhead']:.1f} %", "<= 10 %"),
        (f"peak RSS, {args.short_s:g} s render", f"{short_rss:.0f} MB", ""),
        (f"peak RSS, {args.long_s:g} s render", f"{long['peak_rss_mb']:.0f} MB", ""),
        ("peak RSS ratio long / short", f"{long['peak_rss_mb'] / short_rss:.3f}", "<= 1.05"),
        ("RSS during the long render, first vs last quarter (median)", f"{rss_first:.0f} -> {rss_last:.0f} MB", "flat"),
        ("open fds, first vs last quarter", f"{fd_first:.0f} -> {fd_last:.0f}", "no growth"),
        ("threads, first vs last quarter", f"{th_first:.0f} -> {th_last:.0f}", "no growth"),
    ]
    compute = {k: statistics.median(r["compute_s"][k] for r in shorts) for k in shorts[0]["compute_s"]}
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## Pipeline benchmark, {stamp}",
        "",
        f"- machine: {os.cpu_count()} cores, {cpu}; torch threads default; no GPU",
        f"- command: `python bench/run.py --short-s {args.short_s:g} --long-s {args.long_s:g} --repeats {args.repeats}`"
        + (" (= `make bench`)" if (args.short_s, args.long_s, args.repeats) == (30.0, 600.0, 3) else ""),
        f"- job: sample_inputs/job.yaml (model mini, {shorts[0]['video_fps']:g} fps, default chunking and sampling); "
        f"audio: sample speech looped; medians of {args.repeats} runs for the short clip",
        "",
        "| measure | value | target |",
        "| --- | --- | --- |",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        "Model compute per 30 s clip (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in compute.items()),
        "",
    ]
    results = ROOT / "bench" / "results.md"
    old = results.read_text() if results.exists() else "# Benchmark results\n\nNewest first.\n\n"
    head, _, rest = old.partition("\n## ")
    results.write_text(head.rstrip() + "\n\n" + "\n".join(lines) + ("\n## " + rest if rest else ""))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
