"""The release's checkpoint names and config.json, mapped to our SwiftVRDiT and ReAE.

The release's `transformer/` is what diffusers' `save_pretrained` writes for the official `WanTransformer3DModel`
(swiftvr/models/transformer.py): its tensors are named by module path, which SwiftVRDiT reproduces, so the mapping is
the identity except for the names the official loader never reads into the model:
- `attn1.to_qkv.*` and `attn2.to_kv.*`: the fused projections `WanAttention.fuse_projections` adds at
  `prepare_for_inference`; a state dict saved after that holds them beside the originals (rows q, k, v and k, v).
  diffusers' `from_pretrained` drops names the freshly built model lacks; so do we.
- `*norm_added_q*`: the class's `_keys_to_ignore_on_load_unexpected`.
`config.json` is read as diffusers' `from_pretrained` reads it: a field it lacks takes the class's default.
"""

import re
from collections.abc import Mapping

from avatar_cli.sr.swiftvr.dit import SwiftVRParams

DIT_CLASS = "WanTransformer3DModel"
_IGNORED = re.compile(r"blocks\.\d+\.(attn1\.to_qkv|attn2\.to_kv)\.(weight|bias)|.*norm_added_q.*")

# The official class's __init__ defaults (swiftvr/models/transformer.py:WanTransformer3DModel.__init__): what
# diffusers uses for a field config.json does not hold.
OFFICIAL_DEFAULTS = {"patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128,
                     "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824,
                     "num_layers": 40, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
                     "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
                     "pos_embed_seq_len": None, "enable_swa": True, "self_attn_window_hw": [16, 16],
                     "use_torch_compile": True, "compile_mode": "default"}
# Fields whose other values build a model the SwiftVR release is not (image conditioning, other norms).
_ONLY = {"image_dim": None, "added_kv_proj_dim": None, "pos_embed_seq_len": None, "qk_norm": "rms_norm_across_heads"}
# Fields that change nothing the model computes: enable_swa is never read, compilation is a runtime choice.
_NO_EFFECT = {"enable_swa", "use_torch_compile", "compile_mode"}


def release_to_ours(name: str) -> str | None:
    """A release tensor name -> SwiftVRDiT's, None for one the official loader ignores."""
    return None if _IGNORED.fullmatch(name) else name


def ours_to_release(name: str) -> str:
    return name


def params_from_config(d: Mapping) -> SwiftVRParams:
    """SwiftVRParams from `transformer/config.json`; ValueError naming a field this model cannot honour or an
    unknown one."""
    unknown = sorted(k for k in d if not k.startswith("_") and k not in OFFICIAL_DEFAULTS)
    if unknown:
        raise ValueError(f"transformer/config.json: unknown key(s) {', '.join(unknown)}")
    v = {**OFFICIAL_DEFAULTS, **{k: d[k] for k in d if not k.startswith("_")}}
    for k, want in _ONLY.items():
        if v[k] != want:
            raise ValueError(f"transformer/config.json: {k}={v[k]!r}: the SwiftVR transformer has {want!r}")

    def ints(k: str, n: int) -> tuple[int, ...]:
        x = v[k]
        if not isinstance(x, (list, tuple)) or len(x) != n or any(isinstance(i, bool) or not isinstance(i, int)
                                                                   for i in x):
            raise ValueError(f"transformer/config.json: {k}={x!r}: expected {n} integers")
        return tuple(x)

    def integer(k: str) -> int:
        if isinstance(v[k], bool) or not isinstance(v[k], int) or v[k] <= 0:
            raise ValueError(f"transformer/config.json: {k}={v[k]!r}: expected a positive integer")
        return v[k]

    if not isinstance(v["cross_attn_norm"], bool):
        raise ValueError(f"transformer/config.json: cross_attn_norm={v['cross_attn_norm']!r}: expected true/false")
    if isinstance(v["eps"], bool) or not isinstance(v["eps"], (int, float)):
        raise ValueError(f"transformer/config.json: eps={v['eps']!r}: expected a number")
    out = v["out_channels"] or v["in_channels"]  # the official class: out_channels or in_channels
    v["out_channels"] = out
    return SwiftVRParams(patch_size=ints("patch_size", 3), num_heads=integer("num_attention_heads"),
                         head_dim=integer("attention_head_dim"), in_channels=integer("in_channels"),
                         out_channels=integer("out_channels"), text_dim=integer("text_dim"),
                         freq_dim=integer("freq_dim"), ffn_dim=integer("ffn_dim"), num_layers=integer("num_layers"),
                         cross_attn_norm=v["cross_attn_norm"], eps=float(v["eps"]),
                         rope_max_seq_len=integer("rope_max_seq_len"), window_hw=ints("self_attn_window_hw", 2))


def config_from_params(p: SwiftVRParams) -> dict:
    """The config.json the official class's `save_pretrained` writes for these sizes (its registered fields)."""
    return {"_class_name": DIT_CLASS, "patch_size": list(p.patch_size), "num_attention_heads": p.num_heads,
            "attention_head_dim": p.head_dim, "in_channels": p.in_channels, "out_channels": p.out_channels,
            "text_dim": p.text_dim, "freq_dim": p.freq_dim, "ffn_dim": p.ffn_dim, "num_layers": p.num_layers,
            "cross_attn_norm": p.cross_attn_norm, "qk_norm": "rms_norm_across_heads", "eps": p.eps,
            "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": p.rope_max_seq_len,
            "pos_embed_seq_len": None, "enable_swa": True, "self_attn_window_hw": list(p.window_hw),
            "use_torch_compile": False, "compile_mode": "default"}
