"""Timeline arithmetic shared by every family: how many frames a video of given audio has."""

import math
from fractions import Fraction


def num_frames(samples: int, sample_rate: int, fps: float) -> int:
    """round(duration x fps), computed exactly (half rounds up), so 2.3 s at 25 fps is 58 frames, not 57."""
    exact = Fraction(samples) * Fraction(fps) / sample_rate
    return max(0, math.floor(exact + Fraction(1, 2)))
