"""Audio-to-video: the family's sampler denoises one chunk of latents with its DiT."""

from collections.abc import Mapping
from typing import Any

import torch

from avatar_cli.families.base import Family, RollingState, Sampling, Step
from avatar_cli.modules.module import Module
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.rings import RingStore
from avatar_cli.stages.base import Stage


class AudioToVideo(Stage):
    step = Step.a2v

    def __init__(self, family: Family, modules: Mapping[str, Module], runtime: Runtime,
                 rings: RingStore = RingStore()):
        """rings: where the family's key/value rings live (the Placement's), handed to its denoising."""
        super().__init__(family, modules, runtime)
        self.rings = rings

    def run(self, inputs: Any, ref: Any, sampling: Sampling, state: RollingState) -> torch.Tensor:
        """Returns the chunk's latents, one per window position (given frames included). `state`: the rolling
        state, which a family's denoising may read and write (its own caches)."""
        return self.family.denoise(self.models, inputs, ref, sampling, state, rings=self.rings)
