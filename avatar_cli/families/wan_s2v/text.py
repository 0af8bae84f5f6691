"""The Wan2.2-S2V text encoder: umT5-XXL's encoder as `transformers.UMT5EncoderModel`, its tokenizer, and the
prompt -> context path of the official `T5EncoderModel` wrapper (wan/modules/t5.py, tokenizers.py).

    tokenizer = load_tokenizer(ckpt / "google/umt5-xxl")
    with torch.device("meta"):
        model = build_text_encoder(UMT5_XXL)
    adapter_t5.load_into(model, adapter_t5.load_wan_t5_state_dict(ckpt / "models_t5_umt5-xxl-enc-bf16.pth"))
    context = encode(model.eval().to(device), tokenizer, [prompt, S2V_NEGATIVE_PROMPT])  # [(L_i, 4096)] * 2

The released weights are bf16 (11.4 GB); the official code runs the encoder in bf16 (T5 in fp32 would be 22.7 GB).
The DiT zero-pads each context back to 512 tokens itself, without a mask (as `WanModel_S2V.forward` does with
`text_len`, wan/modules/s2v/model_s2v.py): hand it the
trimmed tensors as they come out of `encode`.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ftfy
import regex
import torch
from transformers import PreTrainedTokenizerFast, UMT5Config

if TYPE_CHECKING:  # transformers' modeling import is slow: made where the encoder is built
    from transformers import UMT5EncoderModel

__all__ = ["UMT5Params", "UMT5_XXL", "TEXT_LEN", "S2V_NEGATIVE_PROMPT", "umt5_config", "build_text_encoder",
           "umt5_state_shapes", "load_tokenizer", "clean_prompt", "tokenize", "encode"]

# The official tokenizer length (wan/configs/shared_config.py `text_len`): prompts are padded or truncated to it.
TEXT_LEN = 512

# The S2V negative prompt, used for the unconditional CFG branch when no negative prompt is given
# (wan/configs/wan_s2v_14B.py `sample_neg_prompt`; it differs from the shared config's generic one).
S2V_NEGATIVE_PROMPT = (
    "画面模糊，最差质量，画面模糊，细节模糊不清，情绪激动剧烈，手快速抖动，字幕，丑陋的，残缺的，多余的手指，画得不好的手部，"
    "画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走"
)


@dataclass(frozen=True)
class UMT5Params:
    """The encoder's shape. The release's .pth carries no config: these are the official `umt5_xxl` values."""

    vocab_size: int = 256384
    dim: int = 4096
    ffn_dim: int = 10240
    num_heads: int = 64  # head_dim = dim // num_heads = 64
    num_layers: int = 24
    num_buckets: int = 32  # relative-position buckets, one table per layer (shared_pos=False)
    max_distance: int = 128
    eps: float = 1e-6


UMT5_XXL = UMT5Params()


def umt5_config(p: UMT5Params) -> UMT5Config:
    """A UMT5Config equal to the official T5Encoder: pre-norm RMS, unscaled attention with per-layer bidirectional
    relative-position buckets, FFN = wo(gelu_tanh(wi_0 x) * wi_1 x), final RMS norm. Dropout is inactive in eval."""
    if p.dim % p.num_heads:
        raise ValueError(f"dim {p.dim} is not a multiple of num_heads {p.num_heads}")
    return UMT5Config(
        vocab_size=p.vocab_size, d_model=p.dim, d_kv=p.dim // p.num_heads, d_ff=p.ffn_dim, num_layers=p.num_layers,
        num_heads=p.num_heads, relative_attention_num_buckets=p.num_buckets,
        relative_attention_max_distance=p.max_distance, feed_forward_proj="gated-gelu",  # gelu_new: the tanh form
        layer_norm_epsilon=p.eps, dropout_rate=0.1, is_encoder_decoder=False, use_cache=False)


def build_text_encoder(p: UMT5Params = UMT5_XXL, *, attn_implementation: str = "eager") -> UMT5EncoderModel:
    """The encoder with transformers' random init, on the current default device (use `torch.device("meta")` at
    full size, then `adapter_t5.load_into`). "eager" (the default) computes attention as the official code does
    and is bit-identical to it in float32; "sdpa" is within 1e-6 relative (tested). At 512 tokens the eager score
    matrix is small (64 heads x 512 x 512 x 2 B = 34 MB per prompt in bf16)."""
    from transformers import UMT5EncoderModel

    config = umt5_config(p)
    config._attn_implementation = attn_implementation  # read by every attention layer at forward time
    return UMT5EncoderModel(config).eval()


def umt5_state_shapes(p: UMT5Params) -> dict[str, tuple[int, ...]]:
    """The names and shapes of `build_text_encoder(p).state_dict()`, written out: reading a checkpoint's header
    (validate, models check, the --nproc launcher) then needs no model built, nor transformers' modeling import
    (1.9 s). tests/test_wan_text_audio.py holds it equal to the built model's, at the tiny and the release size."""
    d, f = p.dim, p.ffn_dim
    out = {"shared.weight": (p.vocab_size, d), "encoder.embed_tokens.weight": (p.vocab_size, d)}
    for i in range(p.num_layers):
        b = f"encoder.block.{i}.layer"
        out.update({f"{b}.0.SelfAttention.{w}.weight": (d, d) for w in "qkvo"})
        out[f"{b}.0.SelfAttention.relative_attention_bias.weight"] = (p.num_buckets, p.num_heads)
        out[f"{b}.0.layer_norm.weight"] = (d,)
        out.update({f"{b}.1.DenseReluDense.{w}.weight": (f, d) for w in ("wi_0", "wi_1")})
        out[f"{b}.1.DenseReluDense.wo.weight"] = (d, f)
        out[f"{b}.1.layer_norm.weight"] = (d,)
    out["encoder.final_layer_norm.weight"] = (d,)
    return out


def _special_tokens(folder: Path) -> dict[str, str]:
    """pad/eos/unk from tokenizer_config.json or special_tokens_map.json (T5's spellings where absent)."""
    found = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        for key in found:
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """The checkpoint's tokenizer folder (`google/umt5-xxl/`), read from disk only.

    tokenizer.json is loaded verbatim (normalizer, pre-tokenizer, byte fallback, EOS template), as transformers
    <= 4.51 (the official pin) loads it through T5TokenizerFast. transformers 5's AutoTokenizer instead rebuilds
    T5 tokenizers from the vocabulary with its own pre-tokenizer and byte_fallback=False, and keeps only a
    Precompiled normalizer, which can change ids for unusual text."""
    folder = Path(folder)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file} not found (the umT5 tokenizer folder holds tokenizer.json)")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), model_max_length=TEXT_LEN,
                                  padding_side="right", **_special_tokens(folder))
    if tok.pad_token_id is None or tok.eos_token_id is None:
        raise ValueError(f"{tokenizer_file}: no pad or eos token in the vocabulary")
    return tok


_WHITESPACE = regex.compile(r"\s+")


def clean_prompt(text: str) -> str:
    """The official 'whitespace' cleaning: ftfy, HTML entities unescaped twice, strip, runs of whitespace -> one
    space. (`regex`, not `re`, as the official code: their `\\s` differ on a few control characters.)"""
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return _WHITESPACE.sub(" ", text).strip()


def tokenize(tokenizer: PreTrainedTokenizerFast, prompts: list[str], max_length: int = TEXT_LEN
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (B, max_length) int64: cleaned, EOS appended, right-padded and truncated to max_length."""
    batch = tokenizer([clean_prompt(p) for p in prompts], padding="max_length", truncation=True,
                      max_length=max_length, add_special_tokens=True, return_tensors="pt")
    return batch.input_ids, batch.attention_mask


@torch.no_grad()
def encode(model: UMT5EncoderModel, tokenizer: PreTrainedTokenizerFast, prompts: list[str],
           max_length: int = TEXT_LEN) -> list[torch.Tensor]:
    """One (L_i, dim) tensor per prompt, L_i its token count (EOS included, at most max_length), in the model's
    dtype and on its device. Padding is masked, so a prompt's output does not depend on the others in the batch."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings")
    ids, mask = tokenize(tokenizer, prompts, max_length)  # (B, L), (B, L)
    device = model.get_input_embeddings().weight.device
    hidden = model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # (B, L, dim)
    lengths = mask.sum(dim=1).tolist()
    return [h[:n] for h, n in zip(hidden, lengths)]  # [(L_i, dim)]
