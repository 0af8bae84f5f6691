"""Timeline arithmetic shared by every family: how many frames a video of given audio has, and whether it has
I chunks."""

import math
from collections.abc import Collection
from fractions import Fraction


def num_frames(samples: int, sample_rate: int, fps: float) -> int:
    """round(duration x fps), computed exactly (half rounds up), so 2.3 s at 25 fps is 58 frames, not 57."""
    exact = Fraction(samples) * Fraction(fps) / sample_rate
    return max(0, math.floor(exact + Fraction(1, 2)))


def choose_transitions(value: bool | str, kinds: Collection[str], device_type: str) -> tuple[bool, str]:
    """chunking.transitions as a bool, and why when `auto` chose it ("" otherwise). job.resolve calls it once, before
    the resume fingerprint (a resume needs the same plan); Pipeline.schedule takes the bool.

    Why by device: an I chunk is a short extra DiT forward over a seam. On a GPU it costs little next to the N
    chunks; on a CPU a short forward uses the cores less well than an N chunk's, so the I chunks take a large share
    of the DiT's time, while the eval's seam ratio stays within its target without them (the measured cost and
    ratios: bench/results.md, the demo and eval entries). A family without I chunks (wan-s2v) has none to turn on.
    """
    if isinstance(value, bool):
        return value, ""
    if "I" not in kinds:
        return False, ""
    if device_type == "cuda":
        return True, "auto: a GPU renders, where I chunks cost little"
    return False, ("auto: off on a CPU, where I chunks cost about a quarter of the DiT's time and the eval sees no "
                   "better seams with them; chunking.transitions=true turns them on")
