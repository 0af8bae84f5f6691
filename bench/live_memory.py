"""Memory over length: peak RSS of a long render over a short one, for the tiny wan-s2v model in
clip mode (the official clip loop) or streaming mode (LiveAvatar's blocks), or the shipped mini's sample job.

Each render runs in its own process: the whole runner as `avatar render` runs it (audio reader, audio features, the
chunk loop, the decode, the MP4 writer, a resume checkpoint after every chunk).
  streaming: the tiny wan-s2v model (`models init --family wan-s2v --size tiny`), 64x64, float32, lossless video
        (the job of tests/test_wan_live.py), `mode=streaming`: 4-step blocks of 12 frames; 600 s vs 30 s.
  clip: the same job, `mode=clip sampling.steps=1 runtime.threads=1`: whole 80-frame clips (guidance 4.5: two DiT
        forwards per clip), the wav2vec2 windows, every clip's motion re-encode; 180 s vs 30 s.
  mini: sample_inputs/job.yaml as `make soak` renders it, its speech looped; 600 s vs 30 s.
Pass: the long render's peak is at most 1.05 x the short one's: nothing in the rolling state or around it grows
with the video's length.

Where the peak is: the render process resets its own peak (`/proc/self/clear_refs` 5) after reading VmHWM at every
chunk event and at each stage's start and end (the pipeline's StageTimer), so each chunk and each stage in it gets its
exact peak (a chunk: the interval since the previous chunk's event: its context, DiT, decode and checkpoint); chunk
0's interval also holds the setup (models, reference, prompt). A thread samples
VmRSS / RssAnon / RssFile every `--sample-s` seconds with the chunk in progress and the frames published; the RSS
slope over the second half of the video is computed as `make soak` does (bench/soak.py). All go to
bench/tmp/live_memory/<mode>-<allocator>-<name>/{chunks,stages,samples}.csv.

The allocator (glibc's malloc):
  --allocator env (default): MALLOC_MMAP_THRESHOLD_=<--mmap-threshold, 131072> in the render's environment. Setting
        it turns off glibc's dynamic thresholds: the mmap threshold stays where it is set and the trim threshold at
        128 KiB. (By default, freeing a mapped block raises the mmap threshold to its size, up to 32 MiB, and the trim
        threshold to twice that: later buffers of that size come from the heap, and what stays resident depends on
        where they land.)
  --allocator glibc: glibc's dynamic thresholds, as a process starts without the variable.
  --trim-each-chunk: malloc_trim(0) in the render after each chunk's event (every free page of the heaps released,
        holes below live blocks included).
Measured figures: bench/results.md, "Memory over length, clip and streaming modes".

    nice -n 19 .venv/bin/python bench/live_memory.py [--mode clip|streaming|mini] [--long-s S] [--short-s S]
        [--allocator env|glibc] [--mmap-threshold BYTES] [--trim-each-chunk] [--sample-s 0.2] [KEY=VALUE ...]

Prints a JSON line per render and a Markdown table; exit 1 when the ratio is over the limit.
"""

import argparse
import io
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the wan-s2v job is the streaming tests' (tests/test_wan_live.py)
WORK = ROOT / "bench" / "tmp" / "live_memory"
LIMIT = 1.05
MODES = {  # mode -> (job overrides, default long / short seconds)
    "streaming": (["mode=streaming"], 600.0, 30.0),
    "clip": (["mode=clip", "sampling.steps=1", "runtime.threads=1"], 180.0, 30.0),
    "mini": ([], 600.0, 30.0),
}


def status_mb(*fields: str) -> dict[str, float]:
    """Fields of /proc/self/status in MB (VmRSS, VmHWM, RssAnon, RssFile, ...)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name = line.split(":", 1)[0]
        if name in fields:
            out[name] = int(line.split()[1]) / 1024
    return out


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux 4.0+): the next reading is the peak since this call."""
    Path("/proc/self/clear_refs").write_text("5")


class ChunkPeaks:
    """A reporter that records the peak RSS of each chunk and of each stage in it (reading VmHWM and resetting it at
    every stage's start and end and at every chunk event), the chunk in progress and the frames made. "other" is
    the work between stages (the checkpoint, the writer); chunk 0 holds the setup (models, reference, prompt)."""

    def __init__(self, reporter, after_chunk=lambda: None):
        self.reporter, self.after_chunk = reporter, after_chunk
        self.current, self.frames, self.label, self.level = 0, 0, "setup", 0.0
        self.peaks: dict[tuple[int, str], tuple[float, float]] = {}  # (chunk, stage) -> (peak, rise) MB
        self.rows = []  # (chunk, peak MB, RSS MB, RssAnon MB at its event)

    def __getattr__(self, name):
        return getattr(self.reporter, name)

    def mark(self, label: str) -> None:
        """The interval since the last mark ends: its peak and its rise over the RSS it started at go to (chunk,
        its label); the next is `label`."""
        s = status_mb("VmHWM", "VmRSS")
        reset_peak()
        key = (self.current, self.label)
        peak, rise = self.peaks.get(key, (0.0, 0.0))
        self.peaks[key] = (max(peak, s["VmHWM"]), max(rise, s["VmHWM"] - self.level))
        self.label, self.level = label, s["VmRSS"]

    def watch(self, timer_class) -> None:
        """Mark at each stage's start and end (StageTimer, which the pipeline wraps every stage in)."""
        call, track = timer_class.__call__, self

        @contextmanager
        def timed(timer, name):
            track.mark(name)
            try:
                with call(timer, name):
                    yield
            finally:
                track.mark("other")

        timer_class.__call__ = timed

    def chunk(self, **kw) -> None:
        s = status_mb("VmRSS", "RssAnon")
        self.mark("other")
        peak = max(h for (c, _), (h, _) in self.peaks.items() if c == self.current)
        self.after_chunk()
        self.rows.append((kw["index"], peak, s["VmRSS"], s["RssAnon"]))
        self.current, self.frames = kw["index"] + 1, max(self.frames, kw["end"])
        self.reporter.chunk(**kw)


def sample(stop: threading.Event, every: float, track: ChunkPeaks, out: list) -> None:
    t0 = time.perf_counter()
    while not stop.wait(every):
        s = status_mb("VmRSS", "RssAnon", "RssFile")
        out.append((round(time.perf_counter() - t0, 2), track.current, track.frames, s["VmRSS"], s["RssAnon"],
                    s["RssFile"]))


def child(job: Path, folder: Path, every: float, trim: bool, overrides: list[str]) -> None:
    """One render in this process; prints its summary with this process's peak RSS and where it happened."""
    from avatar_cli.report import JsonReporter
    from avatar_cli.job import resolve
    from avatar_cli.render import render
    from avatar_cli.spec import load_job
    from avatar_cli.stages.base import StageTimer
    from soak import second_half_slopes

    after_chunk = lambda: None  # noqa: E731
    if trim:  # every free page of glibc's heaps back to the system, holes below live blocks included
        import ctypes

        libc = ctypes.CDLL(None)
        after_chunk = lambda: libc.malloc_trim(ctypes.c_size_t(0))  # noqa: E731
    track, samples, stop = ChunkPeaks(JsonReporter(io.StringIO()), after_chunk), [], threading.Event()
    track.watch(StageTimer)
    sampler = threading.Thread(target=sample, args=(stop, every, track, samples), daemon=True)
    sampler.start()
    p = resolve(load_job(job, overrides), force=True)
    done = render(p, track)
    stop.set()
    sampler.join()
    end = status_mb("VmHWM", "VmRSS")
    (folder / "chunks.csv").write_text("chunk,peak_mb,rss_mb,anon_mb\n" + "".join(
        f"{c},{h:.1f},{r:.1f},{a:.1f}\n" for c, h, r, a in track.rows))
    (folder / "stages.csv").write_text("chunk,stage,peak_mb,rise_mb\n" + "".join(
        f"{c},{label},{h:.1f},{d:.1f}\n" for (c, label), (h, d) in track.peaks.items()))
    np.savetxt(folder / "samples.csv", np.array(samples), delimiter=",", fmt="%.2f",
               header="t_s,chunk,frames,rss_mb,anon_mb,file_mb", comments="")
    rows = track.rows
    peaks = [h for _, h, _, _ in rows[1:]] or [rows[0][1]]  # chunk 0's interval holds the setup too
    half = len(peaks) // 2
    at = max(range(len(rows)), key=lambda i: rows[i][1])
    s = np.array([x for x in samples if x[2] > 0])
    slope = second_half_slopes(s[:, 2] / done["video_fps"] / 60, s[:, 3])[0] if len(s) >= 8 else float("nan")
    out = {k: done[k] for k in ("frames", "duration_s", "wall_s", "ttff_s", "render_fps")}
    out.update(peak_rss_mb=max(max(h for _, h, _, _ in rows), end["VmHWM"]), peak_chunk=rows[at][0],
               chunks=len(rows), chunk0_peak_mb=rows[0][1], chunk_peak_median_halves=[
                   float(np.median(peaks[:half])) if half else float("nan"), float(np.median(peaks[half:]))],
               chunk_peak_max_halves=[max(peaks[:half] or [float("nan")]), max(peaks[half:])],
               chunk_end_rss_range=[min(r for _, _, r, _ in rows), max(r for _, _, r, _ in rows)],
               final_rss_mb=end["VmRSS"], slope_mb_per_10min=slope,
               stage_rises={label: [float(np.median(v)), max(v)] for label in sorted({k for _, k in track.peaks})
                            if (v := [d for (c, k), (_, d) in track.peaks.items() if k == label and c > 0])})
    print(json.dumps(out), flush=True)


def write_mini_job(folder: Path, seconds: float) -> Path:
    """sample_inputs/job.yaml with its speech looped to `seconds` (what `make soak` renders)."""
    import yaml

    from run import looped_speech

    job = yaml.safe_load((ROOT / "sample_inputs" / "job.yaml").read_text())
    job.update(reference=str(ROOT / "sample_inputs" / job["reference"]), output="out/video.mp4",
               audio=str(looped_speech(seconds, folder / "speech.wav")))
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    return folder / "job.yaml"


def run(job: Path, folder: Path, args: argparse.Namespace, overrides: list[str], env: dict[str, str]) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--child", str(job), "--folder", str(folder), "--sample-s", str(args.sample_s),
           *(["--trim-each-chunk"] if args.trim_each_chunk else []), *overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if res.returncode != 0:
        raise SystemExit(f"live_memory: the render of {job} failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_s"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=sorted(MODES), default="streaming")
    ap.add_argument("--long-s", type=float, help="default: 600 (streaming, mini), 180 (clip)")
    ap.add_argument("--short-s", type=float, help="default: 30")
    ap.add_argument("--allocator", choices=("env", "glibc"), default="env")
    ap.add_argument("--trim-each-chunk", action="store_true", help="malloc_trim(0) in the render after each chunk")
    ap.add_argument("--mmap-threshold", type=int, default=131072, help="MALLOC_MMAP_THRESHOLD_ with --allocator env")
    ap.add_argument("--sample-s", type=float, default=0.2, help="RSS sampling period in the render process")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="job overrides, e.g. runtime.threads=1")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.folder, args.sample_s, args.trim_each_chunk, args.overrides)
        return 0

    from avatar_cli.families.registry import init_family_dir
    from tests.test_wan_live import write_job

    fixed, long_s, short_s = MODES[args.mode]
    lengths = {"short": args.short_s or short_s, "long": args.long_s or long_s}
    overrides = [*fixed, *args.overrides]
    model = WORK / "Wan2.2-S2V-tiny"
    if args.mode != "mini" and not model.is_dir():
        init_family_dir(model, "tiny", seed=0, family="wan-s2v")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    allocator, tag = "glibc defaults", "glibc"
    if args.allocator == "env":
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        allocator, tag = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}", f"env{args.mmap_threshold}"
    if args.trim_each_chunk:
        allocator, tag = allocator + ", malloc_trim(0) after each chunk", tag + "-trim"
    rows = {}
    for name, seconds in lengths.items():
        folder = WORK / f"{args.mode}-{tag}-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        job = write_mini_job(folder, seconds) if args.mode == "mini" else write_job(folder, model, seconds)
        rows[name] = run(job, folder, args, overrides, env)
        print(json.dumps({"render": name, "mode": args.mode, "seconds": seconds, **rows[name]}), flush=True)
    ratio = rows["long"]["peak_rss_mb"] / rows["short"]["peak_rss_mb"]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{when}, {args.mode} mode, allocator: {allocator}, overrides: "
          f"{' '.join(overrides) or 'none'}\n\n"
          "| render | video s | chunks | peak RSS MB | at chunk | chunk 0 peak MB (with setup) | chunk peaks, median "
          "1st / 2nd half MB | chunk peaks, max 1st / 2nd half MB | RSS at chunk ends, min-max MB | RSS slope, 2nd "
          "half, MB per 10 min | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for name, seconds in lengths.items():
        r = rows[name]
        med, top, ends = r["chunk_peak_median_halves"], r["chunk_peak_max_halves"], r["chunk_end_rss_range"]
        print(f"| {name} | {seconds:g} | {r['chunks']} | {r['peak_rss_mb']:.1f} | {r['peak_chunk']} | "
              f"{r['chunk0_peak_mb']:.1f} | {med[0]:.1f} / {med[1]:.1f} | {top[0]:.1f} / {top[1]:.1f} | "
              f"{ends[0]:.0f}-{ends[1]:.0f} | {r['slope_mb_per_10min']:+.2f} | {r['wall_s']:.1f} |")
    labels = sorted({k for r in rows.values() for k in r["stage_rises"]})
    print("\nEach stage's peak RSS over the RSS it started at, MB, over chunks 1.. (median / max; other = between "
          f"stages: checkpoint, writer)\n\n| render | {' | '.join(labels)} |\n|---|{'---|' * len(labels)}")
    for name, r in rows.items():
        cells = [r["stage_rises"].get(k) for k in labels]
        print(f"| {name} | " + " | ".join(f"{c[0]:.0f} / {c[1]:.0f}" if c else "" for c in cells) + " |")
    verdict = "met" if ratio <= LIMIT else "NOT met"
    print(f"\npeak RSS ratio long / short: {ratio:.4f} (limit {LIMIT}): {verdict}")
    return 0 if ratio <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
