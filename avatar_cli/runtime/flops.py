"""Counting floating-point operations, for figures that compare across machines (FLOP/s against the peak).

torch's FlopCounterMode counts matmuls and convolutions, but not the CPU flash-attention kernel or the oneDNN
convolutions (mini's fused ones, the wan VAE's direct call) that inference runs on the CPU; their formulas are
registered here (2 per multiply-add, as torch counts).
"""

import torch

_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    # torch.utils.flop_counter imports triton and CUDA's bindings (0.1 s): paid by the runs that count (make bench),
    # not by every render's start.
    from torch.utils.flop_counter import conv_flop_count, register_flop_formula, sdpa_flop_count

    @register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    def _sdpa_cpu(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    @register_flop_formula([torch.ops.mkldnn._convolution_pointwise, torch.ops.aten.mkldnn_convolution])
    def _conv_onednn(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
        return conv_flop_count(list(x_shape), list(w_shape), list(out_shape), transposed=False)


def flop_counter():
    """A torch FlopCounterMode that also knows the CPU kernels above."""
    from torch.utils.flop_counter import FlopCounterMode  # start-up: only the runs that count (see _register)

    _register()
    return FlopCounterMode(display=False)
