"""Synthetic scaled-FP8 DiT files in ComfyUI's layouts (its `*_fp8_scaled.safetensors` repackagings), written from
a DiT's official state dict."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from avatar_cli.families.wan_s2v import adapter_dit


def fp8_file(state: dict[str, torch.Tensor], path: Path, mixed: bool = False, fmt: str = "float8_e4m3fn") -> None:
    """ComfyUI's scaled FP8 layout: every 2-D Linear weight of the blocks, injectors and embeddings as e4m3 with
    a per-tensor float32 scale_weight (amax / 448), the rest as they were, the scaled_fp8 marker; one layer also
    carries a scale_input (its FP8 matmul's activation scale: not part of the weight). mixed: ComfyUI's later
    per-layer layout instead (weight_scale, input_scale, and a comfy_quant blob naming the format `fmt`)."""
    marker = {adapter_dit.COMFY_PREFIX + adapter_dit.FP8_MARKER: torch.zeros(0, dtype=torch.float8_e4m3fn)}
    out = {} if mixed else marker
    for k, v in state.items():
        name = adapter_dit.COMFY_PREFIX + k
        layer = name.removesuffix(".weight")
        if v.dim() == 2 and k.endswith(".weight") and "trainable_cond_mask" not in k:
            scale = v.abs().max().float() / 448
            out[name] = (v.float() / scale).to(torch.float8_e4m3fn)
            out[layer + (".weight_scale" if mixed else ".scale_weight")] = scale.reshape(())
            if mixed:
                out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()),
                                                           dtype=torch.uint8)
        else:
            out[name] = v
    out[adapter_dit.COMFY_PREFIX + "blocks.0.ffn.0" + (".input_scale" if mixed else ".scale_input")] = \
        torch.tensor(0.5)
    save_file(out, str(path))
