"""Decode and publish: VAE-decode final latents in timeline order and hand the frames to the encoder."""

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from avatar_cli.families.base import Final, RollingState
from avatar_cli.stages.base import Stage


class FrameSink(Protocol):
    def put(self, frames: np.ndarray) -> None: ...  # uint8 (T, H, W, 3)


def fit_frames(x: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """x (T, 3, S, S) -> (T, 3, height, width): scaled to fit, centred, black bars where aspects differ."""
    T, _, h, w = x.shape
    if (w, h) == (width, height):
        return x
    scale = min(width / w, height / h)
    nw, nh = max(2, round(w * scale)), max(2, round(h * scale))
    x = F.interpolate(x, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)  # (T, 3, nh, nw)
    if (nw, nh) == (width, height):
        return x
    out = x.new_full((T, 3, height, width), -1.0)  # black in [-1, 1]
    top, left = (height - nh) // 2, (width - nw) // 2
    out[:, :, top:top + nh, left:left + nw] = x
    return out


class DecodePublish(Stage):
    step = "decode"

    def run(self, final: Final, state: RollingState, sink: FrameSink | None, size: tuple[int, int]) -> int:
        """final: consecutive final latents; the decoder's cache carries in `state`. Returns frames published.
        sink None: decode for the rolling state only (a rank that writes nothing, of a family whose later chunks
        are conditioned on decoded frames)."""

        def put(x: torch.Tensor) -> None:  # x (t, 3, h, w) in [-1, 1]
            if sink is None:
                return
            x = fit_frames(x.float(), *size)  # (t, 3, height, width)
            frames = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)  # (t, H, W, 3)
            sink.put(frames.cpu().numpy())

        return self.family.decode(self.models, final, state, put)
