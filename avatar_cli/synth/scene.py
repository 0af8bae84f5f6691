"""The parts of a portrait that do not move with the head: backdrop and shirt/shoulders.

The shirt is composited over the warped head so the neck slides under the collar when the
head sways; the backdrop stays put, as in a locked-off camera shot.
"""

from __future__ import annotations

import torch

from .face import NECK_WIDTH
from .identity import Identity
from .layout import FaceLayout
from .sdf import Tensor, coverage, ellipse, paint, rgb


def background(ident: Identity, u: Tensor, v: Tensor) -> Tensor:
    """Opaque backdrop colour (3, H, W): solid or a two-tone gradient, with a soft vignette."""
    top, bottom = rgb(ident.background_top), rgb(ident.background_bottom)
    if ident.background_style == "vertical":
        t = ((v + 1.0) / 2.0).expand(-1, u.shape[1])
    elif ident.background_style == "diagonal":
        t = ((u + v + 2.0) / 4.0)
    else:
        t = torch.zeros(v.shape[0], u.shape[1])
    t = t.unsqueeze(0)  # (1, H, W)
    colour = top * (1.0 - t) + bottom * t
    glow = 1.0 + 0.07 * torch.exp(-((u / 0.7) ** 2 + ((v + 0.1) / 0.7) ** 2))  # light behind the head
    vignette = 1.0 - 0.12 * (u * u + v * v) / 2.0
    return (colour * (glow * vignette).unsqueeze(0)).clamp(0, 1)


def torso(ident: Identity, lay: FaceLayout, u: Tensor, v: Tensor, px: float) -> Tensor:
    """Premultiplied RGBA shirt (4, H, W) with a crew neckline the neck disappears into."""
    canvas = torch.zeros(4, v.shape[0], u.shape[1])
    shirt = rgb(ident.shirt_color)
    shoulders = ellipse(u, v - 1.32, 0.98, 0.6)
    # The neckline is narrower than the neck so that sway never shows a gap beside it.
    hole = ellipse(u, v - 0.71, lay.a * NECK_WIDTH * 0.62, 0.07)
    body = torch.maximum(shoulders, -hole)
    shade = (1.0 - 0.22 * u.abs() ** 2 - 0.08 * (v - 0.7).clamp(min=0)).unsqueeze(0)  # (1, H, W)
    paint(canvas, shirt * shade, coverage(body, px))
    collar = torch.maximum(hole.abs() - 0.016, shoulders)
    paint(canvas, shirt * 0.72, coverage(collar, px))
    return canvas
