"""Per-frame face motion, and how it is derived from speech audio.

A `Motion` holds one float32 tensor of shape (T,) per controllable quantity. The renderer
reads nothing else, so a clip's whole animation is this small bundle (and the model can be
supervised or conditioned on it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
import torch

from .audio_features import frame_band_ratios, frame_rms

EXPRESSIONS = ("neutral", "smiling", "surprised")
ENERGIES = ("calm", "lively")
_SALT = 0xA11CE


@dataclass(frozen=True)
class Motion:
    """Animation state per frame; every field is a float32 tensor of shape (T,)."""

    mouth_open: torch.Tensor  # 0 closed .. 1 fully open jaw
    mouth_shape: torch.Tensor  # -1 round "oo" .. 0 open "aa" .. +1 wide "ee"
    head_dx: torch.Tensor  # horizontal head shift, fraction of frame width (+ right)
    head_dy: torch.Tensor  # vertical head shift, fraction of frame height (+ down)
    head_tilt: torch.Tensor  # head roll in radians (+ clockwise on screen)
    blink: torch.Tensor  # 0 eyes open .. 1 closed
    smile: torch.Tensor  # 0 .. 1: mouth corners up, cheeks raised, eyes narrowed
    surprise: torch.Tensor  # 0 .. 1: brows raised, eyes wide, mouth narrower

    FIELDS: ClassVar[tuple[str, ...]] = (
        "mouth_open", "mouth_shape", "head_dx", "head_dy", "head_tilt", "blink", "smile", "surprise",
    )

    def __post_init__(self) -> None:
        n = self.mouth_open.shape[0]
        for f in fields(self):
            if tuple(getattr(self, f.name).shape) != (n,):
                raise ValueError(f"Motion.{f.name} must have shape ({n},)")

    @property
    def num_frames(self) -> int:
        return int(self.mouth_open.shape[0])

    def __getitem__(self, index: slice) -> "Motion":
        return Motion(**{name: getattr(self, name)[index] for name in self.FIELDS})

    def as_tensor(self) -> torch.Tensor:
        """All fields stacked: (T, 8) in `FIELDS` order (e.g. as a conditioning signal)."""
        return torch.stack([getattr(self, name) for name in self.FIELDS], dim=1)

    @classmethod
    def from_tensor(cls, x: torch.Tensor) -> "Motion":
        return cls(**{name: x[:, i].float().contiguous() for i, name in enumerate(cls.FIELDS)})

    @classmethod
    def neutral(cls, num_frames: int) -> "Motion":
        """Closed mouth, eyes open, centred head, neutral face."""
        return cls(**{name: torch.zeros(num_frames) for name in cls.FIELDS})


@dataclass(frozen=True)
class MouthParams:
    """Loudness -> jaw opening. Loudness is relative to the clip's loud frames."""

    gate_abs: float = 0.004  # RMS below this (about -48 dBFS) is silence, whatever the clip level
    gate_rel: float = 0.06  # ... and so is anything below 6% of the loud-frame level
    gamma: float = 0.7  # < 1 compresses: soft syllables still open the mouth visibly
    gain: float = 1.0  # opening at the loud-frame level (1 = fully open)


@dataclass(frozen=True)
class SwayParams:
    """Head sway: smooth noise amplitudes (std) plus audio-driven nodding."""

    dx: float
    dy: float
    tilt: float
    nod: float  # extra downward dy per unit of (smoothed) mouth opening
    mouth_gain: float  # lively speakers articulate more


SWAY = {
    "calm": SwayParams(dx=0.004, dy=0.0025, tilt=0.012, nod=0.002, mouth_gain=0.85),
    "lively": SwayParams(dx=0.012, dy=0.007, tilt=0.04, nod=0.008, mouth_gain=1.0),
}


def motion_from_audio(
    audio: np.ndarray,
    sample_rate: int,
    fps: float,
    num_frames: int,
    *,
    seed: int,
    expression: str = "neutral",
    energy: str = "calm",
) -> Motion:
    """Animate a face to speech: jaw from loudness, lip shape from vowel colour, plus sway,
    blinks and the expression. Deterministic for a given audio and seed."""
    if expression not in EXPRESSIONS:
        raise ValueError(f"expression must be one of {EXPRESSIONS}, got {expression!r}")
    if energy not in ENERGIES:
        raise ValueError(f"energy must be one of {ENERGIES}, got {energy!r}")
    rng = np.random.default_rng([int(seed), _SALT])
    sway = SWAY[energy]
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    rms = frame_rms(audio, sample_rate, fps, num_frames)
    mouth_open = _mouth_open(rms, MouthParams(gain=sway.mouth_gain))
    mouth_shape = _mouth_shape(audio, sample_rate, fps, num_frames, mouth_open)
    times = (np.arange(num_frames) + 0.5) / fps
    talk = _smooth(mouth_open, max(1, int(round(fps * 0.4))))
    head_dx = sway.dx * _smooth_noise(rng, times)
    head_dy = sway.dy * _smooth_noise(rng, times) + sway.nod * (talk - (talk.mean() if talk.size else 0.0))
    head_tilt = sway.tilt * _smooth_noise(rng, times)
    blink = _blinks(rng, times)
    smile, surprise = _expression(rng, times, expression)
    if expression == "surprised":
        mouth_shape = np.clip(mouth_shape - 0.4 * mouth_open, -1, 1)  # rounder "oh!" mouth

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))

    return Motion(
        mouth_open=t(mouth_open), mouth_shape=t(mouth_shape), head_dx=t(head_dx), head_dy=t(head_dy),
        head_tilt=t(head_tilt), blink=t(blink), smile=t(smile), surprise=t(surprise),
    )


def _mouth_open(rms: np.ndarray, p: MouthParams) -> np.ndarray:
    loud = rms[rms > p.gate_abs]
    ref = float(np.percentile(loud, 95)) if loud.size else 1.0
    rel = rms / max(ref, 1e-6)
    # Subtract the gate so the opening starts from 0 instead of jumping at the threshold.
    opening = np.clip((rel - p.gate_rel) / (1.0 - p.gate_rel), 0.0, None) ** p.gamma
    opening[rms <= p.gate_abs] = 0.0
    return np.clip(p.gain * opening, 0.0, 1.0)


def _mouth_shape(audio: np.ndarray, sr: int, fps: float, n: int, mouth_open: np.ndarray) -> np.ndarray:
    """-1 round .. +1 wide from two spectral ratios (see audio_features.frame_band_ratios).

    Thresholds are set from the formant synthesizer's vowels: "ee"/"ih"/"eh" carry 10-100x
    more 1.5-3.5 kHz energy than "aa"/"oo"; among the rest, "oo" has little 0.55-1.1 kHz energy.
    """
    if n == 0:
        return np.zeros(0)
    high, f1 = frame_band_ratios(audio, sr, fps, n)
    spread = np.clip((np.log10(high + 1e-9) + 2.6) / 0.8, 0, 1) * (1 - 0.5 * np.clip(f1 / 0.4, 0, 1))
    rounded = (1 - spread) * np.clip((0.45 - f1) / 0.3, 0, 1)
    shape = spread - rounded
    shape *= np.clip(mouth_open * 3.0, 0, 1)  # a closed mouth has no vowel shape
    return np.clip(_smooth(shape, 3), -1, 1)


def _smooth_noise(rng: np.random.Generator, times: np.ndarray) -> np.ndarray:
    """Unit-variance smooth noise: a few incommensurate slow sinusoids (0.05-0.5 Hz)."""
    freqs = rng.uniform(0.05, 0.5, 4)
    phases = rng.uniform(0, 2 * np.pi, 4)
    amps = rng.uniform(0.5, 1.0, 4)
    x = (amps[:, None] * np.sin(2 * np.pi * freqs[:, None] * times[None, :] + phases[:, None])).sum(0)
    return x / np.sqrt(0.5 * (amps**2).sum())


def _blinks(rng: np.random.Generator, times: np.ndarray) -> np.ndarray:
    """Blinks every 2-6 s, ~150 ms each (fast close, slightly slower open)."""
    blink = np.zeros_like(times)
    t = rng.uniform(0.3, 2.5)
    end = times[-1] if times.size else 0.0
    while t < end + 0.2:
        dur = rng.uniform(0.12, 0.18)
        phase = (times - t) / dur
        bump = np.where((phase > 0) & (phase < 1), np.sin(np.pi * np.clip(phase, 0, 1)) ** 0.5, 0.0)
        np.maximum(blink, bump, out=blink)
        t += dur + (0.25 if rng.random() < 0.1 else rng.uniform(2.0, 6.0))  # sometimes a double blink
    return blink


def _expression(rng: np.random.Generator, times: np.ndarray, expression: str) -> tuple[np.ndarray, np.ndarray]:
    wander = 0.5 + 0.5 * np.tanh(_smooth_noise(rng, times))  # slow 0..1 variation
    zero = np.zeros_like(times)
    if expression == "smiling":
        return 0.7 + 0.3 * wander, zero
    if expression == "surprised":
        return zero, 0.75 + 0.25 * wander
    return 0.1 * wander, zero


def _smooth(x: np.ndarray, width: int) -> np.ndarray:
    if width <= 1 or x.size == 0:
        return x.astype(np.float64)
    kernel = np.hanning(width + 2)[1:-1]
    kernel /= kernel.sum()
    pad = np.pad(x.astype(np.float64), (width // 2, width - 1 - width // 2), mode="edge")
    return np.convolve(pad, kernel, mode="valid")
