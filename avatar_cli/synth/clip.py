"""One training example: a synthetic person saying synthetic speech, with its labels."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .identity import Identity
from .motion import ENERGIES, EXPRESSIONS, Motion, motion_from_audio
from .render import render_frames, render_reference
from .speech import SAMPLE_RATE, synth_speech

__all__ = ["Clip", "make_clip", "EXPRESSIONS", "ENERGIES"]
_SALT = 0xC11B


@dataclass(frozen=True)
class Clip:
    frames: torch.Tensor  # uint8 (T, S, S, 3)
    audio: np.ndarray  # float32 (N,) mono at sample_rate
    sample_rate: int
    fps: float
    motion: Motion  # the ground-truth animation the frames were rendered from
    prompt: str  # "<expression>, <energy>", e.g. "smiling, lively"
    identity: Identity
    expression: str
    energy: str
    reference: np.ndarray  # uint8 (S, S, 3): the identity's neutral reference picture


def make_clip(
    identity_seed: int,
    audio_seed: int,
    duration_s: float,
    fps: float = 25,
    size: int = 256,
    expression: str | None = None,
    energy: str | None = None,
) -> Clip:
    """Render a clip. Labels left as None are drawn from (identity_seed, audio_seed)."""
    rng = np.random.default_rng([int(identity_seed), int(audio_seed), _SALT])
    # Draw everything up front so an explicit label never shifts the other draws.
    drawn_expression = EXPRESSIONS[int(rng.integers(len(EXPRESSIONS)))]
    drawn_energy = ENERGIES[int(rng.integers(len(ENERGIES)))]
    motion_seed = int(rng.integers(2**62))
    expression = drawn_expression if expression is None else expression
    energy = drawn_energy if energy is None else energy

    identity = Identity.from_seed(identity_seed)
    audio = synth_speech(audio_seed, duration_s, SAMPLE_RATE)
    num_frames = int(round(duration_s * fps))
    motion = motion_from_audio(
        audio, SAMPLE_RATE, fps, num_frames, seed=motion_seed, expression=expression, energy=energy
    )
    return Clip(
        frames=render_frames(identity, motion, size),
        audio=audio,
        sample_rate=SAMPLE_RATE,
        fps=float(fps),
        motion=motion,
        prompt=f"{expression}, {energy}",
        identity=identity,
        expression=expression,
        energy=energy,
        reference=render_reference(identity_seed, size),
    )
