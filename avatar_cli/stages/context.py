"""Context generation, per chunk: audio features, text conditioning and the chunk's noise."""

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from avatar_cli.families.mini.audio import frame_window_starts, log_mel_windows
from avatar_cli.families.mini.text import tokenize
from avatar_cli.pipeline.schedule import Chunk
from avatar_cli.stages.base import Stage


class AudioSource(Protocol):
    def read(self, start: int, end: int) -> np.ndarray: ...  # mono float32 samples [start, end), zero-padded

    def release(self, before: int) -> None: ...  # samples before this index will not be read again


@dataclass
class ChunkContext:
    audio: torch.Tensor  # (1, L, audio_dim) per-frame audio features
    text: torch.Tensor  # (1, Nt, text_dim) prompt tokens, Nt may be 0
    noise: torch.Tensor  # (1, L, C, h, w)
    cond: torch.Tensor  # (1, L, C, h, w) clean latents at the given positions, zeros elsewhere
    mask: torch.Tensor  # (1, L) bool: which positions are given


def chunk_seed(seed: int, chunk: Chunk) -> int:
    """Noise depends on the job seed and the chunk alone: never on rank count or run history."""
    digest = hashlib.sha256(f"{seed}:{chunk.kind}:{chunk.index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class ContextGen(Stage):
    needs = ("audio", "text")

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        """Once per job. Unknown words are ignored; an empty prompt gives zero tokens."""
        text = self.model("text")
        ids = torch.tensor([tokenize(prompt, text.params)], dtype=torch.long, device=self.runtime.device)  # (1, Nt)
        if ids.shape[1] == 0:
            return torch.zeros(1, 0, text.params.dim, device=self.runtime.device, dtype=self.runtime.dtype)
        return text(ids)  # (1, Nt, text_dim)

    def audio_features(self, audio: AudioSource, first_frame: int, num_frames: int, fps: float) -> torch.Tensor:
        """Each frame's window is centred on its own timestamp, zero-padded past both ends of the audio."""
        p = self.model("audio").params
        starts = frame_window_starts(first_frame, num_frames, fps, p)  # (L,)
        lo = int(starts[0])
        samples = torch.from_numpy(audio.read(lo, int(starts[-1]) + p.window_samples))  # (span,)
        idx = (starts - lo)[:, None] + torch.arange(p.window_samples)  # (L, window)
        mel = log_mel_windows(samples[idx], p)  # (L, n_mels, mel_frames)
        enc = self.model("audio")
        return enc(mel.to(self.runtime.device, self.runtime.dtype))[None]  # (1, L, audio_dim)

    def release_before(self, audio: AudioSource, frame: int, fps: float) -> None:
        """No later chunk reads audio for frames before `frame`: let the reader drop it."""
        p = self.model("audio").params
        audio.release(int(frame_window_starts(max(0, frame), 1, fps, p)[0]))

    def run(self, chunk: Chunk, audio: AudioSource, fps: float, text: torch.Tensor, given: torch.Tensor,
            seed: int, latent_shape: tuple[int, int, int]) -> ChunkContext:
        """given (len(chunk.cond), C, h, w): the clean latents for the chunk's conditioning positions."""
        rt = self.runtime
        gen = torch.Generator().manual_seed(chunk_seed(seed, chunk))
        # Noise is drawn on the CPU in float32 so it is identical on every device and rank.
        noise = torch.randn((1, chunk.length, *latent_shape), generator=gen).to(rt.device, rt.dtype)  # (1, L, C, h, w)
        cond = torch.zeros_like(noise)  # (1, L, C, h, w)
        mask = torch.zeros(1, chunk.length, dtype=torch.bool, device=rt.device)  # (1, L)
        if chunk.cond:
            pos = torch.tensor(chunk.cond, device=rt.device)
            cond[0, pos] = given.to(rt.device, rt.dtype)
            mask[0, pos] = True
        return ChunkContext(audio=self.audio_features(audio, chunk.start, chunk.length, fps), text=text,
                            noise=noise, cond=cond, mask=mask)
