"""Where a render's audio comes from: the `AudioSource` protocol the chunk loop and the families read through.

The file reader (media/audio.py `AudioWindowReader`) is one; a live input (stdin, a network stream) of unknown
length is another. This module imports nothing of the project, so the families may use it.
"""

from collections.abc import Iterator
from typing import Protocol

import numpy as np


class AudioSource(Protocol):
    """Mono float32 audio at the family's sample rate, read in windows that move forward."""

    @property
    def total(self) -> int: ...  # samples in the audio

    def read(self, start: int, end: int) -> np.ndarray: ...  # (end - start,) samples [start, end), zero-padded

    def release(self, before: int) -> None: ...  # samples before this index will not be read again

    def stream(self) -> Iterator[np.ndarray]: ...  # the whole audio once more, in chunks, from its own decoder
