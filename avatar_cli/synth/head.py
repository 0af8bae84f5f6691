"""Static pre-render of one identity at one size: everything except the moving face parts.

Layer order (back to front): hair-back, neck, ears, earrings, face, nose | eyes, brows, mouth
(per frame) | hair-front, glasses, hat. The head is rendered upright in the canonical frame;
the renderer later warps it per frame. Backdrop and shirt are kept separately because they
do not move with the head.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .accessories import paint_earrings, paint_glasses, paint_hat
from .face import paint_ears, paint_face, paint_neck, paint_nose
from .hair import hair_shape, paint_hair_back, paint_hair_front
from .identity import Identity
from .layout import FaceLayout, box_slices
from .scene import background, torso
from .sdf import Tensor, over, pixel_grid, single_thread


@dataclass(frozen=True)
class Patch:
    """A region repainted every frame: what lies under and over the moving parts."""

    rows: slice
    cols: slice
    under: Tensor  # (4, h, w) premultiplied
    over: Tensor  # (4, h, w) premultiplied
    u: Tensor  # (1, w) canonical coordinates
    v: Tensor  # (h, 1)


@dataclass(frozen=True)
class HeadCanvas:
    size: int
    layout: FaceLayout
    head: Tensor  # (4, S, S) premultiplied upright head without its moving parts
    eyes: Patch
    mouth: Patch
    background: Tensor  # (3, S, S) opaque
    torso: Tensor  # (4, S, S) premultiplied


@lru_cache(maxsize=16)
def build_head(ident: Identity, size: int) -> HeadCanvas:
    with single_thread():
        return _build_head(ident, size)


def _build_head(ident: Identity, size: int) -> HeadCanvas:
    lay = FaceLayout.from_identity(ident)
    px = 2.0 / size
    u, v = pixel_grid(size)
    hair = hair_shape(ident, lay, u, v)
    under = torch.zeros(4, size, size)
    paint_hair_back(under, hair, ident, lay, u, v, px)
    paint_neck(under, u, v, ident, lay, px)
    paint_ears(under, u, v, ident, lay, px)
    paint_earrings(under, u, v, ident, lay, px)
    paint_face(under, u, v, ident, lay, px)
    paint_nose(under, u, v, ident, lay, px)
    top = torch.zeros(4, size, size)
    paint_hair_front(top, hair, ident, lay, u, v, px)
    paint_glasses(top, u, v, ident, lay, px)
    paint_hat(top, u, v, ident, lay, px)
    return HeadCanvas(
        size=size,
        layout=lay,
        head=over(top, under),
        eyes=_patch(lay.eye_box, size, under, top),
        mouth=_patch(lay.mouth_box, size, under, top),
        background=background(ident, u, v),
        torso=torso(ident, lay, u, v, px),
    )


def _patch(box: tuple[float, float, float, float], size: int, under: Tensor, top: Tensor) -> Patch:
    rows, cols = box_slices(box, size)
    u, v = pixel_grid(size, rows, cols)
    return Patch(rows, cols, under[:, rows, cols].clone(), top[:, rows, cols].clone(), u, v)
