"""Where a render's frames go: the `Sink` protocol, and `HashingSink`, which hashes what passes through it.

The MP4 writer (media/writer.py `Mp4Writer`) is a Sink; a live output (a stream, HLS segments) is another. Frames
arrive in timeline order, uint8 (T, H, W, 3). This module imports nothing of the project.
"""

import hashlib
import time
from typing import Protocol

import numpy as np

EMPTY_DIGEST = hashlib.sha256().hexdigest()  # the digest of a stretch with no frames handed over


class Sink(Protocol):
    def put(self, frames: np.ndarray) -> None: ...  # uint8 (T, H, W, 3), the next frames of the timeline

    def close(self) -> object: ...  # finish: everything put is written

    def abort(self) -> object: ...  # after a failure: stop, keeping what is written


def now() -> float:
    """The clock every first-frame and latency figure reads: time.monotonic, system-wide (CLOCK_MONOTONIC on
    Linux), so a decode worker's times and a live source's arrival times are on it too."""
    return time.monotonic()


class FrameClock:
    """When frames were handed to the outputs (`now()`): the first frame's time, and for each of the last KEEP puts
    the count of frames handed so far -> when that put returned (bounded: a session may run for days)."""

    KEEP = 256

    def __init__(self) -> None:
        self.first: float | None = None
        self.frames = 0
        self.put_at: dict[int, float] = {}

    def tick(self, n: int) -> None:
        t = now()
        self.first = self.first if self.first is not None else t
        self.frames += n
        self.put_at[self.frames] = t
        if len(self.put_at) > self.KEEP:
            del self.put_at[next(iter(self.put_at))]  # the oldest


class HashingSink:
    """A Sink in front of another: the sha256 of the uint8 pixels put since the last `take_digest` (to prove a
    resumed render bit-identical), and the frame clock: when each put reached the Sink (the render's first frame,
    a live session's latencies)."""

    def __init__(self, sink: Sink):
        self.sink = sink
        self.hash = hashlib.sha256()
        self.clock = FrameClock()

    @property
    def first_put(self) -> float | None:
        return self.clock.first

    def put(self, frames: np.ndarray) -> None:
        self.hash.update(np.ascontiguousarray(frames).tobytes())
        self.sink.put(frames)
        self.clock.tick(len(frames))

    def take_digest(self) -> str:
        """The digest of the frames put since the last call (or since the start); the next stretch starts empty."""
        digest, self.hash = self.hash.hexdigest(), hashlib.sha256()
        return digest

    def close(self) -> object:
        return self.sink.close()

    def abort(self) -> object:
        return self.sink.abort()
