"""A live session's chunk plan: it grows as audio arrives, and goes on over silence where the audio stalls.

A file's plan is made once from its length. A live input's length is known only when it ends, so the plan is made
from what has arrived: `growing_plan` hands out a chunk once every plan of a longer audio agrees on it (the family's
plan of the audio so far and of a longer one share it), and the chunk's audio, up to its last frame plus the
features' lookahead, has arrived. When the input ends, the plan of the final length takes over from the chunks handed
out so far (they must be its first chunks: a family's plan grows at its end only).

A stalled source does not stall the session. The session keeps a clock for its audio: from the first chunk on, the
audio a chunk needs is due at the time the first chunk got its audio plus the speaker's pace since (before it, at the
first audio's arrival plus that pace). The first chunk's frames left some time after it got its audio, and every
frame after them leaves at the stream's pace (media/pacing.py), so a chunk whose audio is there when due has its
frames ready when they must leave. A chunk whose audio is `stall_s` past due renders on silence for what is missing
(the source's `pad_to`: the mouth at rest, the head going on); from then on, while the source sends nothing, each
chunk takes its silence when due, so the output keeps its pace through a pause of any length; and the audio that
arrives next goes where the clock is then (the source's `resume_at`), after the silence, so the speech that follows
is on time again. Everything downstream reads the same timeline, so the output's audio track is the input with those
silences inserted, in step with the video. Audio that is late by less than `stall_s` is waited for.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import numpy as np
import torch

from avatar_cli.errors import RenderError
from avatar_cli.families.base import Chunk
from avatar_cli.pipeline.schedule import num_frames
from avatar_cli.runtime.wire import Wire

__all__ = ["LiveAudio", "Stall", "growing_plan", "STALL_S", "RelayedAudio", "ChunkRelay"]

STALL_S = 1.0  # default wait for a chunk's audio before it renders on silence


class LiveAudio(Protocol):
    """What the plan needs of a live source (media/live_audio.py StreamAudio)."""

    rate: int

    @property
    def arrived(self) -> int: ...  # the timeline's length so far, in samples

    @property
    def ended(self) -> bool: ...

    def wait_for(self, n: int, timeout: float | None) -> bool: ...  # True: n samples are there, or the input ended

    def pad_to(self, n: int) -> int: ...  # silence up to sample n; returns the samples inserted

    # The next audio to arrive goes no earlier than sample position() (silence filling up to it, on_fill(at, n)).
    def resume_at(self, position: Callable[[], int] | None, on_fill: Callable[[int, int], None]) -> None: ...


@dataclass(frozen=True)
class Stall:
    """Silence inserted at timeline sample `at` for `samples` samples, when the audio due there was `waited_s` late
    on the session's clock."""

    at: int
    samples: int
    waited_s: float


def _common_prefix(a: list[Chunk], b: list[Chunk]) -> list[Chunk]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def growing_plan(plan: Callable[[int], list[Chunk]], audio: LiveAudio, fps: float, *, lookahead_s: float = 0.0,
                 stall_s: float = STALL_S, on_stall: Callable[[Stall], None] = lambda _: None,
                 on_wait: Callable[[float], None] = lambda _: None, now: Callable[[], float] = time.monotonic,
                 start: float | None = None) -> Iterator[Chunk]:
    """The chunks of `plan(total_frames)` for the audio as it arrives (module docstring), in order.

    lookahead_s: audio past a chunk's last frame its features read (a window centred on the frame's time).
    on_wait(seconds): each wait for audio (what the render's own speed leaves out).
    now: the clock (`audio.wait_for` is the only wait: a fake source advances a fake clock); start: when the first
    audio arrived on it (default: the first chunk asked for).
    """
    rate = audio.rate
    done: list[Chunk] = []
    anchor = [now() if start is None else start, 0]  # the audio clock: sample anchor[1] is due at time anchor[0]

    def sample_at(frame: int) -> int:  # the first timeline sample at or after video frame `frame`'s start
        return math.ceil(Fraction(frame) * rate / Fraction(fps))

    def due(sample: int) -> float:  # when `sample` is due on the audio clock: the speaker's pace from the anchor
        return anchor[0] + (sample - anchor[1]) / rate

    def position() -> int:  # the sample the audio clock is at
        return anchor[1] + int((now() - anchor[0]) * rate)

    def filled(at: int, samples: int) -> None:  # the source resumed where the clock is: silence up to there
        on_stall(Stall(at=at, samples=samples, waited_s=max(0.0, now() - due(at))))

    stalled, quiet_end = False, 0  # the source sent nothing since silence went in at quiet_end
    lookahead = int(round(lookahead_s * rate))
    while True:
        if audio.ended:
            total = num_frames(audio.arrived, rate, fps)
            final = plan(total) if total > 0 else []
            if final[:len(done)] != done:
                raise RenderError("live: the family's chunk plan changed its early chunks as the audio grew; this "
                                  "family cannot render a live session")
            yield from final[len(done):]
            return
        stalled = stalled and audio.arrived <= quiet_end
        known = int(audio.arrived * fps // rate)  # whole frames of audio so far
        # A chunk is settled once a plan of this audio and of a much longer one agree on it.
        longer = plan(known + 4 * max((c.length for c in done[-2:]), default=1) + int(4 * fps))
        settled = _common_prefix(plan(known), longer) if known > 0 else []
        nxt = settled[len(done)] if len(settled) > len(done) else longer[len(done)]
        need = sample_at(nxt.end) + lookahead
        if audio.arrived >= need:
            if len(settled) > len(done):
                done.append(nxt)
                if len(done) == 1:  # the clock is the first chunk's: its frames leave as it sets out
                    anchor[:] = [now(), need]
                yield nxt
                continue
            # Its audio is here, but its shape depends on audio still to come (a seam's length, say): one frame more.
            need = audio.arrived + sample_at(1)
        # Due when the clock reaches it; stalled once stall_s past that. While the source stays silent after a
        # stall, the next chunks take their silence when due: the output keeps its pace through the pause.
        deadline = due(need) + (0.0 if stalled else stall_s)
        t0 = now()
        ok = audio.wait_for(need, timeout=max(0.0, deadline - t0))
        on_wait(now() - t0)
        if not ok:
            at = audio.arrived
            added = audio.pad_to(need)
            if added:
                on_stall(Stall(at=at, samples=added, waited_s=max(0.0, now() - due(at))))
            stalled, quiet_end = True, audio.arrived
            audio.resume_at(position, filled)


class RelayedAudio:
    """The audio a rank other than 0 reads in a live session under torchrun: the windows rank 0 read from the live
    source for each chunk and sent with it (`ChunkRelay`), so every rank sees the same samples."""

    def __init__(self, rate: int):
        self.rate = rate
        self._windows: list[tuple[int, np.ndarray]] = []  # (first sample, samples), oldest first

    def put(self, start: int, samples: np.ndarray) -> None:
        self._windows.append((start, samples))

    def read(self, start: int, end: int) -> np.ndarray:
        """float32 (end - start,) from the newest window that covers [start, end): what rank 0 read there (zeros
        included, where its audio had not arrived or lay before the start)."""
        for first, x in reversed(self._windows):
            if first <= start and end <= first + x.size:
                return x[start - first:end - first].copy()
        raise RenderError(f"live: samples [{start}, {end}) were not relayed from rank 0")

    def release(self, before: int) -> None:
        self._windows = [(f, x) for f, x in self._windows if f + x.size > before]


_END = -1  # a chunk index that ends the plan


def _encode(chunk: Chunk, lo: int) -> torch.Tensor:
    kind = list(chunk.kind.encode())
    return torch.tensor([chunk.index, chunk.start, chunk.length, *chunk.keep, chunk.publish_to, lo, len(kind), *kind,
                         len(chunk.cond), *chunk.cond], dtype=torch.int64)


def _decode(t: torch.Tensor) -> tuple[Chunk | None, int]:
    v = t.tolist()
    if v[0] == _END:
        return None, 0
    index, start, length, k0, k1, publish_to, lo, n = v[:8]
    kind, rest = bytes(v[8:8 + n]).decode(), v[8 + n:]
    return Chunk(kind, index, start, length, tuple(rest[1:1 + rest[0]]), (k0, k1), publish_to), lo


class ChunkRelay:
    """Every rank runs the chunks rank 0's live plan hands out, on the samples rank 0 read for them.

    wire: a Wire (runtime/wire.py) over a gloo group of its own (`Wire.gloo`), whose timeout lets a live source take
    as long as it may for its first audio, and which this thread's sends do not share with the models' collectives.

    Rank 0 plans in a thread of its own: it reads each chunk's samples (`span(chunk)`, what the family's features
    read for it) from the live source and sends chunk and samples to every other rank, point to point, without
    waiting for them to take it. So a rank is never held back by another: under the timestep pipeline rank 1 starts
    block g + 3 while rank 4 still works on block g, and rank 0, which decodes, takes each chunk as planned. Under
    sequence parallel every rank takes the chunks in step, as before. A chunk is sent as int64 fields and its samples
    as float32: nothing is pickled.
    """

    def __init__(self, wire: Wire, world: int, span: Callable[[Chunk], tuple[int, int]], fps: float):
        self.wire, self.world, self.span, self.fps = wire, world, span, fps

    def send(self, chunks: Iterable[Chunk], audio) -> Iterator[Chunk]:
        """Rank 0: the plan's chunks, each sent to the other ranks first. `audio` is the live source; what it reads
        is released (reader "relay") once no later chunk's span reaches it."""
        q: queue.Queue = queue.Queue()
        frame = int(math.ceil(audio.rate / self.fps))  # later chunks start at most a frame before one (an I chunk)

        def plan() -> None:
            try:
                for chunk in chunks:
                    lo, hi = self.span(chunk)
                    lo = max(lo, audio.held_from) if audio.held_from > 0 else lo  # (its reads never reach below)
                    samples = torch.from_numpy(audio.read(lo, hi))
                    for r in range(1, self.world):
                        self.wire.send(r, "chunk", _encode(chunk, lo))
                        self.wire.send(r, "samples", samples)
                    audio.release(max(0, lo - frame), reader="relay")
                    q.put(chunk)
                for r in range(1, self.world):
                    self.wire.send(r, "chunk", torch.tensor([_END], dtype=torch.int64))
                self.wire.flush()
                q.put(None)
            except BaseException as e:  # noqa: BLE001 -- raised again in the loop that takes the chunks
                q.put(e)

        threading.Thread(target=plan, name="live-plan", daemon=True).start()
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def receive(self, relayed: RelayedAudio) -> Iterator[Chunk]:
        """A rank other than 0: each chunk rank 0 sends, its samples put into `relayed`, until the plan ends."""
        while True:
            chunk, lo = _decode(self.wire.recv(0, "chunk"))
            if chunk is None:
                return
            relayed.put(lo, self.wire.recv(0, "samples").numpy())
            yield chunk
