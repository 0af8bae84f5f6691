"""Per-frame face parts: eyes (white, iris, pupil, lids), brows and mouth.

These are the only shapes that change from frame to frame, so they are drawn into two small
patches (the eye band and the mouth region) for a whole chunk of frames at once: every
per-frame parameter is a (T, 1, 1) tensor that broadcasts over the patch's pixel grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .identity import Identity
from .layout import JAW_DROP, MOUTH_HALF_OPEN_MAX, FaceLayout
from .sdf import Tensor, circle, coverage, ellipse, paint, rgb

EYE_WHITE = (0.97, 0.96, 0.93)
LASH = (0.09, 0.06, 0.06)
PUPIL = (0.04, 0.04, 0.05)
INNER_MOUTH = (0.13, 0.02, 0.03)  # luma ~0.045: far darker than any skin, the mouth meter's cue
TEETH = (0.96, 0.94, 0.88)
TONGUE = (0.80, 0.36, 0.40)


@dataclass(frozen=True)
class FrameParams:
    """Per-frame controls of one chunk, each (T, 1, 1)."""

    mouth_open: Tensor
    mouth_shape: Tensor
    blink: Tensor
    smile: Tensor
    surprise: Tensor


def paint_eyes(canvas: Tensor, u: Tensor, v: Tensor, px: float, ident: Identity, lay: FaceLayout, p: FrameParams) -> None:
    """canvas (T, 4, h, w) is the eye band; u (1, w), v (h, 1) its canonical coordinates."""
    x = u.abs() - lay.eye_x  # (1, w): both eyes at once, mirrored
    openness = (1.0 + 0.35 * p.surprise - 0.25 * p.smile) * (1.0 - p.blink)  # (T, 1, 1)
    eh = (lay.eye_h * openness).clamp(min=0.3 * px)
    ey = lay.eye_y + lay.eye_h * 0.45 * p.blink  # the upper lid travels further than the lower
    y = v - ey  # (T, h, 1)
    # Bounding in x keeps the thin-ellipse distance estimate from leaking past the corners.
    white_d = torch.maximum(ellipse(x, y, lay.eye_w, eh), x.abs() - lay.eye_w)  # (T, h, w)
    white = coverage(white_d, px)
    paint(canvas, rgb(EYE_WHITE), white)
    r = min(lay.eye_h * 0.95, lay.eye_w * 0.62)
    yi = v - lay.eye_y  # (h, 1): the eyeball does not move with the lid
    iris_d = circle(x, yi, r)  # (h, w)
    paint(canvas, rgb(ident.eye_color) * 0.55, coverage(iris_d, px) * white)
    paint(canvas, rgb(ident.eye_color), coverage(iris_d + 0.18 * r, px) * white)
    paint(canvas, rgb(PUPIL), coverage(circle(x, yi, 0.45 * r), px) * white)
    glint = circle(x + 0.3 * r * torch.sign(u), yi + 0.35 * r, 0.22 * r)
    paint(canvas, rgb((1.0, 1.0, 1.0)), coverage(glint, px) * white)
    # Lash line along the upper lid; when the eye closes it is all that remains.
    lid = torch.maximum(ellipse(x, y, lay.eye_w, eh.clamp(min=0.012)), x.abs() - lay.eye_w)
    lash = torch.maximum(lid.abs() - 0.007, y - 0.3 * eh - 0.004)
    paint(canvas, rgb(LASH), coverage(lash, px))
    paint_brows(canvas, u, v, px, ident, lay, p)


def paint_brows(canvas: Tensor, u: Tensor, v: Tensor, px: float, ident: Identity, lay: FaceLayout, p: FrameParams) -> None:
    xb = u.abs() - lay.eye_x  # (1, w), positive towards the temple
    t = (xb / lay.brow_w).clamp(-1.2, 1.2)
    lift = 0.045 * p.surprise - 0.006 * p.smile  # (T, 1, 1)
    arch = ident.brow_arch + 0.02 * p.surprise
    centre = lay.brow_y - lift - arch * (1.0 - t * t) + ident.brow_tilt * lay.brow_w * 0.5 * t  # (T, 1, w)
    half = ident.brow_thickness * 0.5 * (1.0 - 0.5 * t.clamp(min=0) ** 2)  # tapers outwards
    d = torch.maximum((v - centre).abs() - half, xb.abs() - lay.brow_w)  # (T, h, w)
    paint(canvas, rgb(ident.brow_color), coverage(d, px))


def paint_mouth(canvas: Tensor, u: Tensor, v: Tensor, px: float, ident: Identity, lay: FaceLayout, p: FrameParams) -> None:
    """Lips, dark inner mouth (height = MOUTH_HALF_OPEN_MAX * mouth_open), teeth and tongue."""
    ee, oo = p.mouth_shape.clamp(min=0), (-p.mouth_shape).clamp(min=0)
    w = lay.mouth_w * (1.0 + 0.18 * ee - 0.3 * oo + 0.22 * p.smile - 0.15 * p.surprise)  # (T, 1, 1)
    h = MOUTH_HALF_OPEN_MAX * p.mouth_open * (1.0 + 0.08 * oo - 0.08 * ee)
    yc = lay.mouth_y + JAW_DROP * h
    xn = (u / w).clamp(-1.3, 1.3)  # (T, 1, w)
    bend = 0.05 * p.smile - 0.008 * p.surprise  # corners up when smiling
    y = v - yc + bend * xn * xn  # (T, h, w): distance from the curved mouth line
    lip = rgb(ident.lip_color)
    ry = torch.where(y < 0, h + lay.lip_top, h + lay.lip_bottom)
    lips_d = ellipse(u, y, w, ry)
    paint(canvas, lip * 0.86, coverage(lips_d, px))
    paint(canvas, lip, coverage(torch.maximum(lips_d, -y), px))  # fuller, lighter lower lip
    line = torch.maximum(y.abs() - 0.6 * px, u.abs() - w * 0.92)
    paint(canvas, lip * 0.62, coverage(line, px))
    w_in, h_in = w * 0.86, h.clamp(min=0.25 * px)
    inner_d = torch.maximum(ellipse(u, y, w_in, h_in), u.abs() - w_in)
    paint(canvas, rgb(INNER_MOUTH), coverage(inner_d, px))
    teeth = torch.maximum(inner_d, y + 0.6 * h_in)  # upper teeth: top 20% of the opening
    paint(canvas, rgb(TEETH), coverage(torch.maximum(teeth, u.abs() - 0.8 * w_in), px))
    tongue = torch.maximum(inner_d, ellipse(u, y - 0.95 * h_in, 0.55 * w_in, 0.42 * h_in))
    paint(canvas, rgb(TONGUE), coverage(tongue, px))
    # Smile lines: short brackets just outside the mouth corners.
    xc = u.abs() - (w + 0.012)
    bracket = circle(xc + 0.035, v - yc + bend, 0.035).abs() - 0.005
    bracket = torch.maximum(bracket, -xc - 0.004)
    paint(canvas, rgb(ident.skin) * 0.68, coverage(bracket, px) * p.smile)
