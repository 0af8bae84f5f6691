"""Pipeline benchmark (`make bench`): the demo settings on this machine, results to bench/results.md.

Each render runs in its own process (`avatar render --json`), so its peak RSS is its own. While
the long render runs, its RSS, open file descriptors and threads are sampled once a second: they
must stay flat. Figures are medians over repeats; ratios compare runs made in this same session.
The short clip is also rendered on AVX2 kernels (AVX2_ENV: what an AVX2-only CPU runs, float32 under
`runtime.dtype: auto`), each also with the other of `runtime.decode: inline | thread` than the default chose (the
decode in the loop's own thread, or on a thread of its own while the DiT goes on: auto takes the thread for mini
on 2 to 4 CPU threads), compared as the median of paired ratios, and a live session is timed from process start to
its `ready` event.

    python bench/run.py [--short-s 30] [--long-s 600] [--repeats 3]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import wave
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from machine import MATMUL_STAGES, describe, peaks, stage_peak
from time_to_ready import time_to_ready

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "tmp"
# torch's and oneDNN's kernels held to AVX2, as on a CPU without AVX-512 (no native bf16)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
OTHER = {"inline": "thread", "thread": "inline"}  # the runtime.decode measured against the default's choice


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


def render(seconds: float, tag: str, overrides: list[str] = (), env: dict | None = None) -> dict:
    audio = looped_speech(seconds, WORK / f"speech_{int(seconds)}s.wav")
    out = WORK / f"{tag}.mp4"
    cmd = [sys.executable, "-m", "avatar_cli", "render", str(ROOT / "sample_inputs" / "job.yaml"),
           f"audio={audio}", "-o", str(out), "--force", "--json", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    samples: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_process, args=(proc.pid, samples, stop), daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    stop.set()
    if proc.returncode != 0:
        raise SystemExit(f"render failed ({proc.returncode}): {stderr.strip().splitlines()[-1:]}")
    done = json.loads(stdout.strip().splitlines()[-1])
    where = re.search(r"^decode: (\w+)", stderr, re.M)  # the render's own line: where its decode ran
    done["decode"] = where.group(1) if where else "?"
    done["compute_total_s"] = sum(v for k, v in done["compute_s"].items() if k != "decode_wait")
    done["overhead"] = done["generate_s"] / done["compute_total_s"] - 1
    done["samples"] = samples
    out.unlink(missing_ok=True)
    return done


def paired(a: list[dict], b: list[dict]) -> str:
    """a's realtime factor over b's, the median of the renders made back to back; whether their frames differ."""
    ratio = statistics.median(x["rtf"] / y["rtf"] for x, y in zip(a, b))
    same = len({r["frames_digest"] for r in a + b}) == 1
    return f"{ratio:.3f} ({'same frames' if same else 'frames differ'})"


class NullSink:
    def put(self, frames) -> None:
        pass


def stage_flops(audio: Path, overrides: list[str]) -> dict[str, int]:
    """FLOPs per stage of one render of the sample job with this audio, counted in this process (the
    counter slows every op, so this run's timings are not used)."""
    from avatar_cli.media.audio import AudioWindowReader
    from avatar_cli.media.image import fit_square
    from avatar_cli.pipeline.run import Pipeline
    from avatar_cli.job import resolve
    from avatar_cli.render import ModelCache, setup_runtime
    from avatar_cli.report import make_reporter
    from avatar_cli.spec import load_job

    p = resolve(load_job(ROOT / "sample_inputs" / "job.yaml", [f"audio={audio}", *overrides]), force=True)
    runtime, dist = setup_runtime(p.job.spec)
    modules, placement = ModelCache().get(p.model, runtime, dist, p.job.spec.runtime, make_reporter(True))
    for m in modules.values():  # FlopCounterMode's module tracker trips over leaves that require grad
        m.model.requires_grad_(False)
    pipeline = Pipeline(modules, p.model.family, runtime, placement, count_flops=True)
    reader = AudioWindowReader(p.job.audio, sample_rate=p.model.config.audio.sample_rate, info=p.audio)
    try:
        stats = pipeline.run(p.job.spec, fit_square(p.image, p.model.config.image_size), reader, p.frames,
                             pipeline.publish_to(NullSink(), p.size))
    finally:
        reader.close()
    return stats.flops


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
    ap.add_argument("overrides", nargs="*", help="job overrides for every render, e.g. runtime.dtype=float32")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)

    machine, pk = describe(), peaks()
    print(f"machine: {machine}\npeaks (GFLOP/s): {pk}", flush=True)
    shorts, avx2, others, avx2_others = [], [], [], []
    for i in range(args.repeats):  # alternated, so that a slow spell of a shared machine hits all alike
        shorts.append(render(args.short_s, f"short{i}", args.overrides))
        other = OTHER.get(shorts[0]["decode"], "inline")
        others.append(render(args.short_s, f"other{i}", [*args.overrides, f"runtime.decode={other}"]))
        avx2.append(render(args.short_s, f"avx2_{i}", args.overrides, AVX2_ENV))
        avx2_other = OTHER.get(avx2[0]["decode"], "inline")
        avx2_others.append(render(args.short_s, f"avx2_other{i}", [*args.overrides, f"runtime.decode={avx2_other}"],
                                  AVX2_ENV))
    inlines = shorts if shorts[0]["decode"] == "inline" else others  # the overhead and the stages: inline runs
    time_to_ready(args.overrides)  # the first warms the disk cache
    ready = [time_to_ready(args.overrides) for _ in range(max(args.repeats, 5))]
    flops = stage_flops(WORK / f"speech_{int(args.short_s)}s.wav", args.overrides)
    long = render(args.long_s, "long", args.overrides)
    med = lambda key, runs=shorts: statistics.median(r[key] for r in runs)  # noqa: E731
    short_rss = med("peak_rss_mb")
    rss_first, rss_last = flatness(long["samples"], "rss_mb")
    fd_first, fd_last = flatness(long["samples"], "fds")
    th_first, th_last = flatness(long["samples"], "threads")

    rows = [
        ("time to first frame (after models load)", f"{med('ttff_s'):.2f} s", "<= 2 s"),
        (f"render fps ({args.short_s:g} s clip)", f"{med('render_fps'):.1f}", ""),
        (f"realtime factor ({args.short_s:g} s clip, {shorts[0]['dtype']})", f"{med('rtf'):.2f}x",
         ">= 2 (native bf16)" if shorts[0]["dtype"] == "bfloat16" else ">= 1.0"),
        (f"realtime factor ({args.short_s:g} s clip) on AVX2 kernels, {avx2[0]['dtype']}",
         f"{med('rtf', avx2):.2f}x", ">= 1.5"),
        (f"realtime factor with runtime.decode={other}, {others[0]['dtype']}; the default's "
         f"({shorts[0]['decode']}) / its (median of pairs)", f"{med('rtf', others):.2f}x; {paired(shorts, others)}",
         ""),
        (f"the same on AVX2 kernels, {avx2_others[0]['dtype']}: runtime.decode={avx2_other}; the default's "
         f"({avx2[0]['decode']}) / its", f"{med('rtf', avx2_others):.2f}x; {paired(avx2, avx2_others)}", ""),
        ("process start to a live session's `ready` (`audio=- -o -`, warm disk)",
         f"{statistics.median(ready):.2f} s ({min(ready):.2f}-{max(ready):.2f})", "<= 2 s"),
        (f"realtime factor ({args.long_s:g} s render)", f"{long['rtf']:.2f}x", ">= 1.0"),
        # Overhead is counted on inline renders: a decode thread's seconds overlap the loop's.
        (f"pipeline overhead: generate wall / sum of model compute - 1 ({args.short_s:g} s, inline)",
         f"{100 * med('overhead', inlines):.1f} %", "<= 10 %"),
        (f"pipeline overhead ({args.long_s:g} s render, {long['decode']})",
         f"{100 * long['overhead']:.1f} %" if long["decode"] == "inline" else "(overlapped: not counted)", "<= 10 %"),
        (f"peak RSS, {args.short_s:g} s render", f"{short_rss:.0f} MB", ""),
        (f"peak RSS, {args.long_s:g} s render", f"{long['peak_rss_mb']:.0f} MB", ""),
        ("peak RSS ratio long / short", f"{long['peak_rss_mb'] / short_rss:.3f}", "<= 1.05"),
        ("RSS during the long render, first vs last quarter (median)", f"{rss_first:.0f} -> {rss_last:.0f} MB", "flat"),
        ("open fds, first vs last quarter", f"{fd_first:.0f} -> {fd_last:.0f}", "no growth"),
        ("threads, first vs last quarter", f"{th_first:.0f} -> {th_last:.0f}", "no growth"),
    ]
    compute = {k: statistics.median(r["compute_s"][k] for r in inlines) for k in inlines[0]["compute_s"]}
    dtype = shorts[0]["dtype"]
    stage_rows = []
    for k, sec in compute.items():
        gflop = flops.get(k, 0) / 1e9
        peak = stage_peak(k, dtype, pk)
        kind = "matmul" if k in MATMUL_STAGES else "conv"
        if sec == 0:  # a stage that did no work (the prompt, found in the text cache)
            stage_rows.append(f"| {k} | 0 | {gflop:.1f} | | {kind} | |")
            continue
        stage_rows.append(f"| {k} | {sec:.2f} | {gflop:.1f} | {gflop / sec:.1f} | {kind} | {100 * gflop / sec / peak:.0f} % |")
    total_gflop, total_s = sum(flops.values()) / 1e9, sum(compute.values())
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## Pipeline benchmark, {stamp}",
        "",
        f"- machine: {machine['cores']} cores, {machine['cpu']}; flags {' '.join(machine['flags']) or 'none of note'}; "
        f"torch {machine['torch']} capability {machine['torch_capability']}"
        + (f" (ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']})" if "ATEN_CPU_CAPABILITY" in os.environ else "")
        + f", native bf16: {'yes' if machine['native_bf16'] else 'no'}; {machine['threads']} torch threads; no GPU",
        f"- measured peak (GFLOP/s): matmul fp32 {pk['matmul_fp32']:.0f}, bf16 {pk['matmul_bf16']:.1f}; "
        f"3x3 conv fp32 {pk['conv_fp32']:.0f}, bf16 {pk['conv_bf16']:.1f}",
        f"- dtype: {dtype} ({shorts[0]['dtype_reason']})",
        f"- command: `python bench/run.py --short-s {args.short_s:g} --long-s {args.long_s:g} --repeats {args.repeats}"
        + "".join(f" {o}" for o in args.overrides) + "`"
        + (" (= `make bench`)" if (args.short_s, args.long_s, args.repeats, args.overrides) == (30.0, 600.0, 3, []) else ""),
        f"- job: sample_inputs/job.yaml (model mini, {shorts[0]['video_fps']:g} fps, default chunking and sampling); "
        f"audio: sample speech looped; medians of {args.repeats} runs for the short clip; "
        f"load average {os.getloadavg()[0]:.2f} at the end",
        "",
        "| measure | value | target |",
        "| --- | --- | --- |",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        f"Model compute per {args.short_s:g} s clip, against this machine's measured peak for the kind of work "
        "(seconds: median of the short inline runs; FLOPs: counted in a separate run of the same clip):",
        "",
        "| stage | compute s | GFLOP | GFLOP/s | peak kind | of peak |",
        "| --- | --- | --- | --- | --- | --- |",
        *stage_rows,
        f"| all | {total_s:.2f} | {total_gflop:.1f} | {total_gflop / total_s:.1f} | | |",
        "",
        f"Work per second of video: {total_gflop / args.short_s:.1f} GFLOP; at the fraction of peak reached here, a "
        f"CPU runs this job in real time when its {dtype} matmul/conv peak is about "
        f"{pk['matmul_fp32' if dtype == 'float32' else 'matmul_bf16'] / med('rtf'):.0f} GFLOP/s (this one's divided "
        "by the realtime factor).",
        "",
    ]
    results = ROOT / "bench" / "results.md"
    old = results.read_text() if results.exists() else "# Benchmark results\n\nNewest first.\n\n"
    head, _, rest = old.partition("\n## ")
    results.write_text(head.rstrip() + "\n\n" + "\n".join(lines) + ("\n## " + rest if rest else ""))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
