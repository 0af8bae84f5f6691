"""Super-resolution: one step from low- to high-resolution latents, reference in view."""

import torch

from avatar_cli.stages.base import Stage
from avatar_cli.stages.reference import ReferenceCond


class SuperResolve(Stage):
    needs = ("sr",)

    def run(self, z_lo: torch.Tensor, ref: ReferenceCond) -> torch.Tensor:
        """z_lo (T, C, h, w) -> z_hi (T, C, 2h, 2w)."""
        return self.model("sr")(z_lo.contiguous(memory_format=torch.channels_last), ref.ref_hi)
