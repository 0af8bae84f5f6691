"""Procedural training-data generator: determinism, audio, motion, rendering and the mouth meter."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from avatar_cli.synth import (
    EVAL_IDENTITY_SEEDS,
    HAIR_STYLES,
    HELDOUT_AUDIO_SEED_START,
    SAMPLE_IDENTITY_SEED,
    TRAIN_AUDIO_SEEDS,
    TRAIN_IDENTITY_SEEDS,
    Identity,
    Motion,
    make_clip,
    measure_mouth_opening,
    motion_from_audio,
    mouth_box,
    render_frames,
    render_reference,
    synth_speech,
)
from avatar_cli.synth.layout import FaceLayout

SR, FPS = 16000, 25.0


def frame_rms_loop(audio: np.ndarray, num_frames: int) -> np.ndarray:
    """Reference loudness envelope, written independently of the library: one window per
    frame, [i / fps, (i + 1) / fps), i.e. centred on the frame time (i + 0.5) / fps."""
    hop = SR / FPS
    out = np.zeros(num_frames)
    for i in range(num_frames):
        w = audio[int(round(i * hop)) : int(round((i + 1) * hop))].astype(np.float64)
        out[i] = np.sqrt(np.mean(w * w)) if w.size else 0.0
    return out


def corr(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> float:
    return float(np.corrcoef(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))[0, 1])


def with_fields(m: Motion, **values: float | torch.Tensor) -> Motion:
    def field(name: str) -> torch.Tensor:
        if name not in values:
            return getattr(m, name)
        return torch.as_tensor(values[name], dtype=torch.float32).expand(m.num_frames).clone()

    return Motion(**{name: field(name) for name in Motion.FIELDS})


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return synth_speech(11, 10.0)


# --- identities -------------------------------------------------------------------------


def test_identity_is_deterministic_and_seeds_differ() -> None:
    assert Identity.from_seed(42) == Identity.from_seed(42)
    people = [Identity.from_seed(s) for s in range(300)]
    assert len({p for p in people}) == 300
    assert set(HAIR_STYLES) <= {p.hair_style for p in people}
    assert len({p.skin for p in people}) == 300
    assert 0.1 < np.mean([p.glasses for p in people]) < 0.4
    assert 0.1 < np.mean([p.earrings for p in people]) < 0.4
    assert 0.08 < np.mean([p.hat != "none" for p in people]) < 0.35
    skin_luma = [0.2126 * p.skin[0] + 0.7152 * p.skin[1] + 0.0722 * p.skin[2] for p in people]
    assert min(skin_luma) < 0.3 and max(skin_luma) > 0.75  # light and dark skin both occur


def test_reference_is_deterministic_distinct_and_portrait_like() -> None:
    a, b = render_reference(7, 128), render_reference(7, 128)
    assert a.dtype == np.uint8 and a.shape == (128, 128, 3)
    assert a.tobytes() == b.tobytes()
    assert render_reference(8, 128).tobytes() != a.tobytes()
    # The face fills a good part of the frame: the skin colour covers > 15% of pixels.
    skin = np.array(Identity.from_seed(7).skin) * 255
    near_skin = np.abs(a.astype(np.float64) - skin).max(axis=2) < 40
    assert near_skin.mean() > 0.15


def test_mouth_box_sits_on_the_face_for_any_identity() -> None:
    # The meter's window must hold skin and lips only (never hair/background) for every face.
    rows, cols = mouth_box(96)
    for seed in range(30):
        ident = Identity.from_seed(seed)
        ref = render_reference(seed, 96)[rows, cols].astype(np.float64)  # (h, w, 3)
        shades = [np.array(ident.skin)] + [np.array(ident.lip_color) * k for k in (1.0, 0.86, 0.5)]
        dist = np.stack([np.abs(ref - c * 255).max(axis=2) for c in shades]).min(axis=0)
        assert (dist > 70).mean() < 0.02, seed


# --- speech -----------------------------------------------------------------------------


def test_speech_deterministic_shape_and_level(speech: np.ndarray) -> None:
    again = synth_speech(11, 10.0)
    assert speech.dtype == np.float32 and speech.shape == (160000,)
    assert speech.tobytes() == again.tobytes()
    assert synth_speech(12, 10.0).tobytes() != speech.tobytes()
    assert 0.45 <= float(np.abs(speech).max()) <= 0.5
    assert synth_speech(3, 1.0, sample_rate=8000).shape == (8000,)


def test_speech_has_pauses_and_energy(speech: np.ndarray) -> None:
    rms = frame_rms_loop(speech, 250)
    silent = rms < 0.01 * rms.max()
    assert 0.1 < silent.mean() < 0.6
    assert rms.mean() > 0.02  # real energy, not near-silence
    # A phrase pause: at least 5 consecutive silent frames (0.2 s) after the first phrase.
    runs, run = [], 0
    for s in silent[10:]:
        run = run + 1 if s else 0
        runs.append(run)
    assert max(runs) >= 5


def test_a_minute_of_speech_is_whole() -> None:
    """Its speed is bench/check_speed.py's."""
    audio = synth_speech(5, 60.0)
    assert audio.shape == (60 * SR,) and audio.dtype == np.float32
    assert np.isfinite(audio).all() and np.abs(audio).max() == pytest.approx(0.5, abs=1e-3)


# --- motion -----------------------------------------------------------------------------


def test_motion_shapes_ranges_and_determinism(speech: np.ndarray) -> None:
    m = motion_from_audio(speech, SR, FPS, 250, seed=1, expression="smiling", energy="lively")
    for name in Motion.FIELDS:
        x = getattr(m, name)
        assert x.shape == (250,) and x.dtype == torch.float32, name
    assert 0 <= m.mouth_open.min() and m.mouth_open.max() <= 1
    assert -1 <= m.mouth_shape.min() and m.mouth_shape.max() <= 1
    assert (m.mouth_shape < -0.3).any() and (m.mouth_shape > 0.3).any()  # vowel classes vary
    assert m.as_tensor().shape == (250, 8)
    again = motion_from_audio(speech, SR, FPS, 250, seed=1, expression="smiling", energy="lively")
    assert torch.equal(m.as_tensor(), again.as_tensor())
    other = motion_from_audio(speech, SR, FPS, 250, seed=2, expression="smiling", energy="lively")
    assert not torch.equal(m.head_dx, other.head_dx)


def test_mouth_follows_loudness_and_closes_in_silence(speech: np.ndarray) -> None:
    m = motion_from_audio(speech, SR, FPS, 250, seed=3)
    rms = frame_rms_loop(speech, 250)
    assert corr(m.mouth_open, rms) > 0.9
    quiet = rms < 0.01 * rms.max()
    assert quiet.sum() > 10 and float(m.mouth_open[torch.from_numpy(quiet)].max()) == 0.0
    assert float(m.mouth_open.max()) > 0.8  # loud syllables open it wide
    silent = motion_from_audio(np.zeros(SR * 2, np.float32), SR, FPS, 50, seed=3)
    assert float(silent.mouth_open.abs().max()) == 0.0


def test_blinks_occur(speech: np.ndarray) -> None:
    blink = motion_from_audio(speech, SR, FPS, 250, seed=4).blink.numpy()
    closed = blink > 0.8
    starts = int(np.sum(closed[1:] & ~closed[:-1]) + closed[0])
    assert 1 <= starts <= 6  # every 2-6 s over 10 s
    assert closed.mean() < 0.1  # and short


def test_lively_moves_more_than_calm(speech: np.ndarray) -> None:
    calm = motion_from_audio(speech, SR, FPS, 250, seed=5, energy="calm")
    lively = motion_from_audio(speech, SR, FPS, 250, seed=5, energy="lively")
    for name in ("head_dx", "head_dy", "head_tilt"):
        assert getattr(lively, name).std() > 2 * getattr(calm, name).std(), name
        assert getattr(calm, name).std() > 0, name  # calm still sways a little


def test_expressions_set_smile_and_surprise(speech: np.ndarray) -> None:
    m = {e: motion_from_audio(speech, SR, FPS, 250, seed=6, expression=e) for e in ("neutral", "smiling", "surprised")}
    assert m["smiling"].smile.min() > 0.6 > m["neutral"].smile.max()
    assert m["surprised"].surprise.min() > 0.6 and m["neutral"].surprise.max() == 0
    with pytest.raises(ValueError):
        motion_from_audio(speech, SR, FPS, 250, seed=6, expression="angry")


# --- rendering --------------------------------------------------------------------------


def test_render_shapes_determinism_and_identity_difference(speech: np.ndarray) -> None:
    m = motion_from_audio(speech, SR, FPS, 40, seed=7)
    a = render_frames(Identity.from_seed(1), m, 96)
    assert a.dtype == torch.uint8 and a.shape == (40, 96, 96, 3)
    assert torch.equal(a, render_frames(Identity.from_seed(1), m, 96))
    assert not torch.equal(a, render_frames(Identity.from_seed(2), m, 96))
    assert render_frames(Identity.from_seed(1), Motion.neutral(0), 64).shape == (0, 64, 64, 3)
    # The reference is exactly the neutral frame.
    ref = render_reference(1, 96)
    assert np.array_equal(render_frames(Identity.from_seed(1), Motion.neutral(1), 96)[0].numpy(), ref)


def test_head_sway_moves_the_head_but_not_the_background() -> None:
    ident = Identity.from_seed(3)
    still = render_frames(ident, Motion.neutral(1), 128)[0].int()
    moved = render_frames(ident, with_fields(Motion.neutral(1), head_dx=0.03, head_tilt=0.05), 128)[0].int()
    assert (still[:12, :12] - moved[:12, :12]).abs().max() == 0  # top-left backdrop corner
    assert (still[30:90, 30:98] - moved[30:90, 30:98]).abs().float().mean() > 5  # the face


def test_mouth_opens_and_blink_closes_eyes() -> None:
    ident = Identity.from_seed(4)
    base = Motion.neutral(3)
    frames = render_frames(ident, with_fields(base, mouth_open=torch.tensor([0.0, 1.0, 0.0]), blink=torch.tensor([0.0, 0.0, 1.0])), 128)
    rows, cols = mouth_box(128)
    luma = frames.float().mean(-1)
    assert luma[1][rows, cols].lt(50).sum() > luma[0][rows, cols].lt(50).sum() + 60  # dark open mouth
    eyes = slice(40, 64)  # eye band at 128 px
    assert (luma[2][eyes] - luma[0][eyes]).abs().mean() > 1.5  # closed lids hide the eye whites


def test_smiling_differs_from_neutral_at_the_mouth_corners(speech: np.ndarray) -> None:
    ident = Identity.from_seed(5)
    neutral = motion_from_audio(speech, SR, FPS, 20, seed=8, expression="neutral")
    smiling = motion_from_audio(speech, SR, FPS, 20, seed=8, expression="smiling")
    # Same sway and blink so only the expression differs.
    smiling = with_fields(neutral, smile=smiling.smile)
    n = render_frames(ident, neutral, 128).float()
    s = render_frames(ident, smiling, 128).float()
    lay = FaceLayout.from_identity(ident)
    row, col = round((1 + lay.mouth_y) * 64), round((1 + lay.mouth_w) * 64)  # right mouth corner
    rows = slice(row - 5, row + 4)
    for c in (slice(col - 4, col + 5), slice(127 - col - 4, 127 - col + 5)):
        assert (n[:, rows, c] - s[:, rows, c]).abs().mean() > 3.0
    assert (n[:, :10] - s[:, :10]).abs().max() == 0  # nothing changes far from the face


# --- the mouth meter --------------------------------------------------------------------


def test_measure_tracks_mouth_open_on_three_identities(speech: np.ndarray) -> None:
    for k, seed in enumerate((10, 21, 1_000_007)):
        m = motion_from_audio(speech, SR, FPS, 250, seed=seed, expression=("neutral", "smiling", "surprised")[k], energy="lively")
        frames = render_frames(Identity.from_seed(seed), m, 128)
        measured = measure_mouth_opening(frames, render_reference(seed, 128))
        assert measured.shape == (250,) and measured.dtype == torch.float32
        assert corr(measured, m.mouth_open) > 0.9, seed
        closed = m.mouth_open == 0
        assert float(measured[closed].mean()) < 0.08, seed


def test_measure_scale_reads_as_mouth_open() -> None:
    base = Motion.neutral(5)
    m = with_fields(base, mouth_open=torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]), head_dx=0.01, head_tilt=-0.03)
    for size in (128, 256):
        for seed in (30, 31):
            got = measure_mouth_opening(render_frames(Identity.from_seed(seed), m, size), render_reference(seed, size))
            assert torch.allclose(got, m.mouth_open, atol=0.15), (size, seed, got)


def test_measure_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError):
        measure_mouth_opening(torch.zeros(2, 64, 64, 3, dtype=torch.uint8), np.zeros((32, 32, 3), np.uint8))


# --- clips and seeds --------------------------------------------------------------------


def test_make_clip() -> None:
    clip = make_clip(SAMPLE_IDENTITY_SEED, HELDOUT_AUDIO_SEED_START, 2.0, fps=25, size=64)
    assert clip.frames.shape == (50, 64, 64, 3) and clip.frames.dtype == torch.uint8
    assert clip.audio.shape == (32000,) and clip.audio.dtype == np.float32 and clip.sample_rate == 16000
    assert clip.motion.num_frames == 50 and clip.reference.shape == (64, 64, 3)
    assert clip.prompt == f"{clip.expression}, {clip.energy}"
    again = make_clip(SAMPLE_IDENTITY_SEED, HELDOUT_AUDIO_SEED_START, 2.0, fps=25, size=64)
    assert torch.equal(clip.frames, again.frames) and clip.prompt == again.prompt
    forced = make_clip(SAMPLE_IDENTITY_SEED, HELDOUT_AUDIO_SEED_START, 2.0, size=64, expression="surprised", energy="calm")
    assert forced.prompt == "surprised, calm"
    labels = {make_clip(s, s, 0.2, size=32).prompt for s in range(12)}
    assert len(labels) >= 3  # labels are drawn from the seeds


def test_seed_ranges_are_disjoint() -> None:
    assert SAMPLE_IDENTITY_SEED in EVAL_IDENTITY_SEEDS and SAMPLE_IDENTITY_SEED not in TRAIN_IDENTITY_SEEDS
    assert max(TRAIN_IDENTITY_SEEDS) < min(EVAL_IDENTITY_SEEDS)
    assert max(TRAIN_AUDIO_SEEDS) < HELDOUT_AUDIO_SEED_START
