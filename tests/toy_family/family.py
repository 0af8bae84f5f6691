"""The toy family behind the renderer's interface."""

import hashlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from avatar_cli.families.base import (AudioSource, Chunk, Family, Final, Geometry, Models, ParallelPlan,
                                      RollingState, Sampling, Step)
from avatar_cli.runtime.rings import RingStore
from tests.toy_family.model import ToyNet, ToyParams, ToyText

SAMPLE_RATE = 16_000


def word_ids(prompt: str, vocab: int) -> list[int]:
    return [int.from_bytes(hashlib.sha256(w.encode()).digest()[:4], "little") % vocab
            for w in re.findall(r"\w+", prompt.lower())]


class ToyFamily(Family):
    name = "toy"
    needs = {Step.reference: ("net",), Step.prompt: ("text",), Step.context: (), Step.a2v: ("net",), Step.sr: (),
             Step.decode: ("net",)}

    def __init__(self, config: ToyParams):
        self.config = config

    @property
    def components(self) -> Mapping[str, tuple[type[nn.Module], Any]]:
        return {"net": (ToyNet, self.config), "text": (ToyText, self.config)}

    @property
    def geometry(self) -> Geometry:
        s = 4 * self.config.latent
        return Geometry(kinds=("N",), native_size=(s, s), native_fps=None, sample_rate=SAMPLE_RATE)

    @property
    def parallel(self) -> ParallelPlan:
        return ParallelPlan()

    def plan(self, chunking: Any, total_frames: int) -> list[Chunk]:
        if chunking.transitions is not False:
            raise ValueError("the toy family's plan takes a resolved bool for chunking.transitions")
        n, out = chunking.frames, []
        for i, s in enumerate(range(0, total_frames, n)):
            e = min(s + n, total_frames)
            out.append(Chunk("N", i, s, n, (), (s, e), e))
        return out

    def check_job(self, chunking: Any, sampling: Sampling) -> None:
        if chunking.transitions is True:
            raise ValueError("chunking.transitions: the toy family has no I chunks")

    def reference(self, models: Models, image: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        c, s = self.config.channels, self.config.latent
        x = nn.functional.adaptive_avg_pool2d(image[None].to(device, dtype), s)  # (1, 3, s, s)
        return torch.cat([x, x[:, :c - 3]], dim=1) if c > 3 else x[:, :c]  # (1, C, s, s)

    def prompt(self, models: Models, prompt: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        ids = word_ids(prompt, self.config.vocab)
        if not ids:
            return torch.zeros(1, self.config.dim, device=device, dtype=dtype)
        return models["text"](torch.tensor([ids], device=device)).mean(dim=1)  # (1, dim)

    def prompt_tensors(self, out: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"text": out}

    def prompt_from_tensors(self, tensors: dict[str, torch.Tensor], device: torch.device,
                            dtype: torch.dtype) -> torch.Tensor:
        return tensors["text"].to(device)

    def context(self, models: Models, chunk: Chunk, audio: AudioSource, fps: float, text: torch.Tensor,
                state: RollingState, seed: int, device: torch.device, dtype: torch.dtype) -> dict:
        per = SAMPLE_RATE / fps
        lo = int(chunk.start * per)
        samples = torch.from_numpy(audio.read(lo, int(chunk.end * per)))
        loud = torch.stack([samples[int(i * per):int((i + 1) * per)].abs().mean() for i in range(chunk.length)])
        gen = torch.Generator().manual_seed(seed * 1000 + chunk.index)
        noise = torch.randn((chunk.length, self.config.channels, self.config.latent, self.config.latent), generator=gen)
        return {"noise": noise.to(device, dtype), "loud": loud.to(device, dtype), "text": text}

    def release_audio(self, models: Models, audio: AudioSource, frame: int, fps: float) -> None:
        audio.release(max(0, int(frame * SAMPLE_RATE / fps)))

    def denoise(self, models: Models, inputs: dict, ref: torch.Tensor, sampling: Sampling, state: RollingState,
                rings: RingStore = RingStore()) -> torch.Tensor:
        z = 0.5 * inputs["noise"] + ref  # (L, C, h, w)
        for _ in range(sampling.steps):
            z = models["net"](z, inputs["text"], inputs["loud"])
        return z

    def keep(self, chunk: Chunk, z: torch.Tensor, state: RollingState, chunking: Any) -> None:
        s, e = chunk.keep
        state.held.append((s, e, z[:e - s]))

    def decode(self, models: Models, final: Final, state: RollingState,
               put: Callable[[torch.Tensor], None]) -> int:
        put(models["net"].frames(final.z))
        return final.frames
