"""Render frames of a synthetic talking head, vectorized over frames.

Per chunk of frames: copy the static upright head, repaint the eye band and mouth patch for
all frames at once, warp every frame's head by its sway (one batched `grid_sample`), then
put it between the static backdrop and shirt. The static parts are rendered once per
identity and size (cached), so per-frame work is a few full-frame passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .features import FrameParams, paint_eyes, paint_mouth
from .head import HeadCanvas, build_head
from .identity import Identity
from .layout import PIVOT
from .measure import measure_mouth_opening, mouth_box
from .motion import Motion
from .sdf import Tensor, over, single_thread

__all__ = ["RenderParams", "render_frames", "render_reference", "mouth_box", "measure_mouth_opening"]


@dataclass(frozen=True)
class RenderParams:
    """Batching: full-frame chunks are sized so their canvases (~2 MB) stay cache-friendly."""

    chunk_pixels: int = 1 << 19
    patch_frames: int = 256  # frames whose eye/mouth patches are painted in one batch

    def chunk(self, size: int) -> int:
        return max(1, self.chunk_pixels // (size * size))


def render_frames(identity: Identity, motion: Motion, size: int, params: RenderParams = RenderParams()) -> Tensor:
    """All frames of `motion` for `identity`: uint8 (T, size, size, 3)."""
    head = build_head(identity, size)
    n = motion.num_frames
    out = torch.empty(n, size, size, 3, dtype=torch.uint8)
    # Backdrop and shirt folded into constants: frame = base + keep * (head_rgb - head_a * bg).
    bg = head.background  # (3, S, S)
    keep = 1.0 - head.torso[3:]  # (1, S, S)
    base = head.torso[:3] + keep * bg  # (3, S, S)
    step = params.chunk(size)
    with torch.inference_mode():
        for p0 in range(0, n, params.patch_frames):
            # Small patches for many frames on one thread (see single_thread); the full-frame
            # passes below use all threads, in cache-sized chunks.
            m_all = motion[p0 : p0 + params.patch_frames]
            with single_thread():
                patches = _paint_patches(head, identity, m_all)
            for t0 in range(0, m_all.num_frames, step):
                m = m_all[t0 : t0 + step]
                canvas = head.head.expand(m.num_frames, -1, -1, -1).clone()  # (t, 4, S, S)
                for patch, layer in zip((head.eyes, head.mouth), patches):
                    canvas[:, :, patch.rows, patch.cols] = layer[t0 : t0 + step]
                warped = _warp(canvas, m)  # (t, 4, S, S)
                rgb = warped[:, :3]
                rgb.addcmul_(warped[:, 3:], bg, value=-1.0).mul_(keep).add_(base)
                rgb.mul_(255.0).add_(0.5).clamp_(0.0, 255.0)
                out[p0 + t0 : p0 + t0 + m.num_frames] = rgb.to(torch.uint8).permute(0, 2, 3, 1)
    return out


def render_reference(seed: int, size: int = 256) -> np.ndarray:
    """The identity's reference picture: neutral, mouth closed, eyes open, centred. (S, S, 3)."""
    frames = render_frames(Identity.from_seed(seed), Motion.neutral(1), size)
    return frames[0].numpy()


def _paint_patches(head: HeadCanvas, ident: Identity, m: Motion) -> tuple[Tensor, Tensor]:
    """Eye band and mouth region for every frame of `m`: (T, 4, h, w) each, premultiplied."""
    n, px = m.num_frames, 2.0 / head.size
    p = FrameParams(
        mouth_open=m.mouth_open.view(n, 1, 1).clamp(0, 1),
        mouth_shape=m.mouth_shape.view(n, 1, 1).clamp(-1, 1),
        blink=m.blink.view(n, 1, 1).clamp(0, 1),
        smile=m.smile.view(n, 1, 1).clamp(0, 1),
        surprise=m.surprise.view(n, 1, 1).clamp(0, 1),
    )
    layers = []
    for patch, painter in ((head.eyes, paint_eyes), (head.mouth, paint_mouth)):
        layer = patch.under.expand(n, -1, -1, -1).clone()  # (n, 4, h, w)
        painter(layer, patch.u, patch.v, px, ident, head.layout, p)
        layers.append(over(patch.over, layer))
    return layers[0], layers[1]


def _warp(canvas: Tensor, m: Motion) -> Tensor:
    """Move each frame's head: rotate by head_tilt about the neck base, then shift.

    Output pixel p samples the upright head at q = R(-tilt) (p - c - d) + c, with c the pivot
    and d the shift (canonical units are 2x fractions of the frame).
    """
    n = m.num_frames
    if not (m.head_tilt.any() or m.head_dx.any() or m.head_dy.any()):
        return canvas
    cos, sin = torch.cos(m.head_tilt), torch.sin(m.head_tilt)  # (n,)
    cx, cy = PIVOT
    px_, py_ = cx + 2.0 * m.head_dx, cy + 2.0 * m.head_dy  # (n,) where the pivot lands
    theta = torch.empty(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 1] = cos, sin
    theta[:, 1, 0], theta[:, 1, 1] = -sin, cos
    theta[:, 0, 2] = cx - (cos * px_ + sin * py_)
    theta[:, 1, 2] = cy - (-sin * px_ + cos * py_)
    grid = F.affine_grid(theta, list(canvas.shape), align_corners=False)
    return F.grid_sample(canvas, grid, mode="bilinear", padding_mode="border", align_corners=False)

