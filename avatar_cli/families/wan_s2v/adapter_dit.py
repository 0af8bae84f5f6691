"""The DiT's tensor names in the repackagings users hold, mapped to the official names our WanS2VDiT uses.

- Diffusers (`WanS2VTransformer3DModel`, the class of diffusers' Wan2.2-S2V pull request, huggingface/diffusers
  #12258, whose converter `scripts/convert_wan_to_diffusers.py --model_type Wan2.2-S2V-14B` writes the
  `transformer/` of tolgacangoz/Wan2.2-S2V-14B-Diffusers): the standard Wan renames (`self_attn.q` -> `attn1.to_q`,
  `ffn.0` -> `ffn.net.0.proj`, the official `norm3` (cross-attention norm) -> `norm2`, `head.head` -> `proj_out`,
  `modulation` -> `scale_shift_table`, ...) plus the S2V parts (`casual_audio_encoder` under `condition_embedder.`
  with its convs nested one level deeper, `cond_encoder` -> `condition_embedder.pose_embedder`, the injectors'
  q/k/v/o -> to_q/to_k/to_v/to_out.0). The names are that class's own state dict (its converter's rename table
  disagrees with the class in 9 names; the class is what `from_pretrained` loads strictly), listed at the release's
  size in tests/golden/wan_s2v/dit_diffusers_keys.txt.
- ComfyUI (Comfy-Org/Wan_2.2_ComfyUI_Repackaged `split_files/diffusion_models/wan2.2_s2v_14B_*.safetensors`):
  the official names, bare or under `model.diffusion_model.` (comfy/model_detection.py `unet_prefix_from_state_dict`
  accepts both). The `*_fp8_scaled` file stores the Linear weights as float8_e4m3fn with a per-tensor float32
  `<layer>.scale_weight` (real weight = fp8 value x scale, comfy/ops.py `scaled_fp8_ops`), optionally a
  `<layer>.scale_input` (the activation scale of its FP8 matmul, not part of the weight), and a `scaled_fp8`
  marker tensor whose dtype names the fp8 format. ComfyUI's later mixed-precision files name them per layer
  instead: `<layer>.weight_scale`, `<layer>.input_scale` and a `<layer>.comfy_quant` JSON blob whose "format" says
  how the layer is stored (float8_e4m3fn is read; int8, nvfp4 and the other formats are refused by name).
"""

import re
from collections.abc import Mapping

import torch

from avatar_cli.families.wan_s2v.dit import WanDiTParams

DIFFUSERS_CLASS = "WanS2VTransformer3DModel"  # files.DIT_CLASS_DIFFUSERS
COMFY_PREFIX = "model.diffusion_model."
FP8_MARKER = "scaled_fp8"
FP8_SCALE = ".scale_weight"
FP8_INPUT_SCALE = ".scale_input"
# ComfyUI's mixed-precision layout (comfy/quant_ops.py): per layer, the weight's scale, the activations' scale and
# the layer's format, as a JSON blob in a uint8 tensor.
QUANT_SCALE = ".weight_scale"
QUANT_INPUT_SCALE = ".input_scale"
QUANT_CONFIG = ".comfy_quant"
QUANT_FORMATS_READ = ("float8_e4m3fn",)

# Inside one block (blocks.N.) and one audio injector (audio_injector.injector.N.), official -> Diffusers.
_BLOCK = {"modulation": "scale_shift_table", "norm3.weight": "norm2.weight", "norm3.bias": "norm2.bias",
          "ffn.0.weight": "ffn.net.0.proj.weight", "ffn.0.bias": "ffn.net.0.proj.bias",
          "ffn.2.weight": "ffn.net.2.weight", "ffn.2.bias": "ffn.net.2.bias"}
_ATTN = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "norm_q": "norm_q", "norm_k": "norm_k"}
_AUDIO = "condition_embedder.causal_audio_encoder."
_TOP = {"time_embedding.0": "condition_embedder.time_embedder.linear_1",
        "time_embedding.2": "condition_embedder.time_embedder.linear_2",
        "text_embedding.0": "condition_embedder.text_embedder.linear_1",
        "text_embedding.2": "condition_embedder.text_embedder.linear_2",
        "time_projection.1": "condition_embedder.time_proj",
        "cond_encoder": "condition_embedder.pose_embedder",
        "trainable_cond_mask": "trainable_condition_mask",
        "head.head": "proj_out"}


def official_to_diffusers_key(key: str) -> str:
    """One official DiT name -> WanS2VTransformer3DModel's (KeyError for a name the DiT does not have)."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", key)
    if m:
        i, rest = m.groups()
        if rest in _BLOCK:
            return f"blocks.{i}.{_BLOCK[rest]}"
        a = re.fullmatch(r"(self_attn|cross_attn)\.(q|k|v|o|norm_q|norm_k)\.(weight|bias)", rest)
        if a:
            return f"blocks.{i}.{'attn1' if a[1] == 'self_attn' else 'attn2'}.{_ATTN[a[2]]}.{a[3]}"
        raise KeyError(f"no Diffusers name for DiT tensor {key!r}")
    m = re.fullmatch(r"audio_injector\.injector\.(\d+)\.(q|k|v|o|norm_q|norm_k)\.(weight|bias)", key)
    if m:
        return f"audio_injector.injector.{m[1]}.{_ATTN[m[2]]}.{m[3]}"
    if key.startswith(("audio_injector.injector_adain_layers.", "frame_packer.", "patch_embedding.")):
        return key
    if key == "head.modulation":
        return "scale_shift_table"
    if key.startswith("casual_audio_encoder."):
        rest = key.removeprefix("casual_audio_encoder.")
        if rest == "weights":
            return _AUDIO + "weighted_avg.weights"
        rest = re.sub(r"^encoder\.(conv2|conv3)\.conv\.", r"encoder.\1.conv.conv.", rest)
        return _AUDIO + rest
    for old, new in _TOP.items():
        if key.startswith(old + "."):
            return new + key[len(old):]
    raise KeyError(f"no Diffusers name for DiT tensor {key!r}")


def diffusers_to_official_names(official: list[str]) -> dict[str, str]:
    """Diffusers name -> official name, for the official names of one DiT (its module's state dict)."""
    return {official_to_diffusers_key(k): k for k in official}


# WanS2VTransformer3DModel's config.json fields -> WanDiTParams (fields it has no key for: the class's constants).
_DIFFUSERS_FIXED = {"num_weighted_avg_layers": 25, "rope_max_seq_len": 1024, "added_kv_proj_dim": None,
                    "qk_norm": "rms_norm_across_heads"}


def params_from_diffusers_config(d: Mapping) -> WanDiTParams:
    """WanDiTParams from a Diffusers `transformer/config.json` (`_class_name` WanS2VTransformer3DModel). Sizes
    the class hard-codes (4 audio tokens per frame, text length 512, 73 motion frames, full attention) are the
    official ones; a field our DiT cannot honour is a ValueError naming it."""
    known = {"patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
             "freq_dim", "audio_dim", "audio_inject_layers", "enable_adain", "adain_mode", "pose_dim", "ffn_dim",
             "num_layers", "cross_attn_norm", "eps", "enable_framepack", "framepack_drop_mode", "add_last_motion",
             "zero_timestep", *_DIFFUSERS_FIXED}
    unknown = sorted(k for k in d if not k.startswith("_") and k not in known)
    if unknown:
        raise ValueError(f"{DIFFUSERS_CLASS} config.json: unknown key(s) {', '.join(unknown)}")
    for k, want in _DIFFUSERS_FIXED.items():
        if k in d and d[k] != want:
            raise ValueError(f"{DIFFUSERS_CLASS} config.json: {k}={d[k]!r}: only {want!r} (the release's) is "
                             "implemented")
    try:
        heads, head_dim = int(d["num_attention_heads"]), int(d["attention_head_dim"])
        return WanDiTParams(
            patch_size=tuple(d["patch_size"]), in_dim=d["in_channels"], out_dim=d["out_channels"],
            dim=heads * head_dim, ffn_dim=d["ffn_dim"], freq_dim=d["freq_dim"], num_heads=heads,
            num_layers=d["num_layers"], text_dim=d["text_dim"], text_len=512, window_size=(-1, -1), qk_norm=True,
            cross_attn_norm=bool(d["cross_attn_norm"]), eps=float(d["eps"]), audio_dim=d["audio_dim"],
            num_audio_token=4, cond_dim=d["pose_dim"], audio_inject_layers=tuple(d["audio_inject_layers"]),
            enable_adain=d["enable_adain"], adain_mode=d["adain_mode"], enable_framepack=d["enable_framepack"],
            framepack_drop_mode=d["framepack_drop_mode"], zero_timestep=d["zero_timestep"],
            add_last_motion=d["add_last_motion"], motion_frames=73)
    except KeyError as e:
        raise ValueError(f"{DIFFUSERS_CLASS} config.json: missing field {e.args[0]}") from None


def diffusers_config(p: WanDiTParams) -> dict:
    """The `transformer/config.json` WanS2VTransformer3DModel.save_pretrained writes for these sizes."""
    return {"_class_name": DIFFUSERS_CLASS, "patch_size": list(p.patch_size), "num_attention_heads": p.num_heads,
            "attention_head_dim": p.head_dim, "in_channels": p.in_dim, "out_channels": p.out_dim,
            "text_dim": p.text_dim, "freq_dim": p.freq_dim, "audio_dim": p.audio_dim,
            "audio_inject_layers": list(p.audio_inject_layers), "enable_adain": p.enable_adain,
            "adain_mode": p.adain_mode, "pose_dim": p.cond_dim, "ffn_dim": p.ffn_dim, "num_layers": p.num_layers,
            "num_weighted_avg_layers": 25, "cross_attn_norm": p.cross_attn_norm, "qk_norm": "rms_norm_across_heads",
            "eps": p.eps, "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
            "enable_framepack": p.enable_framepack, "framepack_drop_mode": p.framepack_drop_mode,
            "add_last_motion": p.add_last_motion, "zero_timestep": p.zero_timestep}


# --- ComfyUI -----------------------------------------------------------------------------------------------

def comfy_prefix(names) -> str:
    """The prefix a ComfyUI single file puts before the official names: `model.diffusion_model.` or none."""
    return COMFY_PREFIX if any(n.startswith(COMFY_PREFIX) for n in names) else ""


def is_fp8_aux(name: str) -> bool:
    """The scaled-FP8 bookkeeping tensors that are not weights of the DiT."""
    return name == FP8_MARKER or name.endswith((FP8_SCALE, FP8_INPUT_SCALE, QUANT_SCALE, QUANT_INPUT_SCALE,
                                                QUANT_CONFIG, QUANT_SCALE + "_2"))


def scale_name(weight: str, names) -> str | None:
    """The tensor holding a quantized weight's scale, in either of ComfyUI's layouts (None: there is none)."""
    layer = weight.removesuffix(".weight")
    return next((layer + s for s in (FP8_SCALE, QUANT_SCALE) if layer + s in names), None)


def comfy_to_official_key(name: str, prefix: str) -> str | None:
    """A ComfyUI file's tensor name -> the official name; None for the scaled-FP8 bookkeeping tensors and, in a
    prefixed file, for tensors outside the diffusion model (ComfyUI skips those too)."""
    if prefix:
        if not name.startswith(prefix):
            return None
        name = name[len(prefix):]
    return None if is_fp8_aux(name) else name


def dequantize_scaled_fp8(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A scaled-FP8 weight as ComfyUI computes it (weight.to(float) x scale_weight), rounded once to dtype."""
    w = weight.to(torch.float32)  # (out, in) exact: every fp8 value is a float32
    if scale is not None:
        scale = scale.to(torch.float32)
        if scale.numel() > 1 and scale.numel() == w.shape[0]:
            scale = scale.reshape(-1, *([1] * (w.dim() - 1)))  # (out, 1...) one per output channel
        w = w * scale  # per tensor: () or (1,)
    return w.to(dtype)
