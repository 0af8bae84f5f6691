"""Procedural training data: stylized talking heads rendered from seeds, with matching speech.

Everything is deterministic from integer seeds and uses only torch and numpy:

- `Identity.from_seed(seed)`: the look of a person (face, hair, colours, accessories).
- `synth_speech(seed, duration_s)`: speech-like formant-synthesized audio (16 kHz).
- `motion_from_audio(...)`: per-frame mouth/eyes/head animation driven by the audio.
- `render_frames(identity, motion, size)`: uint8 (T, S, S, 3) frames, batched in torch.
- `make_clip(identity_seed, audio_seed, duration_s)`: all of the above plus labels.
- `measure_mouth_opening(frames, reference)`: lip-sync meter that reads pixels only.

Seed ranges. Identity and audio seeds are separate streams (each generator is salted), so the
same number may be used for both. Keep the splits apart:

- training identities: 0 .. 99_999 (`TRAIN_IDENTITY_SEEDS`)
- evaluation / held-out identities: 1_000_000 .. 1_000_999 (`EVAL_IDENTITY_SEEDS`)
- `sample_inputs` uses identity 1_000_007 (`SAMPLE_IDENTITY_SEED`): never in training
- training audio: 0 .. 99_999 (`TRAIN_AUDIO_SEEDS`)
- held-out audio: 2_000_000 and up (`HELDOUT_AUDIO_SEED_START`)
"""

from __future__ import annotations

from .clip import Clip, make_clip
from .identity import HAIR_STYLES, Identity
from .measure import measure_mouth_opening, mouth_box
from .motion import ENERGIES, EXPRESSIONS, Motion, motion_from_audio
from .render import render_frames, render_reference
from .speech import SAMPLE_RATE, synth_speech

TRAIN_IDENTITY_SEEDS = range(0, 100_000)
EVAL_IDENTITY_SEEDS = range(1_000_000, 1_001_000)
SAMPLE_IDENTITY_SEED = 1_000_007
TRAIN_AUDIO_SEEDS = range(0, 100_000)
HELDOUT_AUDIO_SEED_START = 2_000_000

__all__ = [
    "Clip", "make_clip", "Identity", "HAIR_STYLES", "Motion", "motion_from_audio", "EXPRESSIONS",
    "ENERGIES", "render_frames", "render_reference", "mouth_box", "measure_mouth_opening",
    "synth_speech", "SAMPLE_RATE", "TRAIN_IDENTITY_SEEDS", "EVAL_IDENTITY_SEEDS",
    "SAMPLE_IDENTITY_SEED", "TRAIN_AUDIO_SEEDS", "HELDOUT_AUDIO_SEED_START",
]
