"""Reference encode, once per job: the reference picture at both resolutions the models use."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from avatar_cli.stages.base import Stage


@dataclass
class ReferenceCond:
    ref_lo: torch.Tensor  # (1, C, h, w) latent of the reference at the DiT's resolution
    ref_hi: torch.Tensor  # (1, C, 2h, 2w) latent at the output resolution, for SR and reference tokens


class ReferenceEncode(Stage):
    needs = ("vae",)

    def run(self, image: torch.Tensor, low_size: int) -> ReferenceCond:
        """image (3, S, S) float in [-1, 1] at the model's native size."""
        vae = self.model("vae")
        x = image[None].to(self.runtime.device, self.runtime.dtype)  # (1, 3, S, S)
        x_lo = F.interpolate(x.float(), size=(low_size, low_size), mode="bilinear", antialias=True,
                             align_corners=False).to(x.dtype)  # (1, 3, S/2, S/2)
        return ReferenceCond(ref_lo=vae.encode(x_lo), ref_hi=vae.encode(x))
