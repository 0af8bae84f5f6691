"""SwiftVR's budget (runtime/budget.py `SRBudget`) for a job's `sr.model`, counted on the meta device: what `avatar
plan` adds to the rank that decodes.

- Parameters: the transformer and ReAE built on meta, from a model directory's transformer/config.json or at the
  release's size (`sr.model: swiftvr`, no weights), in the runtime dtype; under `runtime.weights: fp8 | int8` the
  transformer's block Linears as torchao lays them out (runtime/quantize.py). The prompt embedding is held too.
- One chunk at the output size: the first, the largest (28 input frames, 7 latents; official
  `swiftvr/streaming/chunk.py:build_chunk_specs` with the release's clip_len 24): its frames upscaled, encoded,
  one transformer pass, decoded, with the stream's state carried (avatar_cli/sr/swiftvr/stream.py `SRStream` on
  meta). Its activations are the most bytes allocated at once (attention fused: runtime/meta_count.py), its FLOPs
  torch's FlopCounterMode over the same pass; the state is what the stream carries to the next chunk at its
  fullest (a 24-frame group held back beside the autoencoder's and the transformer's carried tensors).
"""

import functools
from pathlib import Path

import torch

from avatar_cli.runtime.budget import ModelBytes, SRBudget, blocked_bytes
from avatar_cli.runtime.device import dtype_name
from avatar_cli.runtime.flops import flop_counter
from avatar_cli.runtime.meta_count import peak_bytes
from avatar_cli.sr.swiftvr import adapter, model_dir, stream
from avatar_cli.sr.swiftvr.dit import SwiftVRDiT
from avatar_cli.sr.swiftvr.reae import ReAE, ReAEParams

SIZE_NAME = "swiftvr"  # `sr.model: swiftvr`: the release's size, for a plan without the weights
FIRST_FRAMES = 28  # the first chunk's input frames (FIRST: clip_len + 4)
GROUP_FRAMES = 24  # a middle chunk's (clip_len): the most input frames the stream holds back
QUANTIZED = ("blocks",)  # the transformer's Linears `runtime.weights` quantizes
# The release's transformer/config.json (Wan2.2-TI2V-5B's shapes, official README): 4,999,787,712 parameters.
RELEASE_CONFIG = {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 24,
                  "attention_head_dim": 128, "in_channels": 48, "out_channels": 48, "text_dim": 4096,
                  "freq_dim": 256, "ffn_dim": 14336, "num_layers": 30, "cross_attn_norm": True,
                  "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "image_dim": None, "added_kv_proj_dim": None,
                  "rope_max_seq_len": 1024, "pos_embed_seq_len": None}
PROMPT_SHAPE = (512, 4096)  # the release's prompt_embedding.safetensors `prompt_emb`, per batch entry


def is_size_name(model: str | None, directory: Path | None) -> bool:
    """`sr.model` names the release's size (and no directory of that name is there)."""
    return model == SIZE_NAME and (directory is None or not directory.is_dir())


@functools.lru_cache(maxsize=4)
def _params(directory: Path | None):
    """The transformer's params: the directory's config.json, or the release's."""
    if directory is None:
        return adapter.params_from_config(RELEASE_CONFIG)
    model_dir.check(directory)  # headers against the config: a plan of a broken directory says so, as a render does
    return adapter.params_from_config(model_dir.read_config(directory))


def _on_meta(params, dtype: torch.dtype) -> stream.SRModels:
    with torch.device("meta"):
        dit = SwiftVRDiT(params).to(dtype).eval()
        reae = ReAE(ReAEParams()).to(dtype).eval()
        prompt = torch.empty(1, *PROMPT_SHAPE, dtype=dtype)
    return stream.SRModels(reae=reae, dit=dit, prompt=prompt)


@functools.lru_cache(maxsize=8)
def _models(params, dtype: torch.dtype, weights: str) -> dict[str, ModelBytes]:
    m = _on_meta(params, dtype)
    prompt = m.prompt.numel() * m.prompt.element_size()
    return {"sr_dit": blocked_bytes(m.dit, m.dit.blocks, dtype, weights, QUANTIZED),
            # the prompt embedding rides with the autoencoder: both small, both resident while the stage runs
            "sr_reae": ModelBytes(blocked_bytes(m.reae, (), dtype).total + prompt, dtype_name(dtype))}


def _state_bytes(s: stream.SRStream) -> int:
    return sum(t.numel() * t.element_size() for t in s.state_dict().values())


@functools.lru_cache(maxsize=8)
def _chunk(params, dtype: torch.dtype, lq_hw: tuple[int, int], scale: int) -> tuple[int, float, int, tuple[int, int]]:
    """(activation peak, FLOPs, carried state at its fullest, output (h, w)) of the first chunk on meta."""
    m = _on_meta(params, dtype)
    h, w = lq_hw

    def first() -> stream.SRStream:
        s = stream.SRStream(m, lq_hw, scale, torch.device("meta"), dtype)
        return s

    frames = torch.empty(FIRST_FRAMES + 1, 3, h, w, dtype=dtype, device="meta")  # one more: the first is not LAST
    s = first()
    peak = peak_bytes(lambda: s.push(frames))
    counter, s = flop_counter(), first()
    with torch.no_grad(), counter:
        s.push(frames)
    flops = float(counter.get_total_flops())
    s = first()  # the first chunk out, then a whole group held back until the frame after it shows it is not LAST
    with torch.no_grad():
        s.push(torch.empty(FIRST_FRAMES + GROUP_FRAMES, 3, h, w, dtype=dtype, device="meta"))
    return peak, flops, _state_bytes(s), tuple(s.out_hw)


def sr_budget(directory: Path | None, size: tuple[int, int], scale: int, dtype: torch.dtype,
              weights: str = "bf16") -> SRBudget:
    """SwiftVR at the family's frame `size` (width, height) times `scale`: directory None counts the release's size.
    The models in `dtype`, the transformer's block Linears under `runtime.weights`."""
    params = _params(directory)
    w, h = size
    peak, flops, state, (oh, ow) = _chunk(params, dtype, (h, w), scale)
    return SRBudget("swiftvr", scale, size, (ow, oh), _models(params, dtype, weights), peak=peak, state=state,
                    flops=flops, chunk_frames=FIRST_FRAMES)
