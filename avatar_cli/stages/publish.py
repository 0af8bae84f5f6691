"""Decode and publish: VAE-decode final latents in timeline order and hand the frames to the encoder."""

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

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
    needs = ("vae",)
    batch = 8  # frames decoded at once: small enough for a quick first frame, big enough to keep convs efficient

    def run(self, z_hi: torch.Tensor, cache: torch.Tensor | None, sink: FrameSink,
            size: tuple[int, int]) -> tuple[torch.Tensor, int]:
        """z_hi (T, C, H/f, W/f), consecutive final frames. Returns the decoder cache and frames published."""
        vae = self.model("vae")
        for i in range(0, z_hi.shape[0], self.batch):
            z = z_hi[i:i + self.batch].contiguous(memory_format=torch.channels_last)
            x, cache = vae.decode(z, cache)  # (t, 3, S, S) in [-1, 1]
            x = fit_frames(x.float(), *size)  # (t, 3, height, width)
            frames = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)  # (t, H, W, 3)
            sink.put(frames.cpu().numpy())
        return cache, z_hi.shape[0]
