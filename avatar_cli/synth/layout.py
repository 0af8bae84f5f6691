"""Canonical portrait geometry: where every face part sits, shared by renderer and mouth meter.

All lengths are canonical units (the frame spans [-1, 1], so 0.1 is 5% of the width). The
face centre is fixed for every identity and the mouth height varies only a little, which is
what lets `MEASURE_BOX` find the mouth of any generated face without landmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .identity import Identity

FACE_CY = -0.08  # face ellipse centre (v); the face spans roughly v in [-0.68, 0.52]
PIVOT = (0.0, 0.62)  # head tilt pivot: the base of the neck, hidden under the collar
MOUTH_HALF_OPEN_MAX = 0.08  # inner-mouth half height at mouth_open = 1
JAW_DROP = 0.5  # the mouth centre moves down by this x inner half height (the jaw opens)
# Region the mouth meter reads (u0, u1, v0, v1). Narrow in u on purpose: it always lies on
# lips, skin or neck (never hair or background) yet holds the mouth centre under any sway.
MEASURE_BOX = (-0.10, 0.10, 0.13, 0.46)

Box = tuple[float, float, float, float]  # (u0, u1, v0, v1)


@dataclass(frozen=True)
class FaceLayout:
    """Derived positions of one identity's face parts (canonical units)."""

    cy: float
    a: float  # face half width
    b: float  # face half height
    eye_x: float
    eye_y: float
    eye_w: float
    eye_h: float
    brow_y: float  # brow centre at rest
    brow_w: float
    nose_y: float
    mouth_y: float  # closed-mouth line
    mouth_w: float
    lip_top: float  # upper lip thickness
    lip_bottom: float
    eye_box: Box  # region the per-frame eye/brow pass repaints
    mouth_box: Box  # region the per-frame mouth pass repaints

    @classmethod
    def from_identity(cls, ident: Identity) -> "FaceLayout":
        a, b, cy = ident.face_width, ident.face_height, FACE_CY
        eye_x = a * ident.eye_spacing
        eye_y = cy + 0.02
        eye_w, eye_h = ident.eye_width, ident.eye_height
        brow_y = eye_y - eye_h - 0.045
        brow_w = eye_w * 1.15
        mouth_y = cy + 0.57 * b
        mouth_w = ident.mouth_width
        lip_top, lip_bottom = ident.lip_thickness * 0.8, ident.lip_thickness * 1.05
        # Boxes hold the largest shapes motion can produce (wide eyes, raised brows, smile,
        # fully open jaw) plus a few pixels of anti-aliasing margin.
        eye_box = (
            -(eye_x + brow_w + 0.03),
            eye_x + brow_w + 0.03,
            brow_y - 0.13,
            eye_y + eye_h * 1.4 + 0.02,
        )
        mouth_box = (
            -(mouth_w * 1.3 + 0.07),
            mouth_w * 1.3 + 0.07,
            mouth_y - MOUTH_HALF_OPEN_MAX - lip_top - 0.07,
            mouth_y + MOUTH_HALF_OPEN_MAX * (1 + JAW_DROP) * 1.15 + lip_bottom + 0.03,
        )
        return cls(
            cy=cy, a=a, b=b, eye_x=eye_x, eye_y=eye_y, eye_w=eye_w, eye_h=eye_h,
            brow_y=brow_y, brow_w=brow_w, nose_y=cy + 0.31 * b, mouth_y=mouth_y,
            mouth_w=mouth_w, lip_top=lip_top, lip_bottom=lip_bottom,
            eye_box=eye_box, mouth_box=mouth_box,
        )


def box_slices(box: Box, size: int) -> tuple[slice, slice]:
    """(rows, cols) pixel slices that cover a canonical box at this image size."""
    u0, u1, v0, v1 = box

    def to_px(lo: float, hi: float) -> slice:
        start = max(0, int((lo + 1.0) * 0.5 * size))
        stop = min(size, int((hi + 1.0) * 0.5 * size + 0.999) + 1)
        return slice(start, stop)

    return to_px(v0, v1), to_px(u0, u1)
