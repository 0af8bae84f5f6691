"""Super-resolution: final latents to the latents the decoder takes (a family without it passes them on)."""

from typing import Any

import torch

from avatar_cli.families.base import Step
from avatar_cli.stages.base import Stage


class SuperResolve(Stage):
    step = Step.sr

    def run(self, z: torch.Tensor, ref: Any) -> torch.Tensor:
        return self.family.refine(self.models, z, ref)
