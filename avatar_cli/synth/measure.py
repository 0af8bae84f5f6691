"""Measure mouth opening from pixels alone: how lip sync is scored on any rendered face.

Method. Inside a fixed window under the nose (`mouth_box`, the same for every identity of
this generator and wide enough for the head sway), each pixel gets a soft "darkness" weight:
1 when its luma is below half the threshold, 0 above the threshold, linear in between. The
threshold is 55% of the reference picture's median luma in the same window, i.e. relative to
that person's skin, so dark skin is not mistaken for an open mouth and lips/nostril shading
stay below it. Summing the weights down each pixel column gives the height of dark
inner-mouth in that column; the opening is the mean of the 3 tallest columns (the middle of
the mouth, wherever sway put it), minus the same value on the reference (its closed lip
line), divided by the generator's dark height at mouth_open = 1. On generator output that
reads approximately as `mouth_open`; on a model's output it is the same scale.

Rotation or shifts of a few pixels do not change a vertical extent measured per column, which
is what makes this robust to head sway; it needs no landmarks and no colour model.
"""

from __future__ import annotations

import numpy as np
import torch

from .layout import MEASURE_BOX, MOUTH_HALF_OPEN_MAX, box_slices

# Dark inner-mouth height at mouth_open = 1, as a fraction of the frame height: the opening
# spans from below the upper teeth (-0.6 h) to the tongue tip (+0.53 h), h = 0.072 units.
# Calibrated on rendered frames (see tests/test_synth.py::test_measure_scale).
DARK_HEIGHT_AT_FULL_OPEN = 1.13 * MOUTH_HALF_OPEN_MAX / 2.0
_LUMA = (0.2126, 0.7152, 0.0722)


def mouth_box(size: int) -> tuple[slice, slice]:
    """(rows, cols) of the window the meter reads, for frames of size x size."""
    return box_slices(MEASURE_BOX, size)


def measure_mouth_opening(frames: torch.Tensor, reference: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Estimated mouth opening per frame, float32 (T,), ~0 closed .. ~1 fully open.

    frames: uint8 (T, H, W, 3) square frames; reference: uint8 (H, W, 3) of the same person
    with a closed mouth (the clip's reference picture).
    """
    frames = torch.as_tensor(frames)
    ref = torch.as_tensor(np.asarray(reference)).unsqueeze(0)
    if frames.ndim != 4 or frames.shape[1] != frames.shape[2] or frames.shape[-1] != 3:
        raise ValueError(f"frames must be (T, S, S, 3), got {tuple(frames.shape)}")
    if tuple(ref.shape[1:]) != tuple(frames.shape[1:]):
        raise ValueError("reference must have the same size as the frames")
    size = int(frames.shape[1])
    rows, cols = mouth_box(size)
    ref_luma = _luma(ref[:, rows, cols])  # (1, h, w)
    threshold = 0.55 * float(ref_luma.median())
    score = _dark_height(_luma(frames[:, rows, cols]), threshold)  # (T,)
    baseline = _dark_height(ref_luma, threshold)  # (1,)
    return ((score - baseline).clamp(min=0.0) / (DARK_HEIGHT_AT_FULL_OPEN * size)).float()


def _luma(x: torch.Tensor) -> torch.Tensor:
    w = torch.tensor(_LUMA, dtype=torch.float32) / 255.0
    return x.float() @ w  # (T, h, w)


def _dark_height(luma: torch.Tensor, threshold: float) -> torch.Tensor:
    """Mean of the 3 tallest columns of soft dark-pixel counts, in pixels. luma (T, h, w)."""
    dark = ((threshold - luma) / (0.5 * threshold)).clamp(0.0, 1.0)
    columns = dark.sum(dim=1)  # (T, w)
    k = min(3, columns.shape[1])
    return columns.topk(k, dim=1).values.mean(dim=1)
