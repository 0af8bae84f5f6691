"""Audio-to-video: the family's sampler denoises one chunk of latents with its DiT."""

from typing import Any

import torch

from avatar_cli.families.base import RollingState, Sampling, Step
from avatar_cli.stages.base import Stage


class AudioToVideo(Stage):
    step = Step.a2v

    def run(self, inputs: Any, ref: Any, sampling: Sampling, state: RollingState) -> torch.Tensor:
        """Returns the chunk's latents, one per window position (given frames included). `state`: the rolling
        state, which a family's denoising may read and write (its own caches)."""
        return self.family.denoise(self.models, inputs, ref, sampling, state)
