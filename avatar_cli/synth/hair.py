"""Hair styles as two static layers: `back` (behind the head and neck) and `front` (over the
forehead and face sides, drawn after the eyes and mouth).

Every style is the same few parts: a skull cap, a hairline above the forehead, and style
specific volumes (curtains, a bun, a curly mass). Distances are combined with min (union)
and max (intersection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .identity import Identity
from .layout import FaceLayout
from .sdf import Tensor, circle, coverage, ellipse, paint, rgb, rounded_box

_FAR = 10.0  # "no shape": a distance that covers no pixel


@dataclass(frozen=True)
class HairShape:
    back: Tensor  # (H, W) signed distance of hair behind the head
    front: Tensor  # (H, W) signed distance of hair in front of the face


def hair_shape(ident: Identity, lay: FaceLayout, u: Tensor, v: Tensor) -> HairShape:
    shape = _style_shape(ident, lay, u, v)
    if ident.hat == "none":
        return shape
    # Under a hat nothing pokes out above the brim (the hat covers the crown itself).
    brim = lay.cy - 0.5 * lay.b - 0.02
    return HairShape(torch.maximum(shape.back, brim - v), torch.maximum(shape.front, brim - v))


def _style_shape(ident: Identity, lay: FaceLayout, u: Tensor, v: Tensor) -> HairShape:
    a, b, cy = lay.a, lay.b, lay.cy
    style = ident.hair_style
    none = torch.full(torch.broadcast_shapes(u.shape, v.shape), _FAR)
    if style == "bald":
        return HairShape(none, none)
    skull = ellipse(u, v - (cy - 0.05), a * 1.07, b + 0.03)
    hl = ident.hairline + (0.08 if style in ("long", "bun") else 0.0)
    # Hairline: high over the forehead, sweeping down to the temples at about brow level.
    top = cy - b * hl
    hairline = top + (u / a) ** 2 * (lay.eye_y - 0.06 - top)
    cap = torch.maximum(skull, v - hairline)
    if style == "short":
        return HairShape(skull, cap)
    if style == "bun":
        bun = circle(u, v - (cy - b - 0.1), 0.13 * a / 0.4)
        return HairShape(torch.minimum(skull, bun), cap)
    if style == "curly":
        theta = torch.atan2(v - (cy - 0.1), u)
        bumps = 0.045 * torch.sin(13.0 * theta + ident.seed % 7)
        mass = ellipse(u, v - (cy - 0.1), a + 0.2, b + 0.08) - bumps * (a + 0.2)
        mass = torch.maximum(mass, v - (cy + 0.45 * b))
        curls = torch.maximum(skull, v - hairline - 0.02 * torch.sin(u * 70.0))
        return HairShape(torch.minimum(mass, skull), curls)
    if style == "bob":
        bottom = cy + 0.62 * b
        vol_top = cy - b - 0.09
        volume = rounded_box(u, v - (vol_top + bottom) / 2, a + 0.085, (bottom - vol_top) / 2, 0.16)
        bangs = torch.maximum(skull, v - (cy - 0.34 * b + 0.012 * torch.sin(u * 45.0)))
        sides = torch.maximum(volume, a * 0.8 - u.abs())
        return HairShape(torch.minimum(volume, skull), torch.minimum(bangs, sides))
    # long: a centre parting, side curtains framing the face, volume down behind the shoulders
    bottom, vol_top = 0.95, cy - b - 0.08
    volume = rounded_box(u, v - (vol_top + bottom) / 2, a + 0.13, (bottom - vol_top) / 2, 0.22)
    sides = torch.maximum(volume, a * 0.82 - u.abs())
    sides = torch.maximum(sides, v - 0.55)
    return HairShape(torch.minimum(volume, skull), torch.minimum(cap, sides))


def paint_hair_back(canvas: Tensor, shape: HairShape, ident: Identity, lay: FaceLayout, u: Tensor, v: Tensor, px: float) -> None:
    paint(canvas, _texture(ident, lay, u, v) * 0.78, coverage(shape.back, px))


def paint_hair_front(canvas: Tensor, shape: HairShape, ident: Identity, lay: FaceLayout, u: Tensor, v: Tensor, px: float) -> None:
    colour = _texture(ident, lay, u, v)
    if ident.hair_style == "long":  # darker parting line
        part = ((u - 0.03).abs() < 0.006) & (v < lay.cy - lay.b * 0.5)
        colour = colour * (1.0 - 0.3 * part.float())
    paint(canvas, colour, coverage(shape.front, px))


def _texture(ident: Identity, lay: FaceLayout, u: Tensor, v: Tensor) -> Tensor:
    """Hair colour with strands radiating from the crown (or ringlets for curly hair)."""
    base = rgb(ident.hair_color)
    if ident.hair_style == "curly":
        # Ringlets: rings around a jittered lattice of centres.
        cu, cv = u * 22.0 + torch.sin(v * 17.0), v * 22.0 + torch.sin(u * 13.0)
        ring = torch.sqrt((cu - cu.round()) ** 2 + (cv - cv.round()) ** 2)  # (H, W) 0..0.7
        pattern = torch.cos(ring * 9.0)
    else:
        theta = torch.atan2(u, v - (lay.cy - lay.b * 1.3))
        pattern = torch.sin(theta * 45.0 + 1.5 * torch.sin(theta * 7.0))
    shade = 0.95 + 0.05 * pattern  # (H, W)
    lift = 0.05 * (1.0 - min(1.0, sum(ident.hair_color) / 1.5))  # dark hair needs visible strands
    gloss = lift * (pattern > 0.85).float()
    return (base * shade.unsqueeze(0) + gloss.unsqueeze(0)).clamp(0, 1)

