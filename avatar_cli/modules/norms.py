"""A normalisation several model files share (Wan's DiT layers in wan-s2v and SwiftVR's transformer, both after
diffusers' FP32LayerNorm): computed in fp32 whatever the input dtype, returned in the input's dtype. Pure tensor
code."""

import torch
import torch.nn.functional as F
from torch import nn


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 (affine parameters upcast too), returned in the input's dtype (WanLayerNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).type_as(x)
