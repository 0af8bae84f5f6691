"""Text-encoder service: `avatar serve text` under a bounded load on loopback.

The service runs in its own process (`avatar serve text MODEL --port 0 --dtype float32 --threads 1`: one torch
thread, as a small encoder answers fastest on a busy CPU); 8 client threads,
each with its own connection (TextServiceClient, retries off, so any failure counts), send short prompts, and
every answer is verified as a render verifies it (the key's fields and the data digest). The server's RSS is
read from /proc after the first 100 requests (the baseline: allocator pools and caches are filled by then) and
after the last; flat means it grew less than 5 %. Also its RSS right after start, and the time to start.

    python bench/text_service.py [--model mini] [--requests 1000] [--threads 8] [--server-threads 1] [--append]
"""

import argparse
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from avatar_cli.families.registry import resolve_model  # noqa: E402
from avatar_cli.prompts.cache import PromptCache  # noqa: E402
from avatar_cli.prompts.store import TextCache  # noqa: E402
from bench.loadtest import rss_mb, run_load, start_server  # noqa: E402
from bench.machine import describe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mini")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--server-threads", type=int, default=1, help="the service's --threads")
    ap.add_argument("--append", action="store_true", help="append the section to bench/results.md")
    args = ap.parse_args()

    t0 = time.perf_counter()
    server = start_server(args.model, "--dtype", "float32", "--threads", str(args.server_threads))
    start_s = time.perf_counter() - t0
    rss_start = rss_mb(server.process.pid)
    try:
        with tempfile.TemporaryDirectory() as folder:
            key = PromptCache(TextCache(Path(folder)), resolve_model(args.model, Path.cwd()), torch.float32).key
            r = run_load(server.url, key, server.process.pid, total=args.requests, threads=args.threads)
    finally:
        code = server.stop()
    m = describe()
    growth = (r.rss_end_mb / r.rss_warm_mb - 1) * 100
    command = (f"python bench/text_service.py --model {args.model} --requests {args.requests} --threads {args.threads} "
               f"--server-threads {args.server_threads}")
    section = "\n".join([
        f"## Text-encoder service, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        f"- machine: {m['cpu']}, {m['cores']} CPU cores, torch {m['torch']}, no GPU",
        f"- command: `{command}`: `avatar serve text {args.model} --port 0 --dtype float32 --threads "
        f"{args.server_threads}` in its own process, "
        f"{args.threads} client threads on loopback, short prompts, every answer verified",
        "",
        "| requests | failures | req/s | p50 ms | p99 ms | server RSS at start MB | after 100 MB | after all MB | "
        "growth | start s | exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {r.requests} | {len(r.failures)} | {r.per_s:.0f} | {r.percentile(50) * 1000:.1f} | "
        f"{r.percentile(99) * 1000:.1f} | {rss_start:.0f} | {r.rss_warm_mb:.1f} | {r.rss_end_mb:.1f} | "
        f"{growth:+.2f} % | {start_s:.1f} | {code} |",
        "",
    ])
    print(section)
    for failure in r.failures[:5]:
        print("failure:", failure)
    if args.append:
        with open(ROOT / "bench" / "results.md", "a") as f:
            f.write("\n" + section)


if __name__ == "__main__":
    main()
