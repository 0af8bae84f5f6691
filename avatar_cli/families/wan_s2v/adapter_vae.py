"""Key mapping between the released Wan2.1 VAE (`Wan2.1_VAE.pth`: the official `WanVAE_` names, which our
`vae.WanVAE` spells too) and diffusers' `AutoencoderKLWan` (the vae/ folder of the Diffusers-layout repacks of
Wan2.2-S2V-14B), both directions, plus its config.json <-> our `WanVAEParams`.

Only names change: every tensor keeps its shape (the RMS-norm gains included: (C, 1, 1, 1) in the residual blocks
and heads, (C, 1, 1) in the attention blocks, in both layouts) and its values.

    official                                   AutoencoderKLWan
    conv1.* / conv2.*                          quant_conv.* / post_quant_conv.*
    {encoder,decoder}.conv1.*                  {encoder,decoder}.conv_in.*
    {encoder,decoder}.head.0.gamma / head.2.*  {encoder,decoder}.norm_out.gamma / conv_out.*
    {encoder,decoder}.middle.0 / .2            {encoder,decoder}.mid_block.resnets.0 / .1
    {encoder,decoder}.middle.1                 {encoder,decoder}.mid_block.attentions.0
    encoder.downsamples.i                      encoder.down_blocks.i (same index: both are flat lists)
    decoder.upsamples.i                        decoder.up_blocks.L.resnets.j, or .upsamplers.0 for the level's
                                               last entry (L, j = divmod(i, num_res_blocks + 2))
  inside a residual block:
    residual.0.gamma / residual.3.gamma        norm1.gamma / norm2.gamma
    residual.2.* / residual.6.*                conv1.* / conv2.*
    shortcut.*                                 conv_shortcut.*
  resample.1.*, time_conv.*, and the attention block's norm.gamma / to_qkv.* / proj.* keep their names.

The decoder grouping is why num_res_blocks is a parameter: each decoder level holds num_res_blocks + 1 residual
blocks and (all but the last) one resample. Attention inside the up/down levels (attn_scales) is refused:
the release has none, and diffusers' decoder would not build it.
"""

import re
from collections.abc import Mapping
from dataclasses import fields

import torch

from avatar_cli.families.wan_s2v.vae import WanVAEParams

__all__ = ["official_key_to_diffusers", "diffusers_key_to_official", "official_to_diffusers",
           "diffusers_to_official", "params_from_config", "diffusers_config", "DIFFUSERS_CLASS"]

DIFFUSERS_CLASS = "AutoencoderKLWan"

# Inside a residual block: official prefix -> diffusers prefix.
_RES = {"residual.0.": "norm1.", "residual.2.": "conv1.", "residual.3.": "norm2.", "residual.6.": "conv2.",
        "shortcut.": "conv_shortcut."}
_RES_BACK = {v: k for k, v in _RES.items()}
# Inside a residual block: the tensors under each prefix.
_RES_LEAF = {"residual.0.": ("gamma",), "residual.3.": ("gamma",), "residual.2.": ("weight", "bias"),
             "residual.6.": ("weight", "bias"), "shortcut.": ("weight", "bias")}
_RESAMPLE_LEAVES = ("resample.1.weight", "resample.1.bias", "time_conv.weight", "time_conv.bias")
_ATTN_LEAVES = ("norm.gamma", "to_qkv.weight", "to_qkv.bias", "proj.weight", "proj.bias")
_CONV_LEAVES = ("weight", "bias")

_TOP = {"conv1": "quant_conv", "conv2": "post_quant_conv"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
# Per encoder/decoder, outside the level lists.
_PART = {"conv1.": "conv_in.", "head.0.": "norm_out.", "head.2.": "conv_out.", "middle.0.": "mid_block.resnets.0.",
         "middle.1.": "mid_block.attentions.0.", "middle.2.": "mid_block.resnets.1."}
_PART_BACK = {v: k for k, v in _PART.items()}


def _res(rest: str, table: dict[str, str]) -> str | None:
    """A residual block's tensor renamed by `table` (_RES or _RES_BACK); None if it is not one."""
    for a, b in table.items():
        if rest.startswith(a):
            return b + rest[len(a):]
    return None


def _leaf_ok(official_prefix: str, leaf: str) -> bool:
    """Whether `leaf` is a tensor of the official part `official_prefix` (conv1., head.0., middle.1., a residual
    block's residual.2., ...)."""
    if official_prefix in ("conv1.", "head.2."):
        return leaf in _CONV_LEAVES
    if official_prefix == "head.0.":
        return leaf == "gamma"
    if official_prefix == "middle.1.":
        return leaf in _ATTN_LEAVES
    if official_prefix in _RES_LEAF:
        return leaf in _RES_LEAF[official_prefix]
    return any(leaf.startswith(p) and _leaf_ok(p, leaf[len(p):]) for p in _RES_LEAF)  # middle.0 / .2


def _outside_levels(key: str, top_map: dict[str, str], part_map: dict[str, str], res_map: dict[str, str]
                    ) -> str | None:
    """The renames outside the level lists, in the direction the maps give; None for any other key."""
    top, _, leaf = key.partition(".")
    if top in top_map and leaf in _CONV_LEAVES:
        return f"{top_map[top]}.{leaf}"
    if top in ("encoder", "decoder"):
        for a, b in part_map.items():
            if leaf.startswith(a):
                inner = leaf[len(a):]
                if "resnets" in a + b:  # middle.0 / middle.2 are residual blocks
                    inner = _res(inner, res_map)
                return None if inner is None else f"{top}.{b}{inner}"
    return None


_OFF_LEVEL = re.compile(r"(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(.+)")
_DIF_DOWN = re.compile(r"encoder\.down_blocks\.(\d+)\.(.+)")
_DIF_UP = re.compile(r"decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.+)")


def _valid_official(key: str, num_res_blocks: int) -> bool:
    """Whether `key` names a tensor of the official VAE (of any width, without attention in the levels)."""
    top, _, leaf = key.partition(".")
    if top in _TOP:
        return leaf in _CONV_LEAVES
    m = _OFF_LEVEL.fullmatch(key)
    if m is not None:
        rest, j = m.group(3), int(m.group(2)) % (num_res_blocks + 2)
        is_res = any(rest.startswith(p) and _leaf_ok(p, rest[len(p):]) for p in _RES_LEAF)
        if m.group(1) == "encoder.downsamples":
            return is_res or rest in _RESAMPLE_LEAVES
        return is_res if j <= num_res_blocks else rest in _RESAMPLE_LEAVES
    if top in ("encoder", "decoder"):
        return any(leaf.startswith(p) and _leaf_ok(p, leaf[len(p):]) for p in _PART)
    return False


def official_key_to_diffusers(key: str, num_res_blocks: int = 2) -> str:
    """The AutoencoderKLWan name of one official VAE key; KeyError for a key that is not one of the VAE's."""
    if not _valid_official(key, num_res_blocks):
        raise KeyError(f"not an official Wan VAE key: {key!r}")
    out = _outside_levels(key, _TOP, _PART, _RES)
    if out is not None:
        return out
    m = _OFF_LEVEL.fullmatch(key)
    i, rest = int(m.group(2)), m.group(3)
    inner = _res(rest, _RES) or rest  # resample.1 / time_conv keep their names
    if m.group(1) == "encoder.downsamples":
        return f"encoder.down_blocks.{i}.{inner}"  # one flat list in both layouts: the same index
    level, j = divmod(i, num_res_blocks + 2)
    return (f"decoder.up_blocks.{level}.resnets.{j}.{inner}" if j <= num_res_blocks
            else f"decoder.up_blocks.{level}.upsamplers.0.{inner}")


def diffusers_key_to_official(key: str, num_res_blocks: int = 2) -> str:
    """The official name of one AutoencoderKLWan key; KeyError for a key that is not one of the VAE's."""
    out = _outside_levels(key, _TOP_BACK, _PART_BACK, _RES_BACK)
    if out is None and (m := _DIF_DOWN.fullmatch(key)) is not None:
        out = f"encoder.downsamples.{m.group(1)}.{_res(m.group(2), _RES_BACK) or m.group(2)}"
    elif out is None and (m := _DIF_UP.fullmatch(key)) is not None:
        level, rest = int(m.group(1)), m.group(4)
        j = int(m.group(3)) if m.group(3) is not None else num_res_blocks + 1
        out = f"decoder.upsamples.{level * (num_res_blocks + 2) + j}.{_res(rest, _RES_BACK) or rest}"
    # Parsed generously, accepted only if it maps back to this very key (one rule set, read both ways).
    if out is None or not _valid_official(out, num_res_blocks) or \
            official_key_to_diffusers(out, num_res_blocks) != key:
        raise KeyError(f"not an AutoencoderKLWan key: {key!r}")
    return out


def _rename(sd: Mapping[str, torch.Tensor], fn, num_res_blocks: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        new = fn(k, num_res_blocks)
        if new in out:  # cannot happen for valid keys (the maps are one to one); guards a malformed file
            raise KeyError(f"two keys map to {new!r}")
        out[new] = v
    return out


def official_to_diffusers(sd: Mapping[str, torch.Tensor], num_res_blocks: int = 2) -> dict[str, torch.Tensor]:
    """Rename an official (or our WanVAE's) state dict for AutoencoderKLWan. Tensors are shared, not copied."""
    return _rename(sd, official_key_to_diffusers, num_res_blocks)


def diffusers_to_official(sd: Mapping[str, torch.Tensor], num_res_blocks: int = 2) -> dict[str, torch.Tensor]:
    """Rename an AutoencoderKLWan state dict for our WanVAE. Tensors are shared, not copied."""
    return _rename(sd, diffusers_key_to_official, num_res_blocks)


# AutoencoderKLWan config fields -> WanVAEParams fields (the rest must hold the values our module implements).
_CONFIG_FIELDS = {"base_dim": "dim", "z_dim": "z_dim", "dim_mult": "dim_mult", "num_res_blocks": "num_res_blocks",
                  "attn_scales": "attn_scales", "temperal_downsample": "temperal_downsample",
                  "latents_mean": "latent_mean", "latents_std": "latent_std"}


def params_from_config(config: Mapping) -> WanVAEParams:
    """WanVAEParams from an AutoencoderKLWan config.json. Absent fields take AutoencoderKLWan's defaults, which are
    the release's (= WanVAEParams' defaults). ValueError naming the field for a VAE our module does not implement
    (the Wan2.2 residual VAE, a separate decoder width, patchified output, attention inside the levels)."""
    cls = config.get("_class_name", DIFFUSERS_CLASS)
    if cls != DIFFUSERS_CLASS:
        raise ValueError(f"_class_name is {cls!r}, not {DIFFUSERS_CLASS!r}")
    for name, want in (("is_residual", False), ("patch_size", None), ("in_channels", 3), ("out_channels", 3)):
        if config.get(name, want) != want:
            raise ValueError(f"{name} = {config[name]!r}: only {want!r} (the Wan2.1 VAE) is supported")
    base = config.get("base_dim", 96)
    if config.get("decoder_base_dim") not in (None, base):
        raise ValueError(f"decoder_base_dim = {config['decoder_base_dim']!r} differs from base_dim {base}: "
                         "only one width (the Wan2.1 VAE) is supported")
    if config.get("attn_scales"):
        raise ValueError(f"attn_scales = {config['attn_scales']!r}: attention inside the levels is not supported")
    defaults = {f.name: f.default for f in fields(WanVAEParams)}
    kwargs = {}
    for src, dst in _CONFIG_FIELDS.items():
        value = config.get(src, defaults[dst])
        kwargs[dst] = tuple(value) if isinstance(value, list) else value
    try:
        p = WanVAEParams(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    for name, want in (("scale_factor_temporal", p.time_stride), ("scale_factor_spatial", p.space_stride)):
        if config.get(name) not in (None, want):
            raise ValueError(f"{name} = {config[name]!r} contradicts the strides of the other fields ({want})")
    return p


def diffusers_config(p: WanVAEParams) -> dict:
    """The AutoencoderKLWan config.json of a VAE of these params (what a repack's vae/config.json holds)."""
    out = {"_class_name": DIFFUSERS_CLASS}
    for src, dst in _CONFIG_FIELDS.items():
        value = getattr(p, dst)
        out[src] = list(value) if isinstance(value, tuple) else value
    out.update({"dropout": 0.0, "is_residual": False, "in_channels": 3, "out_channels": 3, "patch_size": None,
                "scale_factor_temporal": p.time_stride, "scale_factor_spatial": p.space_stride})
    return out
