"""Static skin layers of the head: neck, ears, face outline with shading, blush and nose.

These are rendered once per identity on the full canonical grid (not per frame), so they can
afford numeric-gradient distances and soft shading.
"""

from __future__ import annotations

import torch

from .identity import Identity
from .layout import FaceLayout
from .sdf import Tensor, circle, coverage, ellipse, implicit_distance, paint, rgb, rounded_box


NECK_WIDTH = 0.5  # neck half width as a fraction of the face half width


def face_distance(u: Tensor, v: Tensor, ident: Identity, lay: FaceLayout, px: float, dv: float = 0.0) -> Tensor:
    """Distance to the face outline: an ellipse whose lower half narrows into a jaw/chin."""
    x = u.abs()
    yn = (v - lay.cy - dv) / lay.b  # (H, 1)
    lower = yn.clamp(0.0, 1.0)
    k = 1.0 - ident.jaw_taper * lower * lower  # narrower towards the chin
    q = torch.where(yn > 0, torch.tensor(ident.chin_power), torch.tensor(2.0))  # (H, 1)
    f = (x / (lay.a * k)) ** 2 + yn.abs() ** q - 1.0  # (H, W)
    return implicit_distance(f, px)


def face_half_width(ident: Identity, lay: FaceLayout, v: float) -> float:
    yn = (v - lay.cy) / lay.b
    q = ident.chin_power if yn > 0 else 2.0
    k = 1.0 - ident.jaw_taper * min(max(yn, 0.0), 1.0) ** 2
    return lay.a * k * max(0.0, 1.0 - abs(yn) ** q) ** 0.5


def ear_centre(ident: Identity, lay: FaceLayout) -> tuple[float, float]:
    ey = lay.eye_y + 0.06
    return face_half_width(ident, lay, ey) + 0.01, ey


def paint_neck(canvas: Tensor, u: Tensor, v: Tensor, ident: Identity, lay: FaceLayout, px: float) -> None:
    skin = rgb(ident.skin)
    half = lay.a * NECK_WIDTH
    top, bottom = lay.cy + 0.2, 1.15
    d = rounded_box(u, v - (top + bottom) / 2, half, (bottom - top) / 2, 0.05)
    neck = coverage(d, px)
    paint(canvas, skin * 0.86, neck)
    # The jaw casts a soft shadow on the neck: the face outline shifted down, heavily blurred.
    shadow = coverage(face_distance(u, v, ident, lay, px, dv=0.05), px, soft=10.0)
    paint(canvas, skin * 0.55, neck * shadow * 0.45)


def paint_ears(canvas: Tensor, u: Tensor, v: Tensor, ident: Identity, lay: FaceLayout, px: float) -> None:
    skin = rgb(ident.skin)
    ex, ey = ear_centre(ident, lay)
    x = u.abs() - ex
    paint(canvas, skin * 0.93, coverage(ellipse(x, v - ey, 0.048, 0.08), px))
    paint(canvas, skin * 0.78, coverage(ellipse(x - 0.008, v - ey, 0.022, 0.05), px, soft=2.0))


def paint_face(canvas: Tensor, u: Tensor, v: Tensor, ident: Identity, lay: FaceLayout, px: float) -> None:
    skin = rgb(ident.skin)
    d = face_distance(u, v, ident, lay, px)  # (H, W)
    # Shading: a darker rim (rounded look) and a soft highlight on the forehead / cheek.
    rim = (1.0 + d / 0.09).clamp(0.0, 1.0)  # 1 at the outline, 0 deeper than 0.09 inside
    light = torch.exp(-(((u + 0.1) / 0.25) ** 2 + ((v - lay.cy + 0.18) / 0.22) ** 2))
    shade = (1.0 - 0.13 * rim * rim + 0.05 * light).unsqueeze(0)  # (1, H, W)
    paint(canvas, (skin * shade).clamp(0, 1), coverage(d, px))
    if ident.blush > 0:
        cheek = torch.exp(-(((u.abs() - lay.a * 0.56) / 0.075) ** 2 + ((v - lay.mouth_y + 0.1) / 0.05) ** 2))
        paint(canvas, rgb((0.93, 0.42, 0.45)), cheek * ident.blush)


def paint_nose(canvas: Tensor, u: Tensor, v: Tensor, ident: Identity, lay: FaceLayout, px: float) -> None:
    skin = rgb(ident.skin)
    s, ny = ident.nose_size, lay.nose_y
    if ident.nose_style == "line":
        # One shaded bridge line ending in a small hook at the tip.
        length = 0.07 * s
        t = ((v - (ny - length)) / length).clamp(0.0, 1.0)
        xc = 0.01 * s + 0.016 * s * t * t
        bridge = torch.maximum((u - xc).abs() - 0.004 * (0.3 + t), (v - ny + length / 2).abs() - length / 2)
        paint(canvas, skin * 0.74, coverage(bridge, px, soft=1.5) * 0.7)
        hook = ellipse(u - 0.004, v - ny - 0.008, 0.026 * s, 0.012 * s)
        paint(canvas, skin * 0.74, coverage(hook.abs() - 0.004, px, soft=1.5) * (v > ny).float() * 0.8)
        return
    r = (0.028 if ident.nose_style == "button" else 0.038) * s
    paint(canvas, skin * 0.84, coverage(circle(u, v - ny, r), px, soft=4.0) * 0.8)
    paint(canvas, (skin * 1.08).clamp(0, 1), coverage(circle(u + 0.3 * r, v - ny + 0.35 * r, 0.3 * r), px, soft=3.0) * 0.6)
    nostrils = ellipse(u.abs() - 0.55 * r, v - ny - 0.55 * r, 0.3 * r, 0.17 * r)
    paint(canvas, skin * 0.66, coverage(nostrils, px, soft=1.5))
