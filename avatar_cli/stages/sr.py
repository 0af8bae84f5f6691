"""Frame-space super-resolution (SwiftVR): decoded frames in, larger frames out, between the decode and the Sink.

A family's latent refine (`Family.refine`, mini's) runs before its decode and belongs to the family; this stage
works on the decoded frames with a model of its own (SwiftVR's autoencoder and DiT, avatar_cli/sr/swiftvr/), so it
sits in the publish path after the decode, wherever that runs (stages/publish.py `PublishHere`, in the render
process or on the timestep pipeline's decode rank), and holds its own state: the stream's carried tensors and the
input frames it holds back until it knows they are not the last (`SRStream.held`). That state is part of the
rolling state (`sr.` tensors, saved at every resume point), so a resumed render continues the stream exactly.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from avatar_cli.errors import InputError
from avatar_cli.families.base import RollingState
from avatar_cli.runtime.quantize import quantize_linears
from avatar_cli.sr.swiftvr import model_dir, stream

PREFIX = "sr."  # the stage's tensors in the rolling state: sr.<SRStream.state_dict key>
QUANTIZED = ("blocks",)  # `runtime.weights: fp8 | int8`: the SR DiT's block Linears, as the families' DiTs


@dataclass(frozen=True)
class SRPlan:
    """`sr.*` resolved once (job.resolve): the model directory, checked; the scale; the size the frames have when
    they reach SR (`lq`, the family's output before SR) and the size they leave it at (`out`), each (width, height)."""

    model: Path
    scale: int
    lq: tuple[int, int]
    out: tuple[int, int]


def resolve_plan(folder: Path, scale: int, lq: tuple[int, int]) -> SRPlan:
    """The SR plan for frames of size `lq` (width, height): `folder` recognised as a SwiftVR release and checked from
    its headers (avatar_cli/sr/swiftvr/model_dir.py), the output size as the model rounds it (it crops each side of
    its input to a multiple of 8). InputError naming what is wrong."""
    if not model_dir.is_release_dir(folder):
        raise InputError(f"sr.model: {folder} is not a SwiftVR model directory (reae.safetensors, "
                         "prompt_embedding.safetensors, transformer/)")
    try:
        model_dir.read_release(folder)
    except InputError as e:
        raise InputError(f"sr.model: {e}") from None
    try:
        h, w = stream.output_size((lq[1], lq[0]), scale)
    except (ValueError, InputError) as e:
        raise InputError(f"sr.scale: {scale}: {e}") from None
    return SRPlan(folder, scale, lq, (w, h))


def load_models(plan: SRPlan, device: torch.device, dtype: torch.dtype, weights: str = "bf16") -> Any:
    """The SR models loaded and placed (safetensors only, strict keys, built on meta: swiftvr.load_sr); with
    `runtime.weights: fp8 | int8` the DiT's block Linears quantized as the families' are (runtime/quantize.py)."""
    models = stream.load_sr(plan.model, device, dtype)
    if weights != "bf16":
        quantize_linears(models.dit, weights, QUANTIZED)
    return models


class FrameSR:
    """One job's SR stream: `push` decoded frames, get back the frames now final; `finish` at the end gives the rest.

    Frames in and out are (T, 3, H, W) in [-1, 1], as the decode makes them; the stream works in [0, 1]. `keep`
    writes the stream's state into the rolling state (after each published stretch: the resume point's), `resume`
    reads it back (a resumed render's first stretch)."""

    def __init__(self, models: Any, plan: SRPlan, device: torch.device, dtype: torch.dtype):
        w, h = plan.lq
        self.stream = stream.SRStream(models, (h, w), plan.scale, device, dtype)
        self.plan, self.device = plan, device
        self._resumed = False

    @property
    def held(self) -> int:
        """Input frames pushed but not yet out."""
        return self.stream.held

    def push(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, 3, h, w) in [-1, 1] -> (T', 3, H, W) in [-1, 1], T' <= T + held: the frames now final."""
        y = self.stream.push(((x.float() + 1) / 2).to(self.device))  # (T', 3, H, W) in [0, 1]
        return y * 2 - 1

    def finish(self) -> torch.Tensor:
        """The frames still held, (held, 3, H, W) in [-1, 1]: every input frame has then come out."""
        return self.stream.finish() * 2 - 1

    def resume(self, state: RollingState) -> None:
        """Once, before the first push: the stream's state from a resumed render's rolling state (none: a fresh
        start)."""
        if self._resumed:
            return
        self._resumed = True
        mine = {k.removeprefix(PREFIX): v for k, v in state.tensors.items() if k.startswith(PREFIX)}
        if mine:
            self.stream.load_state_dict({k: v.to(self.device) for k, v in mine.items()})

    def keep(self, state: RollingState) -> None:
        """The stream's state, held input frames included, into the rolling state (replacing the last)."""
        for k in [k for k in state.tensors if k.startswith(PREFIX)]:
            del state.tensors[k]
        state.tensors.update({PREFIX + k: v for k, v in self.stream.state_dict().items()})
