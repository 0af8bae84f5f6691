"""A bounded load test of `avatar serve text` (bench/text_service.py, and tests/test_text_service.py at 200
requests): the service in its own process, N client threads on loopback, every answer verified, the server's RSS
read from /proc."""

import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from avatar_cli.prompts.entry import EntryKey
from avatar_cli.service.text_client import ServiceError, TextServiceClient

PROMPTS = ("smiling", "calm person talking", "happy", "surprised lively", "neutral still", "energetic speaking",
           "shocked", "animated smile")


def rss_mb(pid: int) -> float:
    """Resident memory of a process now (VmRSS), in MB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


@dataclass
class Server:
    """`avatar serve text` in a subprocess, on a free loopback port."""

    process: subprocess.Popen
    url: str
    lines: list[str] = field(default_factory=list)  # what it said on stderr

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def start_server(model: str, *args: str, env: dict[str, str] | None = None, wait_s: float = 120.0) -> Server:
    command = [sys.executable, "-m", "avatar_cli.cli", "serve", "text", model, "--port", "0", *args]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               env={**os.environ, **(env or {})})
    lines: list[str] = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        lines.append(line.rstrip())
        found = re.search(r"at (http://\S+?)/v1/", line)
        if found:
            server = Server(process, found.group(1), lines)
            # Keep draining its log (the access log fills a pipe buffer within a few hundred requests).
            threading.Thread(target=lambda: lines.extend(l.rstrip() for l in process.stderr), daemon=True).start()
            return server
    process.kill()
    raise RuntimeError("avatar serve text did not start:\n" + "\n".join(lines[-20:]))


@dataclass
class LoadResult:
    requests: int
    failures: list[str]
    wall_s: float
    latencies_s: list[float]
    rss_warm_mb: float  # the server's RSS after the first `warmup` requests
    rss_end_mb: float

    @property
    def per_s(self) -> float:
        return self.requests / self.wall_s

    def percentile(self, q: float) -> float:
        return statistics.quantiles(self.latencies_s, n=100, method="inclusive")[int(q) - 1]


def run_load(url: str, key_for: Callable[[str], EntryKey], pid: int, total: int = 1000, threads: int = 8, warmup: int = 100,
             token: str | None = None) -> LoadResult:
    """`warmup` requests first (its RSS is the baseline: allocator pools and caches are filled by then), then
    `total - warmup` more from `threads` threads, each with its own connection; every answer is verified as a
    client verifies it. key_for(prompt) -> the EntryKey the answers must carry."""
    keys = {p: key_for(p) for p in PROMPTS}
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client_thread(count: int, offset: int) -> None:
        with TextServiceClient(url, timeout_s=30.0, retries=0, token=token) as client:
            for i in range(count):
                key: EntryKey = keys[PROMPTS[(offset + i) % len(PROMPTS)]]
                t = time.perf_counter()
                try:
                    client.encode(key)
                except ServiceError as e:
                    with lock:
                        failures.append(str(e))
                    continue
                with lock:
                    latencies.append(time.perf_counter() - t)

    def wave(n: int) -> None:
        counts = [n // threads + (i < n % threads) for i in range(threads)]
        workers = [threading.Thread(target=client_thread, args=(c, i)) for i, c in enumerate(counts)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    t0 = time.perf_counter()
    wave(warmup)
    rss_warm = rss_mb(pid)
    wave(total - warmup)
    wall = time.perf_counter() - t0
    return LoadResult(total, failures, wall, latencies, rss_warm, rss_mb(pid))
