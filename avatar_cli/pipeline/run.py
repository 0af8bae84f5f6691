"""The render loop: wires the stages, owns the rolling state, runs the chunk schedule.

It reads audio from an AudioSource (media/source.py) and hands final latents to a Publisher (stages/publish.py),
which decodes them, here or in a worker process, into a Sink (media/sink.py); what it reports is in events.py.
"""

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch

from avatar_cli.families.base import Chunk, Family, RollingState, Sampling, Step
from avatar_cli.media.sink import Sink, now
from avatar_cli.media.source import AudioSource
from avatar_cli.modules.module import Module, not_loaded
from avatar_cli.pipeline.events import ChunkDone, RenderStats, ResumeFrom, Stretch
from avatar_cli.pipeline.publish import PublishStep
from avatar_cli.pipeline.steps import every_block, run_steps
from avatar_cli.prompts.cache import PromptCache
from avatar_cli.runtime.device import CoreShare, Runtime
from avatar_cli.runtime.distributed import Dist
from avatar_cli.runtime.placement import Placement
from avatar_cli.spec import JobSpec
from avatar_cli.stages.base import StageTimer, Steps
from avatar_cli.stages.publish import DecodePublish, Publisher, PublishHere, PublishThread
from avatar_cli.stages.sr import FrameSR, SRPlan
from avatar_cli.stages.prompt import PromptEncode


class Pipeline:
    def __init__(self, modules: Mapping[str, Module], family: Family, runtime: Runtime,
                 placement: Placement | None = None, count_flops: bool = False, prompts: PromptCache | None = None,
                 steps_dist: Dist | None = None, absent: Collection[str] = (),
                 sr: tuple[SRPlan, Any] | None = None):
        """prompts: the text cache's PromptCache for this model (prompts/cache.py), or None: encode.
        steps_dist: run the timestep pipeline over these ranks (pipeline/steps.py); absent: components this rank
        does not load there (a stage that would use one fails saying so). sr: frame super-resolution's plan and
        its loaded models (stages/sr.py), on the rank that writes the frames."""
        modules = {**{n: not_loaded(n) for n in absent}, **modules}
        self.steps_dist = steps_dist
        self.family = family
        self.count_flops = count_flops  # `make bench`: FLOPs per stage, against the machine's peak
        self.runtime = runtime
        self.placement = placement or Placement()
        # The family's steps on this job's models, with the rings where the placement keeps them; the two steps
        # that add something of their own (the text cache, the decode into a Sink) are stages.
        self.steps = Steps(family, modules, runtime, self.placement.rings)
        self.prompt = PromptEncode(family, modules, runtime, prompts)
        self.publish = DecodePublish(family, modules, runtime)
        self.sr = sr

    def publish_to(self, sink: Sink | None, size: tuple[int, int]) -> PublishHere:
        """The inline Publisher: this pipeline's decode into `sink` at `size` (width, height), through frame
        super-resolution when the job has it (a stream of its own for each render); None: a rank that writes
        nothing."""
        sr = None
        if self.sr is not None and sink is not None:
            plan, models = self.sr
            sr = FrameSR(models, plan, self.runtime.device, self.runtime.dtype)
        return PublishHere(self.publish, sink, size, sr)

    def publish_on_thread(self, sink: Sink, size: tuple[int, int],
                          resume_at: Callable[[int], bool] = lambda block: True) -> PublishThread:
        """runtime.decode: thread: this pipeline's refine and decode on a thread of their own, into `sink`. The loop's
        steps (context and audio-to-video) share the CPU threads with it (runtime/device.py CoreShare: one fewer for
        the loop while the thread works, checked before each block of the loop's models)."""
        cores = CoreShare(torch.get_num_threads(),
                          [m for step in (Step.context, Step.a2v) for m in self.steps.models(step).values()])
        return PublishThread(self.publish, sink, size, cores, resume_at)

    def schedule(self, spec: JobSpec, total_frames: int) -> list[Chunk]:
        """The chunk plan. spec.chunking.transitions is a bool: job.resolve resolved `auto` (a plan refuses it)."""
        return self.family.plan(spec.chunking, total_frames)

    @torch.no_grad()  # not inference_mode: FSDP2 (multi-GPU) breaks under it in torch 2.14
    def run(self, spec: JobSpec, image: torch.Tensor, audio: AudioSource, total_frames: int, out: Publisher,
            on_chunk: Callable[[ChunkDone], None] = lambda _: None,
            on_stretch: Callable[[Stretch], None] = lambda _: None, resume: ResumeFrom | None = None,
            chunks: Iterable[Chunk] | None = None, copies: Callable[[int], bool] | None = None) -> RenderStats:
        """image (3, H, W) in [-1, 1] at the family's native size.

        out: where final latents go. `publish_to(sink, size)` decodes them here into a Sink (sink None: a rank
        other than 0 under torchrun, which writes nothing; it runs every stage whose work the ranks share or split,
        and skips the VAE decode); a DecodeWorker (runtime.decode=worker) decodes and writes each published stretch
        in its own process while this loop goes on with the next chunk.

        With `resume`, the schedule continues at `resume.next_chunk` from the saved rolling state. `chunks`: the
        plan to run instead of the schedule of `total_frames` (a live session's plan, which grows as its audio
        arrives: pipeline/live.py). copies: under the timestep pipeline, the blocks after which the decode rank gets
        the step ranks' rings for a resume point (default: every block; a live session, which never resumes: none).
        """
        try:
            return self._run(spec, image, audio, total_frames, out, on_chunk, on_stretch, resume, chunks, copies)
        finally:
            self.placement.release()  # the next chunk's prefetched model, or a stage an error left open

    def _run(self, spec: JobSpec, image: torch.Tensor, audio: AudioSource, total_frames: int, out: Publisher,
             on_chunk: Callable[[ChunkDone], None], on_stretch: Callable[[Stretch], None],
             resume: ResumeFrom | None, chunks: Iterable[Chunk] | None,
             copies: Callable[[int], bool] | None) -> RenderStats:
        t0 = now()
        timer = StageTimer(self.runtime, flops=self.count_flops)
        fps, s = spec.video.fps, spec.sampling
        sampling = Sampling(s.steps, s.guidance, s.shift)
        if chunks is None:
            chunks = self.schedule(spec, total_frames)
        if self.steps_dist is not None:
            return run_steps(self.steps, self.prompt, self.placement, self.steps_dist, spec, image, audio, chunks,
                             out, on_chunk, on_stretch, resume, timer, t0, copies or every_block)
        family, steps, (device, dtype) = self.family, self.steps, (self.runtime.device, self.runtime.dtype)
        models, needs = steps.models, steps.needs
        first = resume.next_chunk if resume else 0
        state = resume.state if resume else RollingState()
        if resume and first < len(chunks):
            family.release_audio(models(Step.context), audio, chunks[first].start - 1, fps)

        # Each stage brings its components onto the device and drops them after; `then` starts copying the next
        # stage's in while this one computes (with offload; otherwise these are no-ops).
        stage = self.placement.stage
        # 1. Reference and prompt conditioning: computed once, kept for the whole job.
        prompt_needs = self.prompt.needs_for(spec.prompt)  # none when the prompt's encoding is cached
        with timer(Step.reference), stage(needs(Step.reference), then=prompt_needs):
            ref = family.reference(models(Step.reference), image, device, dtype)
        with timer(Step.prompt), stage(prompt_needs, then=needs(Step.context)):
            text = self.prompt.run(spec.prompt)

        publish = PublishStep(steps, out, ref, self.placement, timer, on_chunk, on_stretch, t0,
                              after=needs(Step.context))
        for i, chunk in enumerate(chunks):
            if i < first:
                continue  # resumed after it
            # 2. Context: audio features for the chunk's frames, noise, and the given frames.
            with timer(Step.context), stage(needs(Step.context), then=needs(Step.a2v)):
                inputs = family.context(models(Step.context), chunk, audio, fps, text, state, spec.seed, device, dtype)
                # Later chunks start at most one frame before this one (an I chunk's first anchor).
                family.release_audio(models(Step.context), audio, chunk.start - 1, fps)
            # 3. Audio-to-video: sample the chunk's latents (a family's denoising may keep caches in `state`).
            publishes = chunk.publish_to > state.published  # then super-resolution runs next
            with timer(Step.a2v), stage(needs(Step.a2v), then=needs(Step.sr) if publishes else needs(Step.context)):
                z = family.denoise(models(Step.a2v), inputs, ref, sampling, state, rings=steps.rings)
            family.keep(chunk, z, state, spec.chunking)
            # 4. Publish what no later chunk can change: refine, decode, hand to the Sink (pipeline/publish.py).
            publish(chunk, i + 1, state)
        return publish.finish(state)
