"""Process start to a live session's `ready` event (warm disk), median of repeats: `avatar render
sample_inputs/job.yaml audio=- -o - --json`, its stdin held open, killed once `ready` is seen.

    python bench/time_to_ready.py [--repeats 5] [overrides...]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def time_to_ready(overrides: list[str] = (), env: dict | None = None) -> float:
    cmd = [sys.executable, "-m", "avatar_cli", "render", str(ROOT / "sample_inputs" / "job.yaml"), "audio=-",
           "-o", "-", "--json", *overrides]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env)
    try:
        for line in proc.stderr:
            if line.startswith(b"{") and json.loads(line).get("event") == "ready":
                return time.monotonic() - t0
        raise SystemExit(f"no ready event (exit {proc.wait()})")
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    time_to_ready(args.overrides)  # warms the disk cache
    times = [time_to_ready(args.overrides) for _ in range(args.repeats)]
    print(f"time to ready: median {statistics.median(times):.2f} s, "
          f"runs {', '.join(f'{t:.2f}' for t in times)}; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
