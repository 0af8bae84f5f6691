"""Memory soak (`make soak`): one long render, RSS sampled every 10 s, must stay flat.

The render runs in its own process (`avatar render --json`); a thread reads its chunk events to know how
much video exists at each RSS sample, so the slope is in MB per 10 minutes of video, whatever the speed.
Pass: over the second half of the video, RSS grows by at most 1 MB per 10 minutes of video. The slope is the
Theil-Sen estimate (the median of the slopes between every pair of samples): a sample that lands on a chunk's
transient buffers (+8 MB for a moment) moves a least-squares line but not the median; both are reported. Writes a section to bench/results.md and the curve to bench/soak_rss.png.

    python bench/soak.py [--video-min 30] [--every-s 10] [KEY=VALUE ...]
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from machine import describe
from run import ROOT, WORK, looped_speech

LIMIT_MB_PER_10MIN = 1.0


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


def second_half_slopes(video_min: np.ndarray, rss: np.ndarray) -> tuple[float, float, float]:
    """MB per 10 minutes of video over the second half of the video: (Theil-Sen slope, its intercept, the
    least-squares slope)."""
    half = video_min >= video_min.max() / 2
    if half.sum() < 3:
        raise SystemExit("soak: too few samples in the second half; render longer or sample more often")
    x, y = video_min[half], rss[half]
    i, j = np.triu_indices(len(x), k=1)
    ok = x[j] != x[i]
    slope = float(np.median((y[j] - y[i])[ok] / (x[j] - x[i])[ok]))  # MB per minute of video
    intercept = float(np.median(y - slope * x))
    return 10.0 * slope, intercept, 10.0 * float(np.polyfit(x, y, 1)[0])


def plot(video_min: np.ndarray, rss: np.ndarray, slope: float, intercept: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    ax.plot(video_min, rss, lw=1.2)
    half = video_min >= video_min.max() / 2
    ax.plot(video_min[half], intercept + slope / 10.0 * video_min[half], "--", lw=1,
            label=f"second half: {slope:+.2f} MB per 10 min of video (limit {LIMIT_MB_PER_10MIN:g})")
    ax.set_xlabel("minutes of video rendered")
    ax.set_ylabel("RSS (MB)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--video-min", type=float, default=30.0)
    ap.add_argument("--every-s", type=float, default=10.0)
    ap.add_argument("overrides", nargs="*", help="job overrides, e.g. runtime.dtype=float32")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    audio = looped_speech(args.video_min * 60, WORK / f"soak_{args.video_min:g}min.wav")
    out = WORK / "soak.mp4"
    cmd = [sys.executable, "-m", "avatar_cli", "render", str(ROOT / "sample_inputs" / "job.yaml"), f"audio={audio}",
           "-o", str(out), "--force", "--json", *args.overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frames = [0]  # frames covered by finished chunks so far
    events: list[dict] = []

    def read_events() -> None:
        for line in proc.stdout:
            ev = json.loads(line)
            events.append(ev)
            if ev["event"] == "chunk":
                frames[0] = max(frames[0], ev["end"])

    reader = threading.Thread(target=read_events, daemon=True)
    reader.start()
    samples = []  # (wall s, frames, rss MB)
    t0 = time.time()
    while proc.poll() is None:
        r = rss_mb(proc.pid)
        if r is not None and frames[0] > 0:
            samples.append((time.time() - t0, frames[0], r))
        time.sleep(args.every_s)
    reader.join()
    if proc.returncode != 0:
        raise SystemExit(f"soak: render failed ({proc.returncode}): {proc.stderr.read().strip().splitlines()[-1:]}")
    done = events[-1]
    out.unlink(missing_ok=True)
    fps = done["video_fps"]
    s = np.array(samples)
    video_min, rss = s[:, 1] / fps / 60, s[:, 2]
    slope, intercept, lsq = second_half_slopes(video_min, rss)
    ok = slope <= LIMIT_MB_PER_10MIN
    machine = describe()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    png = ROOT / "bench" / "soak_rss.png"
    plot(video_min, rss, slope, intercept, png, f"avatar render, {args.video_min:g} min of video, {done['dtype']}, {stamp}")
    q = max(1, len(rss) // 4)
    lines = [
        f"## Memory soak, {stamp}",
        "",
        f"- machine: {machine['cores']} cores, {machine['cpu']}; torch {machine['torch']} capability "
        f"{machine['torch_capability']}; dtype {done['dtype']}",
        f"- command: `python bench/soak.py --video-min {args.video_min:g} --every-s {args.every_s:g}"
        + "".join(f" {o}" for o in args.overrides) + "`"
        + (" (= `make soak`)" if (args.video_min, args.every_s, args.overrides) == (30.0, 10.0, []) else ""),
        f"- job: sample_inputs/job.yaml, sample speech looped to {args.video_min:g} min; {len(samples)} RSS samples, "
        f"one every {args.every_s:g} s of wall time; render {done['wall_s'] / 60:.1f} min, realtime factor {done['rtf']:.2f}",
        "",
        "| measure | value | target |",
        "| --- | --- | --- |",
        f"| RSS growth over the second half of the video (Theil-Sen) | {slope:+.2f} MB per 10 min of video | "
        f"<= {LIMIT_MB_PER_10MIN:g} |",
        f"| the same, least squares (moved by transient peaks) | {lsq:+.2f} MB per 10 min of video | |",
        f"| RSS, first vs last quarter of the samples (median) | {np.median(rss[:q]):.0f} -> {np.median(rss[-q:]):.0f} MB | |",
        f"| RSS min / max | {rss.min():.0f} / {rss.max():.0f} MB | |",
        f"| peak RSS (the render's own figure) | {done['peak_rss_mb']:.0f} MB | |",
        "",
        f"![RSS over the soak]({png.name})",
        "",
    ]
    results = ROOT / "bench" / "results.md"
    old = results.read_text()
    head, _, rest = old.partition("\n## ")
    results.write_text(head.rstrip() + "\n\n" + "\n".join(lines) + ("\n## " + rest if rest else ""))
    np.savetxt(WORK / "soak_samples.csv", s, delimiter=",", header="wall_s,frames,rss_mb", fmt="%.3f")
    print("\n".join(lines))
    print("soak: " + ("pass" if ok else f"FAIL: RSS grew {slope:.2f} MB per 10 min of video"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
