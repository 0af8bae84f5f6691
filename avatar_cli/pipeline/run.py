"""The render loop: wires the stages, owns the rolling state, runs the chunk schedule."""

import hashlib
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from avatar_cli.families.base import AudioSource, Chunk, Family, Final, RollingState, Sampling
from avatar_cli.modules.module import Module, not_loaded
from avatar_cli.pipeline.schedule import choose_transitions
from avatar_cli.pipeline.steps import run_steps
from avatar_cli.runtime.distributed import Dist
from avatar_cli.pipeline.decode_worker import DecodeWorker
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.placement import Placement
from avatar_cli.spec import JobSpec
from avatar_cli.stages.a2v import AudioToVideo
from avatar_cli.stages.base import StageTimer
from avatar_cli.stages.context import ContextGen, PromptEncode
from avatar_cli.stages.publish import DecodePublish, FrameSink
from avatar_cli.stages.reference import ReferenceEncode
from avatar_cli.stages.sr import SuperResolve

if TYPE_CHECKING:
    from avatar_cli.pipeline.text_cache import PromptCache


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
    def __init__(self, modules: Mapping[str, Module], family: Family, runtime: Runtime,
                 placement: Placement | None = None, count_flops: bool = False, prompts: "PromptCache | None" = None,
                 steps_dist: Dist | None = None, absent: Collection[str] = ()):
        """prompts: the text cache's PromptCache for this model (pipeline/text_cache.py), or None: encode.
        steps_dist: run the timestep pipeline over these ranks (pipeline/steps.py); absent: components this rank
        does not load there (a stage that would use one fails saying so)."""
        modules = {**{n: not_loaded(n) for n in absent}, **modules}
        self.steps_dist = steps_dist
        self.family = family
        self.count_flops = count_flops  # `make bench`: FLOPs per stage, against the machine's peak
        self.runtime = runtime
        self.placement = placement or Placement()
        self.reference = ReferenceEncode(family, modules, runtime)
        self.prompt = PromptEncode(family, modules, runtime, prompts)
        self.context = ContextGen(family, modules, runtime)
        self.a2v = AudioToVideo(family, modules, runtime)
        self.sr = SuperResolve(family, modules, runtime)
        self.publish = DecodePublish(family, modules, runtime)

    def schedule(self, spec: JobSpec, total_frames: int) -> list[Chunk]:
        c = spec.chunking  # runner.render resolved `auto` already; the bench and tests may call this directly
        on, _ = choose_transitions(c.transitions, self.family.geometry.kinds, self.runtime.device.type)
        return self.family.plan(c if on is c.transitions else replace(c, transitions=on), total_frames)

    @torch.no_grad()  # not inference_mode: FSDP2 (multi-GPU) breaks under it in torch 2.14
    def run(self, spec: JobSpec, image: torch.Tensor, audio: AudioSource, total_frames: int, sink: FrameSink | None,
            size: tuple[int, int], on_chunk: Callable[[ChunkDone], None] = lambda _: None,
            on_stretch: Callable[[Stretch], None] = lambda _: None, resume: ResumeFrom | None = None) -> RenderStats:
        """image (3, H, W) in [-1, 1] at the family's native size; size (width, height) of the output frames.

        sink None: a rank other than 0 under torchrun, which writes nothing; it runs every stage whose
        work the ranks share or split, and skips the VAE decode. sink a DecodeWorker (runtime.decode=worker): the
        worker process decodes and writes each published stretch while this loop goes on with the next chunk.

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
        sampling = Sampling(s.steps, s.guidance, s.shift)
        chunks = self.schedule(spec, total_frames)
        if self.steps_dist is not None:
            return run_steps(self, self.steps_dist, spec, image, audio, chunks, sink, size, on_chunk, on_stretch,
                             resume, timer, t0)
        worker = sink if isinstance(sink, DecodeWorker) else None  # runtime.decode=worker: decodes and writes
        first = resume.next_chunk if resume else 0
        state = resume.state if resume else RollingState()
        if first < len(chunks):
            self.context.release_before(audio, chunks[first].start - 1, fps)

        # Each stage brings its components onto the device and drops them after; `then` starts copying the next
        # stage's in while this one computes (with offload; otherwise these are no-ops).
        stage = self.placement.stage
        # 1. Reference and prompt conditioning: computed once, kept for the whole job.
        prompt_needs = self.prompt.needs_for(spec.prompt)  # none when the prompt's encoding is cached
        with timer("reference"), stage(self.reference.needs, then=prompt_needs):
            ref = self.reference.run(image)
        with timer("context"), stage(prompt_needs, then=self.context.needs):
            text = self.prompt.run(spec.prompt)

        for i in range(first, len(chunks)):
            chunk = chunks[i]
            # 2. Context: audio features for the chunk's frames, noise, and the given frames.
            with timer("context"), stage(self.context.needs, then=self.a2v.needs):
                inputs = self.context.run(chunk, audio, fps, text, state, spec.seed)
                # Later chunks start at most one frame before this one (an I chunk's first anchor).
                self.context.release_before(audio, chunk.start - 1, fps)
            # 3. Audio-to-video: sample the chunk's latents.
            publishes = chunk.publish_to > state.published  # then super-resolution runs next
            with timer("a2v"), stage(self.a2v.needs, then=self.sr.needs if publishes else self.context.needs):
                z = self.a2v.run(inputs, ref, sampling, state)
            self.family.keep(chunk, z, state, spec.chunking)

            # 4. Publish what no later chunk can change: refine, decode, hand to the encoder.
            final = state.take_final(chunk.publish_to)
            if final is not None:
                # A rank that writes nothing skips the decode (its frames would be thrown away), unless the family
                # conditions later chunks on decoded frames: then every rank decodes, and only rank 0 keeps them.
                # With a decode worker the worker decodes (the family does not feed back there).
                decodes = (sink is not None and worker is None) or self.family.decode_feeds_back
                after_sr = self.publish.needs if decodes else self.context.needs
                with timer("sr"), stage(self.sr.needs, then=after_sr):
                    final = Final(final.start, final.end, self.sr.run(final.z, ref))
                if worker is not None:
                    # Handed over; its resume point is saved once the worker has written it (acknowledged).
                    state.published += final.frames
                    for a in worker.submit(final, i + 1, state):
                        on_stretch(Stretch(a.next_chunk, a.start, a.end, a.digest, a.state))
                    on_chunk(ChunkDone(chunk, time.perf_counter() - t0, state.published))
                    continue
                hashing = HashingSink(sink) if sink is not None else None
                if not decodes:
                    n = final.frames
                else:
                    with timer("decode"), stage(self.publish.needs, then=self.context.needs):
                        n = self.publish.run(final, state, hashing, size)
                state.published += n
                if ttff is None:
                    ttff = time.perf_counter() - t0
                digest = (hashing.hash if hashing is not None else hashlib.sha256()).hexdigest()
                on_stretch(Stretch(i + 1, state.published - n, state.published, digest, state))
            on_chunk(ChunkDone(chunk, time.perf_counter() - t0, state.published))

        if worker is not None:
            for a in worker.drain():
                on_stretch(Stretch(a.next_chunk, a.start, a.end, a.digest, a.state))
            if worker.first_put is not None:
                ttff = worker.first_put - t0  # perf_counter is system-wide (CLOCK_MONOTONIC): the worker's is ours
            # The worker's decode seconds (overlapping the chunks after), and the seconds this loop waited on it.
            timer.seconds["decode"] += worker.decode_s
            timer.seconds["decode_wait"] += worker.wait_s
        return RenderStats(frames=state.published, wall_s=time.perf_counter() - t0,
                           ttff_s=ttff if ttff is not None else 0.0, compute_s=dict(timer.seconds),
                           flops=dict(timer.flops) if timer.flops is not None else None)
