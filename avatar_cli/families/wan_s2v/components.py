"""The text and audio encoders of wan-s2v as components the runtime can place: plain nn.Modules around the
transformers models (whose code we do not copy), each with the shape the runtime expects of a component.

- `UMT5Text`: the umT5 encoder. `blocks` (a property, so the state dict is not doubled) are its transformer
  layers, the FSDP2 units when the runtime shards it.
- `Wav2Vec2Audio`: the wav2vec2 encoder whose 25 hidden states the DiT reads, plus its feature extractor's
  settings (the official code keeps it in float32 on the CPU; see audio.py for the features).
"""

from pathlib import Path

import torch
from torch import nn
from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor
from transformers.utils import logging as hf_logging

from avatar_cli.families.wan_s2v.audio import hidden_states, load_wav2vec2
from avatar_cli.families.wan_s2v.text import UMT5Params, build_text_encoder


# transformers draws tqdm bars on stderr while loading and saving; the renderer reports its own progress.
hf_logging.disable_progress_bar()


class UMT5Text(nn.Module):
    def __init__(self, p: UMT5Params):
        super().__init__()
        self.params = p
        self.model = build_text_encoder(p)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.encoder.block

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask (B, L) -> (B, L, dim) last hidden state (padding masked, so each row is independent)."""
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


class Wav2Vec2Audio(nn.Module):
    """wav2vec2 (the CTC model's encoder; its head is never used) -> (25, T_w, dim) hidden states."""

    def __init__(self, config: Wav2Vec2Config, extractor: Wav2Vec2FeatureExtractor):
        from transformers import Wav2Vec2Model  # modeling: a slow import, paid only where a model is built

        super().__init__()
        self.model = Wav2Vec2Model(config).eval()
        self.extractor = extractor

    @classmethod
    def from_folder(cls, folder: Path) -> "Wav2Vec2Audio":
        """Config, extractor and weights from the release's folder, from disk only (safetensors preferred)."""
        model, extractor = load_wav2vec2(folder)
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.model, out.extractor = model, extractor
        return out

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        """samples (N,) normalised -> (25, T_w, dim) float32."""
        return hidden_states(self.model, samples)
