"""The frame clock of a live output: once the first frame is out, frame k leaves at that time + k / fps.

A frame that is ready early waits for its time; one that is late (the render fell behind, or a chunk waited for
its audio) leaves at once, and the clock does not move: the frames after it are due when they always were, so a
stream that fell behind catches up instead of drifting later, and a receiver sees the stream at the speaker's pace
whatever the source does. The live session's chunk plan (pipeline/live.py) reads the same pace: it times each
chunk's wait for audio against the time its frames leave.

`now` and `sleep` are injectable: tests drive a fake clock and take no wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from fractions import Fraction

__all__ = ["FramePacer"]


class FramePacer:
    """Frame k of a stream leaves no earlier than `first + k / fps`, where `first` is when frame 0 left."""

    def __init__(self, fps: float | Fraction, *, now: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.fps = Fraction(fps)
        self.now, self.sleep = now, sleep
        self.first: float | None = None  # when frame 0 left (None: the stream has not started)

    def due(self, k: int) -> float | None:
        """When frame k leaves on the clock (None before frame 0 is out)."""
        return None if self.first is None else self.first + float(k / self.fps)

    def wait(self, k: int) -> float:
        """Wait until frame k's time (frame 0 starts the clock); returns when it leaves."""
        t = self.now()
        if self.first is None:
            self.first = t - float(k / self.fps)  # frame k is the first to go: the clock starts with it
            return t
        due = self.first + float(k / self.fps)
        if due > t:
            self.sleep(due - t)
            return due
        return t
