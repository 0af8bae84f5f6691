"""The render loop: wires the stages, owns the rolling state, runs the chunk schedule."""

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from avatar_cli.families.mini.config import FamilyConfig
from avatar_cli.modules.module import Module
from avatar_cli.pipeline.schedule import Chunk, plan_job
from avatar_cli.pipeline.state import RollingState
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.placement import Placement
from avatar_cli.spec import JobSpec
from avatar_cli.stages.a2v import AudioToVideo
from avatar_cli.stages.base import StageTimer
from avatar_cli.stages.context import AudioSource, ContextGen
from avatar_cli.stages.publish import DecodePublish, FrameSink
from avatar_cli.stages.reference import ReferenceEncode
from avatar_cli.stages.sr import SuperResolve


@dataclass
class ChunkDone:
    chunk: Chunk
    elapsed_s: float  # since the render started
    published: int  # frames handed to the encoder so far


@dataclass
class Stretch:
    """A published stretch of the timeline: frames [start, end) and the sha256 of their uint8 pixels."""

    next_chunk: int  # schedule index of the first chunk still to run
    start: int
    end: int
    digest: str
    state: RollingState  # the rolling state at this point: enough to resume from here


@dataclass
class ResumeFrom:
    next_chunk: int
    state: RollingState


class HashingSink:
    """Passes frames through to the encoder while hashing them, to prove a resumed render bit-identical."""

    def __init__(self, sink: FrameSink):
        self.sink = sink
        self.hash = hashlib.sha256()

    def put(self, frames: np.ndarray) -> None:
        self.hash.update(np.ascontiguousarray(frames).tobytes())
        self.sink.put(frames)


@dataclass
class RenderStats:
    frames: int
    wall_s: float  # render start (models loaded) to the last frame published
    ttff_s: float  # render start to the first frame handed to the encoder
    compute_s: dict[str, float] = field(default_factory=dict)
    flops: dict[str, int] | None = None  # per stage, when the pipeline counts them (count_flops)


class Pipeline:
    def __init__(self, modules: Mapping[str, Module], config: FamilyConfig, runtime: Runtime,
                 placement: Placement | None = None, count_flops: bool = False):
        self.config = config
        self.count_flops = count_flops  # `make bench`: FLOPs per stage, against the machine's peak
        self.runtime = runtime
        self.placement = placement or Placement()
        self.reference = ReferenceEncode(modules, runtime)
        self.context = ContextGen(modules, runtime)
        self.a2v = AudioToVideo(modules, runtime)
        self.sr = SuperResolve(modules, runtime)
        self.publish = DecodePublish(modules, runtime)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        d = self.config.dit
        return (d.latent_channels, d.latent_size, d.latent_size)

    def schedule(self, spec: JobSpec, total_frames: int) -> list[Chunk]:
        return plan_job(spec.chunking, total_frames)

    @torch.no_grad()  # not inference_mode: FSDP2 (multi-GPU) breaks under it in torch 2.14
    def run(self, spec: JobSpec, image: torch.Tensor, audio: AudioSource, total_frames: int, sink: FrameSink | None,
            size: tuple[int, int], on_chunk: Callable[[ChunkDone], None] = lambda _: None,
            on_stretch: Callable[[Stretch], None] = lambda _: None, resume: ResumeFrom | None = None) -> RenderStats:
        """image (3, S, S) in [-1, 1] at the native size; size (width, height) of the output frames.

        sink None: a rank other than 0 under torchrun, which writes nothing; it runs every stage whose
        work the ranks share or split, and skips the VAE decode.

        With `resume`, the schedule continues at `resume.next_chunk` from the saved rolling state.
        """
        try:
            return self._run(spec, image, audio, total_frames, sink, size, on_chunk, on_stretch, resume)
        finally:
            self.placement.release()  # the next chunk's prefetched model, or a stage an error left open

    def _run(self, spec: JobSpec, image: torch.Tensor, audio: AudioSource, total_frames: int, sink: FrameSink | None,
             size: tuple[int, int], on_chunk: Callable[[ChunkDone], None], on_stretch: Callable[[Stretch], None],
             resume: ResumeFrom | None) -> RenderStats:
        t0 = time.perf_counter()
        timer = StageTimer(self.runtime, flops=self.count_flops)
        ttff: float | None = None
        fps, s = spec.video.fps, spec.sampling
        chunks = self.schedule(spec, total_frames)
        first = resume.next_chunk if resume else 0
        state = resume.state if resume else RollingState()
        if first < len(chunks):
            self.context.release_before(audio, chunks[first].start - 1, fps)

        # 1. Reference and prompt conditioning: computed once, kept for the whole job.
        # Each stage brings its model onto the device and drops it after; `then` starts copying the next
        # stage's model in while this one computes (with offload; otherwise these are no-ops).
        stage = self.placement.stage
        with timer("reference"), stage("vae", then="text"):
            ref = self.reference.run(image, self.config.low_size)
        with timer("context"), stage("text", then="audio"):
            text = self.context.encode_prompt(spec.prompt)

        for i in range(first, len(chunks)):
            chunk = chunks[i]
            # 2. Context: audio features for the chunk's frames, noise, and the given frames.
            given = self._given(chunk, state)
            with timer("context"), stage("audio", then="dit"):
                ctx = self.context.run(chunk, audio, fps, text, given, spec.seed, self.latent_shape)
                # Later chunks start at most one frame before this one (an I chunk's first anchor).
                self.context.release_before(audio, chunk.start - 1, fps)
            # 3. Audio-to-video: sample the chunk's low-resolution latents.
            publishes = chunk.publish_to > state.published  # then super-resolution runs next
            with timer("a2v"), stage("dit", then="sr" if publishes else "audio"):
                z = self.a2v.run(ctx, ref, s.steps, s.guidance, s.shift)  # (L, C, h, w)
            self._keep(chunk, z, state, keep_tail=max(1, spec.chunking.motion_frames))

            # 4. Publish what no later chunk can change: super-resolve, decode, hand to the encoder.
            final = state.take_final(chunk.publish_to)
            if final is not None:
                with timer("sr"), stage("sr", then="vae" if sink is not None else "audio"):
                    z_hi = self.sr.run(final, ref)
                hashing = HashingSink(sink)
                if sink is None:  # a rank that writes nothing: its frames would be thrown away
                    n = z_hi.shape[0]
                else:
                    with timer("decode"), stage("vae", then="audio"):
                        state.decode_cache, n = self.publish.run(z_hi, state.decode_cache, hashing, size)
                state.published += n
                if ttff is None:
                    ttff = time.perf_counter() - t0
                on_stretch(Stretch(i + 1, state.published - n, state.published, hashing.hash.hexdigest(), state))
            on_chunk(ChunkDone(chunk, time.perf_counter() - t0, state.published))

        return RenderStats(frames=state.published, wall_s=time.perf_counter() - t0,
                           ttff_s=ttff if ttff is not None else 0.0, compute_s=dict(timer.seconds),
                           flops=dict(timer.flops) if timer.flops is not None else None)

    def _given(self, chunk: Chunk, state: RollingState) -> torch.Tensor:
        if chunk.kind == "I":
            return state.anchors
        m = len(chunk.cond)
        return state.tail[-m:] if m else torch.zeros(0, *self.latent_shape)

    def _keep(self, chunk: Chunk, z: torch.Tensor, state: RollingState, keep_tail: int) -> None:
        """z (L, C, h, w): hold the kept frames and update the motion/anchor tensors."""
        s, e = chunk.keep
        state.held.append((s, z[s - chunk.start:e - chunk.start]))
        if chunk.kind == "N":
            new = z[len(chunk.cond):]  # (n, C, h, w) this chunk's own frames
            a = s - (chunk.start + len(chunk.cond))  # frames the following I chunk will regenerate
            if a > 0:
                # Anchor 0: the previous N chunk's last frame; anchor 1: this chunk's first kept frame.
                state.anchors = torch.stack([state.tail[-1], new[a]])  # (2, C, h, w)
            state.tail = new[-keep_tail:].clone()
