"""Key mapping between the released umT5-XXL encoder (`models_t5_umt5-xxl-enc-bf16.pth`, the official
wan/modules/t5.py `T5Encoder` layout) and `transformers.UMT5EncoderModel`.

The official file is a pickled `torch.save` state dict of 242 bf16 tensors. Its per-block keys map one to one onto
transformers' keys; the one difference in structure is the embedding, which transformers holds twice (`shared` and
`encoder.embed_tokens`, tied to one tensor).

    official                                   transformers (UMT5EncoderModel)
    token_embedding.weight                     shared.weight  (+ encoder.embed_tokens.weight, tied)
    blocks.N.norm1.weight                      encoder.block.N.layer.0.layer_norm.weight
    blocks.N.attn.{q,k,v,o}.weight             encoder.block.N.layer.0.SelfAttention.{q,k,v,o}.weight
    blocks.N.pos_embedding.embedding.weight    encoder.block.N.layer.0.SelfAttention.relative_attention_bias.weight
    blocks.N.norm2.weight                      encoder.block.N.layer.1.layer_norm.weight
    blocks.N.ffn.gate.0.weight                 encoder.block.N.layer.1.DenseReluDense.wi_0.weight  (the GELU branch)
    blocks.N.ffn.fc1.weight                    encoder.block.N.layer.1.DenseReluDense.wi_1.weight  (the linear branch)
    blocks.N.ffn.fc2.weight                    encoder.block.N.layer.1.DenseReluDense.wo.weight
    norm.weight                                encoder.final_layer_norm.weight
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["wan_key_to_hf", "hf_key_to_wan", "wan_to_hf", "hf_to_wan", "load_wan_t5_state_dict", "load_into"]

# Per-block renames: official suffix after `blocks.N.` -> transformers suffix after `encoder.block.N.`.
_BLOCK = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP = {"token_embedding.weight": "shared.weight", "norm.weight": "encoder.final_layer_norm.weight"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
# transformers' second name for the embedding: the same tensor as shared.weight.
TIED_KEY = "encoder.embed_tokens.weight"

_WAN_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"encoder\.block\.(\d+)\.(.+)")


def wan_key_to_hf(key: str) -> str:
    """The transformers name of one official key; KeyError for a key that is not part of the encoder."""
    if key in _TOP:
        return _TOP[key]
    m = _WAN_BLOCK.fullmatch(key)
    if m is None or m.group(2) not in _BLOCK:
        raise KeyError(f"not an official umT5 encoder key: {key!r}")
    return f"encoder.block.{m.group(1)}.{_BLOCK[m.group(2)]}"


def hf_key_to_wan(key: str) -> str:
    """The official name of one transformers key (`encoder.embed_tokens.weight` maps to the embedding too)."""
    if key == TIED_KEY:
        return "token_embedding.weight"
    if key in _TOP_BACK:
        return _TOP_BACK[key]
    m = _HF_BLOCK.fullmatch(key)
    if m is None or m.group(2) not in _BLOCK_BACK:
        raise KeyError(f"not a UMT5EncoderModel key: {key!r}")
    return f"blocks.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}"


def wan_to_hf(sd: Mapping[str, torch.Tensor], *, with_tied: bool = True) -> dict[str, torch.Tensor]:
    """Rename an official state dict for UMT5EncoderModel. Tensors are shared, not copied. With `with_tied`, the
    embedding is also given under `encoder.embed_tokens.weight` (what `UMT5EncoderModel.state_dict()` lists)."""
    out = {wan_key_to_hf(k): v for k, v in sd.items()}
    if with_tied and "shared.weight" in out:
        out[TIED_KEY] = out["shared.weight"]
    return out


def hf_to_wan(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a UMT5EncoderModel state dict back to the official layout (the tied duplicate is dropped)."""
    return {hf_key_to_wan(k): v for k, v in sd.items() if k != TIED_KEY or "shared.weight" not in sd}


def load_wan_t5_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read the released `.pth` without copying it into memory: memory-mapped, tensors only (no code runs).

    The file is a pickled state dict (not safetensors); `weights_only=True` refuses anything but tensors and
    containers, and `mmap=True` leaves the 11.4 GB in the page cache until each tensor is moved or used."""
    try:
        sd = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        # A legacy (pre-zipfile) torch.save file cannot be memory-mapped: read it whole instead.
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path}: expected a flat state dict of tensors (the umT5 encoder's), "
                         f"found {type(sd).__name__} with keys {list(sd)[:3] if isinstance(sd, Mapping) else '-'}")
    return dict(sd)


def load_into(model: torch.nn.Module, wan_sd: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """Load an official state dict into a UMT5EncoderModel built on any device (the meta device included):
    strict, by assignment (no copy; the model takes the tensors' dtype and device), then re-tie the embedding."""
    hf = wan_to_hf(wan_sd, with_tied=False)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != TIED_KEY}
    missing = sorted(set(expected) - set(hf))
    unexpected = sorted(set(hf) - set(expected))
    wrong = sorted(k for k in set(expected) & set(hf) if tuple(hf[k].shape) != expected[k])
    if missing or unexpected or wrong:
        parts = [f"{name}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
                 for name, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if keys]
        raise ValueError("umT5 state dict does not fit the encoder (" + "; ".join(parts) + ")")
    model.load_state_dict(hf, strict=False, assign=True)
    model.tie_weights()  # assign replaced shared.weight; encoder.embed_tokens must point at the loaded tensor again
    return model
