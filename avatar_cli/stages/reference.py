"""Reference encode, once per job: the reference picture as the family's conditioning."""

from typing import Any

import torch

from avatar_cli.families.base import Step
from avatar_cli.stages.base import Stage


class ReferenceEncode(Stage):
    step = Step.reference

    def run(self, image: torch.Tensor) -> Any:
        """image (3, H, W) float in [-1, 1] at the family's native size."""
        rt = self.runtime
        return self.family.reference(self.models, image, rt.device, rt.dtype)
