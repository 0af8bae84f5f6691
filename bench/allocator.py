"""What a glibc malloc setting costs in speed: the sample job rendered with it and as glibc starts, alternately.

Each render is `avatar render sample_inputs/job.yaml runtime.dtype=float32 -o /tmp/x.mp4 --force --json` in its own
process; the variant sets glibc's variables in that process's environment (e.g. MALLOC_MMAP_THRESHOLD_=131072) and,
with --trim-each-chunk, calls malloc_trim(0) at each chunk event (the CLI's JSON reporter wrapped in the process), as
a product hook after each chunk would. Each render's process wall time and the `done` event's wall_s / generate_s /
peak RSS / frames digest are appended to bench/tmp/allocator_speed.jsonl under the variant's name; `--report` prints
the medians per variant and their ratio to the default's. Timings: run it under `/usr/local/bin/quiet` (not at
nice 19), a pair or two per call. Memory over length with the same settings: bench/live_memory.py.

    python bench/allocator.py MALLOC_MMAP_THRESHOLD_=131072 [--trim-each-chunk] [--pairs 1] [--first variant|default]
    python bench/allocator.py --report
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np

from run import ROOT, WORK

LOG = WORK / "allocator_speed.jsonl"
GLIBC = ("MALLOC_", "GLIBC_TUNABLES")  # what the default render must not inherit from this shell
CLI = ["-m", "avatar_cli"]
# The CLI with malloc_trim(0) at each chunk event, before the event is written.
TRIMMING = ["-c", "import ctypes, sys; from avatar_cli import report; libc = ctypes.CDLL(None); "
                  "chunk = report.JsonReporter.chunk; "
                  "report.JsonReporter.chunk = lambda self, **kw: (libc.malloc_trim(ctypes.c_size_t(0)), "
                  "chunk(self, **kw)); "
                  "from avatar_cli.cli import main; sys.argv[0] = 'avatar'; main()"]


def timed_render(name: str, settings: dict[str, str], trim: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(GLIBC)} | settings
    cmd = [sys.executable, *(TRIMMING if trim else CLI), "render", str(ROOT / "sample_inputs" / "job.yaml"),
           "runtime.dtype=float32", "-o", "/tmp/x.mp4", "--force", "--json"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    process_s = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"allocator: render failed ({res.returncode}): {res.stderr[-2000:]}")
    done = json.loads(res.stdout.strip().splitlines()[-1])
    return {"variant": name, "process_s": round(process_s, 3), "wall_s": done["wall_s"],
            "generate_s": done["generate_s"], "peak_rss_mb": done["peak_rss_mb"],
            "frames_digest": done["frames_digest"], "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def measure(settings: dict[str, str], trim: bool, pairs: int, first: str) -> None:
    name = " ".join(f"{k}={v}" for k, v in settings.items()) + (" + malloc_trim each chunk" if trim else "")
    runs = [(name, settings, trim), ("default", {}, False)]
    if first == "default":
        runs.reverse()
    WORK.mkdir(parents=True, exist_ok=True)
    with LOG.open("a") as f:
        for _ in range(pairs):
            for run in runs:
                row = timed_render(*run)
                f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def report() -> None:
    by = defaultdict(list)
    for line in LOG.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by[row["variant"]].append(row)
    keys = ("process_s", "wall_s", "generate_s", "peak_rss_mb")
    med = {name: {k: float(np.median([r[k] for r in rows])) for k in keys} for name, rows in by.items()}
    base = med.get("default")
    print("| allocator | renders | process wall s | render wall_s | generate_s | peak RSS MB | wall_s / default's | "
          "frames digests |\n|---|---|---|---|---|---|---|---|")
    for name, rows in by.items():
        m = med[name]
        rel = f"{m['wall_s'] / base['wall_s']:.3f}" if base else ""
        digests = ", ".join(sorted({r["frames_digest"][:12] for r in rows}))
        print(f"| {name} | {len(rows)} | {m['process_s']:.2f} | {m['wall_s']:.2f} | {m['generate_s']:.2f} | "
              f"{m['peak_rss_mb']:.0f} | {rel} | {digests} |")
    print("(medians)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("settings", nargs="*", help="glibc variables for the variant, e.g. MALLOC_MMAP_THRESHOLD_=131072")
    ap.add_argument("--trim-each-chunk", action="store_true")
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--first", choices=("variant", "default"), default="variant")
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args()
    if args.report:
        return report()
    settings = dict(s.split("=", 1) for s in args.settings)
    if not settings and not args.trim_each_chunk:
        ap.error("name a setting (e.g. MALLOC_MMAP_THRESHOLD_=131072) or --trim-each-chunk")
    measure(settings, args.trim_each_chunk, args.pairs, args.first)


if __name__ == "__main__":
    main()
