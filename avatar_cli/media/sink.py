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


class HashingSink:
    """A Sink in front of another: the sha256 of the uint8 pixels put since the last `take_digest` (to prove a
    resumed render bit-identical), and when the first frame passed (perf_counter, the render's first frame)."""

    def __init__(self, sink: Sink):
        self.sink = sink
        self.hash = hashlib.sha256()
        self.first_put: float | None = None

    def put(self, frames: np.ndarray) -> None:
        if self.first_put is None:
            self.first_put = time.perf_counter()
        self.hash.update(np.ascontiguousarray(frames).tobytes())
        self.sink.put(frames)

    def take_digest(self) -> str:
        """The digest of the frames put since the last call (or since the start); the next stretch starts empty."""
        digest, self.hash = self.hash.hexdigest(), hashlib.sha256()
        return digest

    def close(self) -> object:
        return self.sink.close()

    def abort(self) -> object:
        return self.sink.abort()
