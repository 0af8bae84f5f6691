"""Audio-to-video: the DiT samples one chunk of low-resolution latents by flow matching."""

import torch

from avatar_cli.sampling import sample, timesteps
from avatar_cli.stages.base import Stage
from avatar_cli.stages.context import ChunkContext
from avatar_cli.stages.reference import ReferenceCond


class AudioToVideo(Stage):
    needs = ("dit",)

    def run(self, ctx: ChunkContext, ref: ReferenceCond, steps: int, guidance: float, shift: float) -> torch.Tensor:
        """Returns the chunk's latents (L, C, h, w), given frames included."""
        dit = self.model("dit")

        def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            v = dit(x, t, ctx.mask, ctx.audio, ref.ref_lo, ref.ref_hi, ctx.text)  # (1, L, C, h, w)
            if guidance == 1.0:
                return v
            # Unconditional: no audio and no prompt. The reference and given frames stay.
            v_u = dit(x, t, ctx.mask, torch.zeros_like(ctx.audio), ref.ref_lo, ref.ref_hi, ctx.text[:, :0])
            return v_u + guidance * (v - v_u)

        return sample(velocity, ctx.noise, ctx.cond, ctx.mask, timesteps(steps, shift))[0]
