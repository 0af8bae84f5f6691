"""Measure mouth opening from pixels alone: how lip sync is scored on any rendered face.

Method. Inside a fixed window under the nose (`mouth_box`, the same for every identity of
this generator and wide enough for the head sway), each pixel gets a soft "darkness" weight:
1 when its luma is below half the threshold, 0 above the threshold, linear in between. The
threshold is 45% of the reference picture's median luma in the same window, i.e. relative to
that person's skin, so dark skin is not mistaken for an open mouth and lips/nostril shading
stay below it. Summing the weights down each pixel column gives the height of dark
inner-mouth in that column; the opening is the mean of the 3 tallest columns (the middle of
the mouth, wherever sway put it), minus the same value on the reference (its closed lip
line), divided by the generator's dark height at mouth_open = 1 for that frame size. On
generator output that reads as `mouth_open` (within ~0.1); a model's output is on the same scale.

Rotation or shifts of a few pixels do not change a vertical extent measured per column, which
is what makes this robust to head sway; it needs no landmarks and no colour model.
"""

from __future__ import annotations

import numpy as np
import torch

from .layout import MEASURE_BOX, box_slices

# Dark inner-mouth height at mouth_open = 1 is FULL_OPEN_DARK_FRACTION * size - EDGE_LOSS_PX
# pixels: the opening runs from below the upper teeth to the tongue tip (~1.4 x the inner half
# height of 0.08 units), minus the anti-aliased rows blended with teeth or tongue, which read
# as not dark. Fitted on rendered frames of 16 identities x random vowel shapes and smiles at
# sizes 96-384 (the test suite checks the scale at 128 and 256).
FULL_OPEN_DARK_FRACTION = 0.0575
EDGE_LOSS_PX = 0.85
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
    threshold = 0.45 * float(ref_luma.median())
    score = _dark_height(_luma(frames[:, rows, cols]), threshold)  # (T,)
    baseline = _dark_height(ref_luma, threshold)  # (1,)
    full_open = max(FULL_OPEN_DARK_FRACTION * size - EDGE_LOSS_PX, 1.0)
    return ((score - baseline).clamp(min=0.0) / full_open).float()


def _luma(x: torch.Tensor) -> torch.Tensor:
    w = torch.tensor(_LUMA, dtype=torch.float32) / 255.0
    return x.float() @ w  # (T, h, w)


def _dark_height(luma: torch.Tensor, threshold: float) -> torch.Tensor:
    """Mean of the 3 tallest columns of soft dark-pixel counts, in pixels. luma (T, h, w)."""
    dark = ((threshold - luma) / (0.5 * threshold)).clamp(0.0, 1.0)
    columns = dark.sum(dim=1)  # (T, w)
    k = min(3, columns.shape[1])
    return columns.topk(k, dim=1).values.mean(dim=1)
