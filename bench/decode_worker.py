"""runtime.decode: worker vs inline on this machine: wall time, realtime factor and peak RSS of both
processes, for the sample job and a longer one (the sample speech looped), medians of --repeats.

Each render is its own CLI process started from this lean parent (`avatar render JOB --json --force
runtime.decode=MODE`), the two modes alternating within each repeat, so both see the same machine load. From the
`done` event: wall_s (process start to finished file), generate_s and rtf (after models load), peak_rss_mb (the
render process's ru_maxrss) and decode_worker_peak_rss_mb (the worker's VmHWM), frames_digest (must be equal), and
compute_s.decode_wait (seconds the render process blocked on the worker's queue).

    python bench/decode_worker.py [--repeats 3] [--long-s 120] [--append]

--append adds the printed section to bench/results.md.
"""

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import wave
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_inputs" / "job.yaml"
MODES = ("inline", "worker")


def loop_audio(src: Path, dst: Path, seconds: float) -> Path:
    """The sample speech repeated to `seconds` (16-bit PCM, its own rate)."""
    with wave.open(str(src)) as w:
        params, data = w.getparams(), w.readframes(w.getnframes())
    need = int(seconds * params.framerate) * params.sampwidth * params.nchannels
    with wave.open(str(dst), "wb") as w:
        w.setparams(params)
        w.writeframes((data * (need // len(data) + 1))[:need])
    return dst


def write_job(folder: Path, name: str, audio: Path) -> Path:
    """The sample job with absolute paths and its own audio."""
    text = SAMPLE.read_text().replace("reference.png", str(SAMPLE.parent / "reference.png"))
    text = text.replace("speech.wav", str(audio)).replace("../out/demo.mp4", str(folder / f"{name}.mp4"))
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


def render(job: Path, mode: str) -> dict:
    out = job.with_name(f"{job.stem}-{mode}.mp4")
    cmd = [sys.executable, "-m", "avatar_cli", "render", str(job), "-o", str(out), "--force", "--json",
           f"runtime.decode={mode}"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    done = json.loads(r.stdout.strip().splitlines()[-1])
    out.unlink(missing_ok=True)
    return done


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-s", type=float, default=120.0)
    ap.add_argument("--long-repeats", type=int, help="repeats of the long job (default: --repeats)")
    ap.add_argument("--append", action="store_true", help="append the section to bench/results.md")
    args = ap.parse_args()

    folder = ROOT / "bench" / "tmp" / "decode_worker"
    folder.mkdir(parents=True, exist_ok=True)
    jobs = {"sample job (12.2 s)": SAMPLE.parent / "speech.wav",
            f"{args.long_s:g} s (sample speech looped)": loop_audio(SAMPLE.parent / "speech.wav",
                                                                 folder / "long.wav", args.long_s)}
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for i, (label, audio) in enumerate(jobs.items()):
        job = write_job(folder, f"job{i}", audio)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for rep in range(args.repeats if i == 0 or args.long_repeats is None else args.long_repeats):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:  # alternate which mode goes first
                done = render(job, mode)
                runs[mode].append(done)
                print(f"{label} {mode} #{rep + 1}: wall {done['wall_s']:.2f} s, rtf {done['rtf']:.3f}, peak RSS "
                      f"{done['peak_rss_mb']:.0f} MB, worker {done.get('decode_worker_peak_rss_mb') or '-'} MB, "
                      f"decode wait {done['compute_s'].get('decode_wait', 0):.2f} s, load {os.getloadavg()[0]:.1f}",
                      flush=True)
        digests = {d["frames_digest"] for m in MODES for d in runs[m]}
        for mode in MODES:
            r = runs[mode]
            med = lambda key: statistics.median(d[key] for d in r)  # noqa: E731
            worker_rss = [d["decode_worker_peak_rss_mb"] for d in r if d.get("decode_worker_peak_rss_mb")]
            rows.append((label, mode, r[0]["frames"], med("wall_s"), med("generate_s"), med("rtf"), med("ttff_s"),
                         med("peak_rss_mb"), statistics.median(worker_rss) if worker_rss else None,
                         statistics.median(d["compute_s"].get("decode", 0) for d in r),
                         statistics.median(d["compute_s"].get("decode_wait", 0) for d in r), len(digests) == 1,
                         len(r)))
        print("\n" + section(args, rows, started, load_before), flush=True)  # what is measured so far
    text = section(args, rows, started, load_before)
    if args.append:
        with open(ROOT / "bench" / "results.md", "a") as f:
            f.write("\n" + text)
        print("appended to bench/results.md; command:", shlex.join(sys.argv))


def section(args: argparse.Namespace, rows: list[tuple], started: datetime.datetime,
            load_before: tuple[float, ...]) -> str:
    import torch

    load_after = os.getloadavg()
    repeats = f"{args.repeats}" if args.long_repeats is None else f"{args.repeats} (long job: {args.long_repeats})"
    long = "" if args.long_repeats is None else f" --long-repeats {args.long_repeats}"
    lines = [
        f"## Decode worker vs inline, {started:%Y-%m-%d %H:%M} UTC", "",
        f"- machine: {cpu_model()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, no GPU; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (1 min; the cores are shared with other work)",
        f"- command: `python bench/decode_worker.py --repeats {args.repeats} --long-s {args.long_s:g}{long}`: each "
        "render its own process (`avatar render JOB --json --force runtime.decode=MODE`), model mini (shipped), the "
        f"modes alternating within each repeat; medians of {repeats}",
        "- wall = process start to finished file; rtf = video seconds / generate seconds (after models load); decode s "
        "= the decode's compute seconds (in the worker: overlapping the next chunks); wait s = the render process "
        "blocked on the worker's queue (its startup included)", "",
        "| job | decode | runs | frames | wall s | generate s | rtf | ttff s | peak RSS MB (render) | peak RSS MB "
        "(worker) | decode s | wait s | same frames |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, mode, frames, wall, gen, rtf, ttff, rss, wrss, dec, wait, same, n in rows:
        lines.append(f"| {label} | {mode} | {n} | {frames} | {wall:.2f} | {gen:.2f} | {rtf:.3f} | {ttff:.2f} | "
                     f"{rss:.0f} | {f'{wrss:.0f}' if wrss else '-'} | {dec:.2f} | {wait:.2f} | "
                     f"{'yes' if same else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
