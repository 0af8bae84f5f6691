"""Quality metrics on rendered frames. Pure functions of arrays: no models, no files.

Frames are uint8 (T, S, S, 3) unless said otherwise.
"""

import numpy as np
import torch

from avatar_cli.synth import measure_mouth_opening
from avatar_cli.synth.audio_features import frame_rms
from avatar_cli.synth.layout import box_slices

# The face of every generated identity lies inside this canonical box (u0, u1, v0, v1), whatever the sway.
FACE_BOX = (-0.40, 0.40, -0.45, 0.50)


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    a, b = a - a.mean(), b - b.mean()
    denom = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denom) if denom > 0 else 0.0


def loudness_envelope(audio: np.ndarray, sample_rate: int, fps: float, num_frames: int) -> np.ndarray:
    """RMS of the audio around each video frame (the generator's own per-frame loudness)."""
    return frame_rms(np.asarray(audio, np.float32), sample_rate, fps, num_frames)


def lip_sync(frames: torch.Tensor | np.ndarray, reference: np.ndarray, audio: np.ndarray, sample_rate: int,
             fps: float) -> float:
    """Pearson correlation of the loudness envelope with the mouth opening read from the pixels
    (`measure_mouth_opening`: dark inner-mouth height under the nose, relative to the reference)."""
    mouth = measure_mouth_opening(torch.as_tensor(np.asarray(frames)), reference).numpy()
    return pearson(loudness_envelope(audio, sample_rate, fps, len(mouth)), mouth)


def face_error(frames: torch.Tensor | np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per-frame mean absolute error (0..255) of the face region against the reference picture. -> (T,)"""
    rows, cols = box_slices(FACE_BOX, np.asarray(reference).shape[0])
    f = torch.as_tensor(np.asarray(frames))[:, rows, cols].float()
    r = torch.as_tensor(np.asarray(reference))[rows, cols].float()
    return (f - r).abs().mean(dim=(1, 2, 3)).numpy()


def drift_ratio(errors: np.ndarray, fps: float, early_s: float = 10.0, late_s: float = 60.0) -> tuple[float, float, float]:
    """Face error in the last `late_s` seconds vs the first `early_s` seconds -> (ratio, early, late).
    On a 10-minute render with the defaults that is the 10th minute vs the first 10 s; shorter renders
    shrink both windows to at most a sixth of the length each."""
    n = len(errors)
    e = max(1, min(int(early_s * fps), n // 6))
    l = max(1, min(int(late_s * fps), n // 6))
    early, late = float(np.mean(errors[:e])), float(np.mean(errors[-l:]))
    return late / max(early, 1e-6), early, late


def frame_changes(frames: torch.Tensor | np.ndarray) -> np.ndarray:
    """Mean absolute change (0..255) from each frame to the next. -> (T-1,)"""
    f = torch.as_tensor(np.asarray(frames)).float()
    return (f[1:] - f[:-1]).abs().mean(dim=(1, 2, 3)).numpy()


def seam_ratio(changes: np.ndarray, boundaries: list[int]) -> float:
    """Mean change into the frames where the output passes from one chunk to the next (`boundaries`: timeline
    frame indices, see `chunk_boundaries`) vs the mean change everywhere else."""
    at_seam = np.zeros(len(changes), dtype=bool)
    b = np.asarray([i for i in boundaries if 0 < i <= len(changes)], dtype=np.int64)
    at_seam[b - 1] = True  # change i goes from frame i to i + 1
    if not at_seam.any() or at_seam.all():
        return float("nan")
    return float(changes[at_seam].mean() / max(changes[~at_seam].mean(), 1e-6))


def chunk_boundaries(chunks) -> list[int]:
    """Timeline frames whose output comes from a different chunk than the frame before: every kept range's
    start, so with I chunks both ends of each I chunk (into it from N(k-1), out of it into N(k))."""
    return sorted({c.keep[0] for c in chunks if c.keep[0] > 0 and c.keep[1] > c.keep[0]})


def psnr(x: torch.Tensor, y: torch.Tensor) -> float:
    """PSNR in dB of two images/videos in [-1, 1] (peak-to-peak 2)."""
    mse = float((x.float() - y.float()).pow(2).mean())
    return float(10 * np.log10(4.0 / max(mse, 1e-12)))


def motion_energy(frames: torch.Tensor | np.ndarray, reference: np.ndarray) -> float:
    """Head-motion index: temporal std of the face region, averaged over its pixels (0..255)."""
    rows, cols = box_slices(FACE_BOX, np.asarray(reference).shape[0])
    f = torch.as_tensor(np.asarray(frames))[:, rows, cols].float()
    return float(f.std(dim=0).mean())


def direction_score(asked: np.ndarray, base: np.ndarray, truth_asked: np.ndarray, truth_base: np.ndarray) -> float:
    """Cosine between how the output moved (mean frame asked - mean frame base) and how the generator
    moves the same region for the same words: > 0 means the prompt pushed in the direction asked."""
    d = (asked.astype(np.float64) - base).ravel()
    g = (truth_asked.astype(np.float64) - truth_base).ravel()
    denom = np.linalg.norm(d) * np.linalg.norm(g)
    return float(d @ g / denom) if denom > 0 else 0.0


def contact_sheet(frames: list[np.ndarray], columns: int = 4) -> np.ndarray:
    """Tile equally sized uint8 (S, S, 3) frames into one picture, with a 2-px grey gutter."""
    s = frames[0].shape[0]
    rows = -(-len(frames) // columns)
    g = 2
    sheet = np.full((rows * (s + g) + g, columns * (s + g) + g, 3), 128, np.uint8)
    for i, f in enumerate(frames):
        r, c = divmod(i, columns)
        sheet[g + r * (s + g): g + r * (s + g) + s, g + c * (s + g): g + c * (s + g) + s] = f
    return sheet
