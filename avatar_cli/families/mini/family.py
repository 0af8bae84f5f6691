"""The mini family behind the renderer's interface: what each step of a chunk does with mini's models."""

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from avatar_cli.families.base import (AudioSource, Chunk, Family, Final, Geometry, Models, ParallelPlan,
                                      RollingState, Sampling, Step)
from avatar_cli.families.mini.audio import frame_window_starts, log_mel_windows
from avatar_cli.families.mini.config import COMPONENTS, FamilyConfig
from avatar_cli.families.mini.parallel import SequenceParallelDiT
from avatar_cli.families.mini.sampling import sample, timesteps
from avatar_cli.families.mini.schedule import plan
from avatar_cli.families.mini.text import tokenize
from avatar_cli.runtime.rings import RingStore


def chunk_seed(seed: int, chunk: Chunk) -> int:
    """Noise depends on the job seed and the chunk alone: never on rank count or run history."""
    digest = hashlib.sha256(f"{seed}:{chunk.kind}:{chunk.index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class MiniFamily(Family):
    """N chunks carry the timeline from a few motion frames, I chunks smooth each seam (families/mini/schedule.py);
    a few Euler flow-matching steps at low resolution, one-step latent super-resolution, a causal VAE decode."""

    name = "mini"
    needs = {Step.reference: ("vae",), Step.prompt: ("text",), Step.context: ("audio",), Step.a2v: ("dit",),
             Step.sr: ("sr",), Step.decode: ("vae",)}
    decode_batch = 8  # frames decoded at once: small enough for a quick first frame, big enough for efficient convs
    thread_count_invariant = True  # few-row float32 Linears go through layers.per_row; the convs keep their bits
    revision = 1  # 1: float32 per_row (a short chunk's, or a prompt of 5-11 words', bits changed)

    def __init__(self, config: FamilyConfig):
        self.config = config

    @property
    def components(self) -> Mapping[str, tuple[type[nn.Module], Any]]:
        return {name: (cls, getattr(self.config, name)) for name, (_, cls) in COMPONENTS.items()}

    @property
    def geometry(self) -> Geometry:
        s = self.config.image_size
        return Geometry(kinds=("N", "I"), native_size=(s, s), native_fps=None, sample_rate=self.config.audio.sample_rate)

    @property
    def parallel(self) -> ParallelPlan:
        return ParallelPlan(sharded=("dit", "text"), frame_parallel=("sr",), sequence_parallel="dit",
                            sp_wrap=SequenceParallelDiT, sp_heads=self.config.dit.heads,
                            # runtime.weights: the blocks' attention and MLP (not their modulation `ada`)
                            quantized=(("dit", ("blocks.*.attn", "blocks.*.mlp")),))

    def latent_shape(self) -> tuple[int, int, int]:
        d = self.config.dit
        return (d.latent_channels, d.latent_size, d.latent_size)

    def plan(self, chunking: Any, total_frames: int) -> list[Chunk]:
        c = chunking
        return plan(total_frames, c.frames, c.motion_frames, c.transitions, c.transition_frames)

    def check_job(self, chunking: Any, sampling: Sampling) -> None:
        pass  # every setting the job spec accepts renders (the spec checks chunking's own consistency)

    # --- once per job ----------------------------------------------------------------------------------

    def reference(self, models: Models, image: torch.Tensor, device: torch.device, dtype: torch.dtype) -> dict:
        """The reference latent at the DiT's resolution (ref_lo) and at the output's (ref_hi)."""
        vae, low = models["vae"], self.config.low_size
        x = image[None].to(device, dtype)  # (1, 3, S, S)
        x_lo = F.interpolate(x.float(), size=(low, low), mode="bilinear", antialias=True,
                             align_corners=False).to(x.dtype)  # (1, 3, S/2, S/2)
        return {"ref_lo": vae.encode(x_lo), "ref_hi": vae.encode(x)}  # (1, C, h, w), (1, C, 2h, 2w)

    def prompt(self, models: Models, prompt: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Unknown words are ignored; an empty prompt gives zero tokens. -> (1, Nt, text_dim)"""
        text = models["text"]
        ids = torch.tensor([tokenize(prompt, text.params)], dtype=torch.long, device=device)  # (1, Nt)
        if ids.shape[1] == 0:
            return torch.zeros(1, 0, text.params.dim, device=device, dtype=dtype)
        return text(ids)  # (1, Nt, text_dim)

    def prompt_overflow(self, prompt: str) -> tuple[int, int] | None:
        p = self.config.text
        n = len(tokenize(prompt, dataclasses.replace(p, max_tokens=len(prompt) + 1)))
        return (n, p.max_tokens) if n > p.max_tokens else None

    def prompt_tensors(self, out: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"text": out}  # (1, Nt, text_dim)

    def prompt_from_tensors(self, tensors: dict[str, torch.Tensor], device: torch.device,
                            dtype: torch.dtype) -> torch.Tensor:
        return tensors["text"].to(device)  # (1, Nt, text_dim), in the dtype it was encoded in

    # --- per chunk ---------------------------------------------------------------------------------------

    def audio_features(self, models: Models, audio: AudioSource, first_frame: int, num_frames: int, fps: float,
                       device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Each frame's window is centred on its own timestamp, zero-padded past both ends of the audio."""
        enc = models["audio"]
        p = enc.params
        starts = frame_window_starts(first_frame, num_frames, fps, p)  # (L,)
        lo = int(starts[0])
        samples = torch.from_numpy(audio.read(lo, int(starts[-1]) + p.window_samples))  # (span,)
        idx = (starts - lo)[:, None] + torch.arange(p.window_samples)  # (L, window)
        mel = log_mel_windows(samples[idx], p)  # (L, n_mels, mel_frames)
        return enc(mel.to(device, dtype))[None]  # (1, L, audio_dim)

    def audio_lookahead_s(self, models: Models) -> float:
        p = models["audio"].params
        return p.window_samples / 2 / p.sample_rate  # the window is centred on the frame's mid time

    def release_audio(self, models: Models, audio: AudioSource, frame: int, fps: float) -> None:
        p = models["audio"].params
        audio.release(int(frame_window_starts(max(0, frame), 1, fps, p)[0]))

    def context(self, models: Models, chunk: Chunk, audio: AudioSource, fps: float, text: torch.Tensor,
                state: RollingState, seed: int, device: torch.device, dtype: torch.dtype) -> dict:
        """Audio features for the chunk's frames, its noise, and the given frames (motion or anchors)."""
        gen = torch.Generator().manual_seed(chunk_seed(seed, chunk))
        # Noise is drawn on the CPU in float32 so it is identical on every device and rank.
        noise = torch.randn((1, chunk.length, *self.latent_shape()), generator=gen).to(device, dtype)  # (1, L, C, h, w)
        cond = torch.zeros_like(noise)  # (1, L, C, h, w)
        mask = torch.zeros(1, chunk.length, dtype=torch.bool, device=device)  # (1, L)
        if chunk.cond:
            given = state.tensors["anchors"] if chunk.kind == "I" else state.tensors["tail"][-len(chunk.cond):]
            pos = torch.tensor(chunk.cond, device=device)
            cond[0, pos] = given.to(device, dtype)
            mask[0, pos] = True
        return {"audio": self.audio_features(models, audio, chunk.start, chunk.length, fps, device, dtype),
                "text": text, "noise": noise, "cond": cond, "mask": mask}

    def denoise(self, models: Models, inputs: dict, ref: dict, sampling: Sampling, state: RollingState,
                rings: RingStore = RingStore()) -> torch.Tensor:
        """The chunk's latents (L, C, h, w), given frames included."""
        dit, c = models["dit"], inputs
        guidance = sampling.guidance

        def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            v = dit(x, t, c["mask"], c["audio"], ref["ref_lo"], ref["ref_hi"], c["text"])  # (1, L, C, h, w)
            if guidance == 1.0:
                return v
            # Unconditional: no audio and no prompt. The reference and given frames stay.
            v_u = dit(x, t, c["mask"], torch.zeros_like(c["audio"]), ref["ref_lo"], ref["ref_hi"], c["text"][:, :0])
            return v_u + guidance * (v - v_u)

        return sample(velocity, c["noise"], c["cond"], c["mask"], timesteps(sampling.steps, sampling.shift))[0]

    def keep(self, chunk: Chunk, z: torch.Tensor, state: RollingState, chunking: Any) -> None:
        """z (L, C, h, w): hold the kept frames and update the motion/anchor latents."""
        s, e = chunk.keep
        state.held.append((s, e, z[s - chunk.start:e - chunk.start]))
        if chunk.kind == "N":
            new = z[len(chunk.cond):]  # (n, C, h, w) this chunk's own frames
            a = s - (chunk.start + len(chunk.cond))  # frames the following I chunk will regenerate
            if a > 0:
                # Anchor 0: the previous N chunk's last frame; anchor 1: this chunk's first kept frame.
                state.tensors["anchors"] = torch.stack([state.tensors["tail"][-1], new[a]])  # (2, C, h, w)
            state.tensors["tail"] = new[-max(1, chunking.motion_frames):].clone()

    def refine(self, models: Models, z: torch.Tensor, ref: dict) -> torch.Tensor:
        """z_lo (T, C, h, w) -> z_hi (T, C, 2h, 2w): one step of latent super-resolution, reference in view."""
        return models["sr"](z.contiguous(memory_format=torch.channels_last), ref["ref_hi"])

    def is_decode_state(self, name: str) -> bool:
        return name == "decode_cache"

    def decode(self, models: Models, final: Final, state: RollingState,
               put: Callable[[torch.Tensor], None]) -> int:
        """final.z (T, C, H/f, W/f): one latent per frame; the decoder's causal cache is the last latent decoded."""
        vae, z = models["vae"], final.z
        cache = state.tensors.get("decode_cache")
        for i in range(0, z.shape[0], self.decode_batch):
            zb = z[i:i + self.decode_batch].contiguous(memory_format=torch.channels_last)
            x, cache = vae.decode(zb, cache)  # (t, 3, S, S) in [-1, 1]
            put(x)
        state.tensors["decode_cache"] = cache
        return z.shape[0]


