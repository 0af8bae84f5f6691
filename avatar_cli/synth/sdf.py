"""Signed-distance primitives and premultiplied-alpha painting on pixel grids.

Coordinates are the canonical normalized frame: u to the right, v downwards, both spanning
[-1, 1] across the image (pixel edges, like `align_corners=False`). Shapes are therefore
resolution independent; `px` (= 2 / size) is one pixel in those units and sets the width of
the anti-aliasing ramp, so edges are soft by exactly one pixel at every size.

Canvases are premultiplied RGBA with channels first: (..., 4, H, W). Premultiplied colour is
what makes both stacking layers and the bilinear head warp correct at soft edges.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def pixel_grid(size: int, rows: slice = slice(None), cols: slice = slice(None)) -> tuple[Tensor, Tensor]:
    """Pixel-centre coordinates of a (sub)grid: u (1, W) and v (H, 1), float32."""
    centres = (torch.arange(size, dtype=torch.float32) + 0.5) * (2.0 / size) - 1.0  # (size,)
    u = centres[cols].reshape(1, -1)  # (1, W)
    v = centres[rows].reshape(-1, 1)  # (H, 1)
    return u, v


def coverage(d: Tensor, px: float, soft: float = 1.0) -> Tensor:
    """Signed distance -> pixel coverage in [0, 1]; the ramp is `soft` pixels wide."""
    return (0.5 - d / (px * soft)).clamp_(0.0, 1.0)


def circle(x: Tensor, y: Tensor, r: Tensor | float) -> Tensor:
    return torch.sqrt(x * x + y * y) - r


def ellipse(x: Tensor, y: Tensor, rx: Tensor | float, ry: Tensor | float) -> Tensor:
    """Approximate ellipse distance (exact on the boundary, first order near it).

    k0 * (k0 - 1) / k1 is the classic cheap estimate: ~10 flops instead of an iterative solve,
    which matters because mouth and eyes are evaluated for every frame.
    """
    xr, yr = x / rx, y / ry
    k0 = torch.sqrt(xr * xr + yr * yr)
    xr2, yr2 = xr / rx, yr / ry
    k1 = torch.sqrt(xr2 * xr2 + yr2 * yr2) + 1e-6
    return k0 * (k0 - 1.0) / k1


def rounded_box(x: Tensor, y: Tensor, hx: float, hy: float, r: float) -> Tensor:
    """Box of half sizes (hx, hy) with corner radius r."""
    qx = x.abs() - (hx - r)
    qy = y.abs() - (hy - r)
    outside = torch.sqrt(qx.clamp(min=0) ** 2 + qy.clamp(min=0) ** 2)
    inside = torch.maximum(qx, qy).clamp(max=0)
    return outside + inside - r


def implicit_distance(f: Tensor, px: float) -> Tensor:
    """Distance estimate f / |grad f| for any implicit shape sampled on a full pixel grid.

    Used for static layers (rendered once per identity), where a numeric gradient lets shapes
    be written as plain formulas without deriving their distance functions.
    """
    gy, gx = torch.gradient(f, spacing=px, dim=(-2, -1))
    return f / (torch.sqrt(gx * gx + gy * gy) + 1e-6)


def paint(canvas: Tensor, color: Tensor, alpha: Tensor) -> None:
    """Composite an opaque colour with coverage `alpha` over `canvas`, in place.

    canvas (..., 4, H, W) premultiplied; color (..., 3, 1, 1) or (..., 3, H, W); alpha (..., H, W).
    """
    a = alpha.unsqueeze(-3)  # (..., 1, H, W)
    canvas.mul_(1.0 - a)
    canvas[..., :3, :, :].add_(color * a)
    canvas[..., 3:, :, :].add_(a)


def over(top: Tensor, bottom: Tensor) -> Tensor:
    """Premultiplied `top` over `bottom` (both (..., 4, H, W))."""
    return top + (1.0 - top[..., 3:, :, :]) * bottom


def rgb(color: tuple[float, float, float] | Tensor) -> Tensor:
    """A colour as a broadcastable (3, 1, 1) tensor."""
    return torch.as_tensor(color, dtype=torch.float32).reshape(3, 1, 1)


class single_thread:
    """Run small-tensor work on one intra-op thread.

    Waking a second OpenMP thread costs a scheduler time slice when the other core is busy
    (e.g. a training loop next door), many times the work itself (bench/results.md). Patches and
    per-identity layers are too small to gain from a second thread.
    """

    def __enter__(self) -> None:
        self._saved = torch.get_num_threads()
        if self._saved != 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self._saved != 1:
            torch.set_num_threads(self._saved)
