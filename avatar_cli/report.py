"""Progress for people (Rich) and for machines (JSON lines on stdout, nothing else there)."""

import json
import os
import resource
import sys
import time
from typing import Any, Protocol, TextIO

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from avatar_cli.errors import EXIT_INTERRUPTED, EXIT_TERMINATED
from avatar_cli.pipeline.events import LiveChunk, LiveEvent, Ready


def peak_rss_mb() -> float:
    """This process's peak RSS in MiB: VmHWM, which belongs to the address space exec made. ru_maxrss (the fallback
    where /proc is not there) keeps the parent's RSS at the fork, so a render started by a large process (a job
    runner, a benchmark that loaded models) would report the parent's peak as its own."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def peak_memory_text() -> str:
    text = f"{peak_rss_mb():.0f} MB RSS"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        text += f", {torch.cuda.max_memory_allocated() / 2**20:.0f} MB GPU"
    return text


class Reporter(Protocol):
    def start(self, *, output: str, frames: int, chunks: int, fps: float) -> None: ...
    def chunk(self, *, kind: str, index: int, start: int, end: int, elapsed_s: float, done_chunks: int,
              published: int) -> None: ...
    def done(self, summary: dict[str, Any]) -> None: ...
    def error(self, code: int, message: str) -> None: ...
    def info(self, message: str) -> None: ...
    def live(self, event: LiveEvent) -> None: ...  # a live session's event (pipeline/events.py)
    def off_stdout(self) -> None: ...  # stdout carries a stream (-o -): events and progress go to stderr
    def skipped(self, job: str, output: str, reason: str) -> None: ...
    def batch(self, results: list) -> None: ...


def batch_counts(results: list) -> dict[str, int]:
    statuses = ("done", "skipped", "failed", "interrupted", "not_started")
    return {status: sum(r.status == status for r in results) for status in statuses}


class JsonReporter:
    def __init__(self, out: TextIO | None = None):
        self.out = out or sys.stdout

    def emit(self, event: dict[str, Any]) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()

    def start(self, *, output: str, frames: int, chunks: int, fps: float) -> None:
        pass  # the spec lists chunk, done and error events only; keep stdout to those

    def chunk(self, *, kind: str, index: int, start: int, end: int, elapsed_s: float, done_chunks: int,
              published: int) -> None:
        self.emit({"event": "chunk", "kind": kind, "index": index, "start": start, "end": end,
                    "elapsed_s": round(elapsed_s, 4)})

    def done(self, summary: dict[str, Any]) -> None:
        self.emit({"event": "done", **summary})

    def error(self, code: int, message: str) -> None:
        self.emit({"event": "error", "code": code, "message": message})
        print(f"error: {message}", file=sys.stderr)

    def info(self, message: str) -> None:
        print(message, file=sys.stderr)

    def off_stdout(self) -> None:
        self.out = sys.stderr

    def live(self, event: LiveEvent) -> None:
        self.emit(event.as_dict())
        text = event.text()
        if text is not None and not isinstance(event, Ready):  # ready is the event itself; the rest are also said
            self.info(text)

    def skipped(self, job: str, output: str, reason: str) -> None:
        self.emit({"event": "skipped", "job": job, "output": output, "reason": reason})
        self.info(f"skip: {output} is {reason}")

    def batch(self, results: list) -> None:
        for r in results:
            self.emit({"event": "job", "job": r.job, "status": r.status, "wall_s": round(r.wall_s, 3),
                       "output": r.output, "error": r.error})
        self.emit({"event": "batch", "jobs": len(results), **batch_counts(results)})


class RichReporter:
    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self.progress: Progress | None = None
        self.task = None
        self.fps = 25.0
        self.t0 = time.perf_counter()

    def start(self, *, output: str, frames: int, chunks: int, fps: float) -> None:
        self.fps, self.chunks, self.t0 = fps, chunks, time.perf_counter()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task(f"chunk 0/{chunks}", total=frames, stats="")

    def chunk(self, *, kind: str, index: int, start: int, end: int, elapsed_s: float, done_chunks: int,
              published: int) -> None:
        if self.progress is None:
            return
        render_fps = published / elapsed_s if elapsed_s > 0 else 0.0
        stats = f"{render_fps:5.1f} fps  {render_fps / self.fps:4.2f}x realtime  peak {peak_memory_text()}"
        self.progress.update(self.task, completed=published, description=f"chunk {done_chunks}/{self.chunks}",
                             stats=stats)

    def _stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def done(self, s: dict[str, Any]) -> None:
        self._stop()
        table = Table(show_header=False, box=None, pad_edge=False)
        for label, value in [
            ("output", s["output"]), ("frames", f"{s['frames']} ({s['duration_s']:.2f} s at {s['video_fps']:g} fps)"),
            ("time to first frame", f"{s['ttff_s']:.2f} s"), ("wall time", f"{s['wall_s']:.2f} s"),
            ("render fps", f"{s['render_fps']:.1f}"), ("realtime factor", f"{s['rtf']:.2f}x"),
            ("peak memory", f"{s['peak_rss_mb']:.0f} MB RSS" + (f", {s['peak_gpu_mb']:.0f} MB GPU"
                                                                if s.get("peak_gpu_mb") else "")),
        ] + _live_rows(s):
            table.add_row(f"[bold]{label}[/]", str(value))
        self.console.print("[green]done[/]")
        self.console.print(table)

    def error(self, code: int, message: str) -> None:
        self._stop()
        Console(stderr=True).print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)

    def info(self, message: str) -> None:
        Console(stderr=True).print(escape(message), highlight=False, soft_wrap=True)  # paths may hold [..]

    def off_stdout(self) -> None:
        self.console = Console(stderr=True)

    def live(self, event: LiveEvent) -> None:
        text = event.text()
        if isinstance(event, Ready):
            self.fps = event.fps
        if isinstance(event, LiveChunk):  # a session has no length to show progress against: one line per chunk
            latency = event.latency_s
            text = (f"chunk {event.index}: {event.published / self.fps:.2f} s published"
                    + (f", latency {latency:.2f} s" if latency is not None else ""))
        if text is not None:
            self.info(text)

    def skipped(self, job: str, output: str, reason: str) -> None:
        self.info(f"skip: {output} is {reason}")

    def batch(self, results: list) -> None:
        self._stop()
        table = Table(title="batch")
        for column in ("job", "status", "wall", "error"):
            table.add_column(column)
        colour = {"done": "green", "skipped": "cyan", "failed": "red", "interrupted": "yellow", "not_started": "dim"}
        for r in results:
            table.add_row(escape(r.job), f"[{colour[r.status]}]{r.status}[/]", f"{r.wall_s:.1f} s", escape(r.error or ""))
        self.console.print(table)
        counts = batch_counts(results)
        self.console.print(", ".join(f"{n} {k}" for k, n in counts.items()))


def _live_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """A live session's own figures, for the done table (none for a file render)."""
    if "stalls" not in s:
        return []
    rows = [("stalls", f"{s['stalls']} ({s['silence_s']:.2f} s of silence inserted)")]
    if s.get("first_frame_s") is not None:
        rows.append(("first frame after the first audio", f"{s['first_frame_s']:.2f} s"))
    if s.get("latency_median_s") is not None:
        rows.append(("latency", f"median {s['latency_median_s']:.2f} s, p95 {s['latency_p95_s']:.2f} s"))
    return rows


class QuietReporter:
    """Ranks other than 0 under torchrun: no progress, no events; errors go to stderr, marked with the rank."""

    def __init__(self, rank: int):
        self.rank = rank

    def start(self, **_: Any) -> None:
        pass

    def chunk(self, **_: Any) -> None:
        pass

    def done(self, summary: dict[str, Any]) -> None:
        pass

    def info(self, message: str) -> None:
        pass

    def live(self, event: LiveEvent) -> None:
        pass

    def off_stdout(self) -> None:
        pass

    def skipped(self, job: str, output: str, reason: str) -> None:
        pass

    def batch(self, results: list) -> None:
        pass

    def error(self, code: int, message: str) -> None:
        if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):  # every rank got the signal; rank 0 says so once
            return
        print(f"error (rank {self.rank}): {message}", file=sys.stderr)


def make_reporter(json_mode: bool | None) -> Reporter:
    """JSON lines when asked, or when stdout is not a terminal (CI, pipes, cron). Only rank 0 reports."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        return QuietReporter(rank)
    if json_mode or (json_mode is None and not sys.stdout.isatty()):
        return JsonReporter()
    return RichReporter()
