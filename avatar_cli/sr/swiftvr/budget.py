"""SwiftVR's budget (runtime/budget.py `SRBudget`) for a job's `sr.model`, counted on the meta device: what `avatar
plan` adds to the rank that decodes.

- Parameters: the transformer and ReAE built on meta, at a model directory's sizes (transformer/config.json, the
  ReAE's and the prompt's from their headers: sr/swiftvr/model_dir.py read_release) or at the release's
  (`sr.model: swiftvr`, no weights), in the runtime dtype; under `runtime.weights: fp8 | int8` the
  transformer's block Linears as torchao lays them out (runtime/quantize.py). The prompt embedding is held too.
- One chunk at the output size: the first, the largest (28 input frames, 7 latents; official
  `swiftvr/streaming/chunk.py:build_chunk_specs` with the release's clip_len 24): its frames upscaled, encoded,
  one transformer pass, decoded, with the stream's state carried (avatar_cli/sr/swiftvr/stream.py `SRStream` on
  meta). Its activations are the most bytes allocated at once (attention fused: runtime/meta_count.py), its FLOPs
  torch's FlopCounterMode over the same pass; the state is what the stream carries to the next chunk at its
  fullest (a 24-frame group held back beside the autoencoder's and the transformer's carried tensors).
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from avatar_cli.modules.module import build_meta
from avatar_cli.runtime.budget import ModelBytes, SRBudget, blocked_bytes
from avatar_cli.runtime.device import dtype_name
from avatar_cli.runtime.meta_count import peak_and_flops
from avatar_cli.sr.swiftvr import model_dir, stream
from avatar_cli.sr.swiftvr.dit import SwiftVRDiT, SwiftVRParams
from avatar_cli.sr.swiftvr.reae import ReAE, ReAEParams

SIZE_NAME = "swiftvr"  # `sr.model: swiftvr`: the release's size, for a plan without the weights
FIRST_FRAMES = stream.FIRST  # the first chunk's input frames, the largest chunk (7 latents)
GROUP_FRAMES = stream.CLIP  # a middle chunk's: the most input frames the stream holds back
QUANTIZED = ("blocks",)  # the transformer's Linears `runtime.weights` quantizes
PROMPT_SHAPE = (512, 4096)  # the release's prompt embedding, prompt_emb[0]: (tokens, text_dim)


@dataclass(frozen=True)
class Sizes:
    """SwiftVR's sizes: its transformer's, its ReAE's and its prompt embedding's (tokens, dim)."""

    dit: SwiftVRParams
    reae: ReAEParams
    prompt: tuple[int, int]


def is_size_name(model: str | None, directory: Path | None) -> bool:
    """`sr.model` names the release's size (and no directory of that name is there)."""
    return model == SIZE_NAME and (directory is None or not directory.is_dir())


def sizes(directory: Path | None) -> Sizes:
    """A release directory's sizes from its config and headers (checked as a render checks them: InputError naming
    what does not fit), or the release's (None). Read each time (headers only): the counts are cached by sizes."""
    if directory is None:
        return Sizes(SwiftVRParams.release(), ReAEParams.release(), PROMPT_SHAPE)
    rel = model_dir.read_release(directory)
    return Sizes(rel.dit, rel.reae, tuple(rel.prompt.shape[1:]))


def on_meta(s: Sizes, dtype: torch.dtype) -> stream.SRModels:
    """SwiftVR's models built on the meta device in `dtype`: shapes and dtypes, no storage."""
    return stream.SRModels(reae=build_meta(ReAE, s.reae).to(dtype).eval(),
                           dit=build_meta(SwiftVRDiT, s.dit).to(dtype).eval(),
                           prompt=torch.empty(s.prompt, dtype=dtype, device="meta"))


@functools.lru_cache(maxsize=8)
def _models(s: Sizes, dtype: torch.dtype, weights: str) -> dict[str, ModelBytes]:
    m = on_meta(s, dtype)
    prompt = m.prompt.numel() * m.prompt.element_size()
    return {"sr_dit": blocked_bytes(m.dit, m.dit.blocks, dtype, weights, QUANTIZED),
            # the prompt embedding rides with the autoencoder: both small, both resident while the stage runs
            "sr_reae": ModelBytes(blocked_bytes(m.reae, (), dtype).total + prompt, dtype_name(dtype))}


def _state_bytes(s: stream.SRStream) -> int:
    return sum(t.numel() * t.element_size() for t in s.state_dict().values())


@functools.lru_cache(maxsize=8)
def _chunk(sz: Sizes, dtype: torch.dtype, lq_hw: tuple[int, int], scale: int
           ) -> tuple[int, float, int, tuple[int, int]]:
    """(activation peak, FLOPs, carried state at its fullest, output (h, w)) of the first chunk on meta."""
    m = on_meta(sz, dtype)
    h, w = lq_hw

    def first() -> stream.SRStream:
        return stream.SRStream(m, lq_hw, scale, torch.device("meta"), dtype)

    frames = torch.empty(FIRST_FRAMES + 1, 3, h, w, dtype=dtype, device="meta")  # one more: the first is not LAST
    s = first()
    peak, flops = peak_and_flops(lambda: s.push(frames))
    s = first()  # the first chunk out, then a whole group held back until the frame after it shows it is not LAST
    with torch.no_grad():
        s.push(torch.empty(FIRST_FRAMES + GROUP_FRAMES, 3, h, w, dtype=dtype, device="meta"))
    return peak, flops, _state_bytes(s), tuple(s.out_hw)


def sr_budget(directory: Path | None, size: tuple[int, int], scale: int, dtype: torch.dtype,
              weights: str = "bf16") -> SRBudget:
    """SwiftVR at the family's frame `size` (width, height) times `scale`: directory None counts the release's size.
    The models in `dtype`, the transformer's block Linears under `runtime.weights`."""
    sz = sizes(directory)
    w, h = size
    peak, flops, state, (oh, ow) = _chunk(sz, dtype, (h, w), scale)
    return SRBudget("swiftvr", scale, size, (ow, oh), _models(sz, dtype, weights), peak=peak, state=state,
                    flops=flops, chunk_frames=FIRST_FRAMES)
