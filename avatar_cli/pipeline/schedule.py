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
    """chunking.transitions as a bool, and why when `auto` chose it ("" otherwise). runner.render resolves it
    before the resume fingerprint (a resume needs the same plan); Pipeline.schedule again for its other callers.

    On a GPU the I chunks cost little next to the rest; on a CPU they were 27 % of the DiT's time (1.27x for the
    demo without them, on 2 AVX2 cores) for an eval seam ratio of 0.852 against 0.866 without them (target <= 1.2;
    bench/results.md). A family without I chunks (wan-s2v) has none to turn on.
    """
    if isinstance(value, bool):
        return value, ""
    if "I" not in kinds:
        return False, ""
    if device_type == "cuda":
        return True, "auto: a GPU renders, where I chunks cost little"
    return False, ("auto: off on a CPU, where I chunks cost about a quarter of the DiT's time and the eval sees no "
                   "better seams with them; chunking.transitions=true turns them on")
