"""The mini family: one params dataclass per model, grouped, and a registry of named sizes.

A model directory holds `config.json` (this dataclass, as JSON) and one safetensors file per model.
"""

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from avatar_cli.families.mini.audio import AudioEncoder, AudioParams
from avatar_cli.families.mini.dit import DiT, DiTParams
from avatar_cli.families.mini.sr import SRParams, SuperRes
from avatar_cli.families.mini.text import TextEncoder, TextParams
from avatar_cli.families.mini.vae import VAE, VAEParams


# dit fields added after model dirs were first written, with the value that matches those older dirs:
# a velocity model without the near-given inputs.
DIT_BEFORE_FIELDS = {"predict": "v", "near_given": False}


@dataclass(frozen=True)
class FamilyConfig:
    family: str = "mini"
    size: str = "mini"
    image_size: int = 256  # the decoder's native output side; the DiT works at image_size / sr.scale
    vae: VAEParams = field(default_factory=VAEParams)
    dit: DiTParams = field(default_factory=DiTParams)
    sr: SRParams = field(default_factory=SRParams)
    audio: AudioParams = field(default_factory=AudioParams)
    text: TextParams = field(default_factory=TextParams)

    @property
    def low_size(self) -> int:
        return self.image_size // self.sr.scale

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FamilyConfig":
        """Strict: unknown fields are an error (a config from another version must not half-load)."""
        sub = {"vae": VAEParams, "dit": DiTParams, "sr": SRParams, "audio": AudioParams, "text": TextParams}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config fields: {', '.join(sorted(unknown))}")
        kwargs: dict[str, Any] = {}
        if isinstance(d.get("dit"), dict):  # fields added later: what a model dir written before them means
            d = {**d, "dit": {**DIT_BEFORE_FIELDS, **d["dit"]}}
        for name, value in d.items():
            if name in sub:
                kwargs[name] = _build(sub[name], value, name)
            else:
                kwargs[name] = value
        return cls(**kwargs)

    def check(self) -> None:
        """Cross-model consistency; raises ValueError naming the mismatch."""
        c = self.vae.latent_channels
        for name, value in (("dit.latent_channels", self.dit.latent_channels), ("sr.latent_channels", self.sr.latent_channels)):
            if value != c:
                raise ValueError(f"{name}={value} but vae.latent_channels={c}")
        if self.low_size // self.vae.downsample != self.dit.latent_size:
            raise ValueError(f"dit.latent_size={self.dit.latent_size} but image_size/sr.scale/vae.downsample="
                             f"{self.low_size // self.vae.downsample}")
        if self.dit.audio_dim != self.audio.dim or self.dit.text_dim != self.text.dim:
            raise ValueError("dit.audio_dim/text_dim must equal audio.dim/text.dim")
        if self.dit.predict not in ("v", "x"):
            raise ValueError(f"dit.predict must be 'v' or 'x', got {self.dit.predict!r}")
        if self.dit.max_gap < 1:
            raise ValueError(f"dit.max_gap must be >= 1, got {self.dit.max_gap}")
        if (self.dit.dim // self.dit.heads) % 4:
            raise ValueError("dit head dim must be a multiple of 4 (3-axis RoPE)")


def _build(cls: type, value: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(value) - set(known)
    if unknown:
        raise ValueError(f"unknown config fields in {where}: {', '.join(sorted(unknown))}")
    # JSON has no tuples; the dataclasses are frozen and hashable, so turn lists back into tuples.
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})


# Which model of the family lives in which safetensors file.
COMPONENTS: dict[str, tuple[str, type[nn.Module]]] = {
    "vae": ("vae.safetensors", VAE),
    "dit": ("dit.safetensors", DiT),
    "sr": ("sr.safetensors", SuperRes),
    "audio": ("audio.safetensors", AudioEncoder),
    "text": ("text.safetensors", TextEncoder),
}


def _tiny() -> FamilyConfig:
    # The real architecture at toy size, for tests: 64x64 output, 8x8 low-res latents.
    return FamilyConfig(
        size="tiny", image_size=64,
        vae=VAEParams(latent_channels=4, channels=(8, 16, 16)),
        dit=DiTParams(latent_channels=4, latent_size=4, patch=2, dim=32, depth=2, heads=2, audio_dim=16, text_dim=16,
                      ref_hi_patch=4),
        sr=SRParams(latent_channels=4, width=16, blocks=1),
        audio=AudioParams(dim=16),
        text=TextParams(dim=16, heads=2, depth=1),
    )


SIZES: dict[str, FamilyConfig] = {
    "tiny": _tiny(),
    # The decoder is thinner than the encoder: it runs on every output frame (0.45x the multiply-adds of
    # (32, 64, 128); its speed on a CPU: bench/cpu_levers.py, figures in bench/results.md).
    "mini": FamilyConfig(vae=VAEParams(decoder_channels=(16, 32, 64))),
}
