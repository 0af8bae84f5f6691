"""Per-video-frame audio features: loudness and a rough vowel colour.

Frame i of a video at `fps` is shown at time (i + 0.5) / fps, so its audio window is
[i / fps, (i + 1) / fps): centred on that timestamp. Frames past the end of the audio read as
silence.
"""

from __future__ import annotations

import numpy as np

_SPEC_WIN = 512  # 32 ms at 16 kHz: long enough to resolve F1/F2, short enough for syllables


def frame_bounds(num_frames: int, fps: float, sample_rate: int, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Start/stop sample of each frame's window (clipped to the audio)."""
    edges = np.round(np.arange(num_frames + 1) * (sample_rate / fps)).astype(np.int64)
    edges = np.clip(edges, 0, num_samples)
    return edges[:-1], edges[1:]


def frame_rms(audio: np.ndarray, sample_rate: int, fps: float, num_frames: int) -> np.ndarray:
    """RMS of each frame's window, float64 (T,). Computed from cumulative sums: O(N)."""
    x = np.asarray(audio, dtype=np.float64).reshape(-1)
    start, stop = frame_bounds(num_frames, fps, sample_rate, len(x))
    csum = np.concatenate([[0.0], np.cumsum(x * x)])
    count = np.maximum(stop - start, 1)
    energy = np.maximum(csum[stop] - csum[start], 0.0) / count
    return np.sqrt(energy) * (stop > start)


def frame_band_ratios(audio: np.ndarray, sample_rate: int, fps: float, num_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """Two spectral ratios per frame that separate the vowel classes.

    high: energy 1.5-3.5 kHz over 150 Hz-3.5 kHz (a high F2 => spread lips, "ee").
    f1:   energy 0.55-1.1 kHz over 150 Hz-1.1 kHz (a high F1 => open jaw, "aa"; low => "oo").
    """
    x = np.asarray(audio, dtype=np.float64).reshape(-1)
    centres = np.round((np.arange(num_frames) + 0.5) * (sample_rate / fps)).astype(np.int64)
    pad = np.zeros(len(x) + 2 * _SPEC_WIN)
    pad[_SPEC_WIN : _SPEC_WIN + len(x)] = x
    idx = centres[:, None] + np.arange(-_SPEC_WIN // 2, _SPEC_WIN // 2)[None, :] + _SPEC_WIN  # (T, W)
    idx = np.clip(idx, 0, len(pad) - 1)
    power = np.abs(np.fft.rfft(pad[idx] * np.hanning(_SPEC_WIN), axis=1)) ** 2  # (T, F)
    freqs = np.fft.rfftfreq(_SPEC_WIN, 1.0 / sample_rate)

    def band(lo: float, hi: float) -> np.ndarray:
        return power[:, (freqs >= lo) & (freqs < hi)].sum(axis=1)

    eps = 1e-12
    high = band(1500, 3500) / (band(150, 3500) + eps)
    f1 = band(550, 1100) / (band(150, 1100) + eps)
    return high, f1
