"""Accessories: glasses and hats (over everything), earrings (hanging below the ears)."""

from __future__ import annotations

import torch

from .face import ear_centre
from .identity import Identity
from .layout import FaceLayout
from .sdf import Tensor, circle, coverage, ellipse, paint, rgb, rounded_box


def paint_earrings(canvas: Tensor, u: Tensor, v: Tensor, ident: Identity, lay: FaceLayout, px: float) -> None:
    if not ident.earrings:
        return
    ex, ey = ear_centre(ident, lay)
    x, y = u.abs() - ex, v - (ey + 0.1)
    colour = rgb(ident.earring_color)
    if ident.seed % 2:  # hoop
        paint(canvas, colour * 0.9, coverage(circle(x, y, 0.026).abs() - 0.006, px))
    else:  # stud with a highlight
        paint(canvas, colour * 0.85, coverage(circle(x, y + 0.02, 0.018), px))
        paint(canvas, (colour * 1.2).clamp(0, 1), coverage(circle(x + 0.006, y + 0.026, 0.006), px))


def paint_glasses(canvas: Tensor, u: Tensor, v: Tensor, ident: Identity, lay: FaceLayout, px: float) -> None:
    if not ident.glasses:
        return
    colour, th = rgb(ident.glasses_color), 0.012
    x, y = u.abs() - lay.eye_x, v - lay.eye_y
    if ident.glasses_round:
        r = max(lay.eye_w * 1.3, lay.eye_h * 1.9)
        rim, half_w = circle(x, y, r), r
    else:
        half_w = lay.eye_w * 1.45
        rim, r = rounded_box(x, y, half_w, lay.eye_h * 1.75, 0.03), half_w
    paint(canvas, rgb((0.85, 0.92, 1.0)), coverage(rim, px) * 0.14)  # faint lens glare
    paint(canvas, colour, coverage(rim.abs() - th / 2, px))
    inner = lay.eye_x - half_w
    bridge = torch.maximum(u.abs() - inner - 0.004, (y + 0.012).abs() - th / 2)
    arm = torch.maximum((u.abs() - (lay.eye_x + half_w + lay.a) / 2).abs() - (lay.a - lay.eye_x - half_w) / 2, (y + 0.01).abs() - th / 2)
    paint(canvas, colour, coverage(torch.minimum(bridge, arm), px))


def paint_hat(canvas: Tensor, u: Tensor, v: Tensor, ident: Identity, lay: FaceLayout, px: float) -> None:
    if ident.hat == "none":
        return
    a, b, cy = lay.a, lay.b, lay.cy
    colour = rgb(ident.hat_color)
    brim_v = cy - 0.5 * b
    dome = torch.maximum(ellipse(u, v - (cy - 0.08), a * 1.12, b + 0.06), v - brim_v)
    if ident.hat == "beanie":
        ribs = (0.9 + 0.1 * torch.sin(u * 110.0)).unsqueeze(0)  # (1, 1, W)
        paint(canvas, colour, coverage(dome, px))
        band = torch.maximum(ellipse(u, v - (cy - 0.06), a * 1.14, b + 0.06), (v - brim_v + 0.035).abs() - 0.04)
        paint(canvas, colour * 0.8 * ribs, coverage(band, px))
        paint(canvas, (colour * 1.15).clamp(0, 1), coverage(circle(u, v - (cy - b - 0.13), 0.065), px))
        return
    paint(canvas, colour, coverage(dome, px))
    visor = torch.maximum(ellipse(u, v - brim_v, a * 0.95, 0.06), brim_v - 0.012 - v)
    paint(canvas, colour * 0.72, coverage(visor, px))
    paint(canvas, colour * 0.8, coverage(circle(u, v - (cy - b - 0.135), 0.022), px))
