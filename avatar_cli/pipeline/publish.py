"""Step 4 of the chunk loop: refine what no later chunk can change, decode it, hand it to the Publisher, report.

The loop (pipeline/run.py) and the timestep pipeline's decode rank (pipeline/steps.py) both publish through one
PublishStep, so what happens to the latents they publish (super-resolution with the reference in view, the decode,
the stretches, the chunk's report) is one piece of code and cannot differ between the two.
"""

from collections.abc import Callable, Collection
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from avatar_cli.media.sink import now
from avatar_cli.families.base import Chunk, Final, RollingState, Step
from avatar_cli.pipeline.events import ChunkDone, RenderStats, Stretch
from avatar_cli.runtime.placement import Placement
from avatar_cli.stages.base import StageTimer, Steps
from avatar_cli.stages.publish import Publisher


@dataclass
class PublishStep:
    """One job's publishing: the family's refine step (`steps`) refines with the reference conditioning `ref` (as
    its reference step made it), `out` decodes and publishes; `after`: the components of the stage this rank runs next, whose copy in starts
    while the decode computes. t0: the render's start on the frame clock (media/sink.py `now()`)."""

    steps: Steps
    out: Publisher
    ref: Any
    placement: Placement
    timer: StageTimer
    on_chunk: Callable[[ChunkDone], None]
    on_stretch: Callable[[Stretch], None]
    t0: float
    after: Collection[str] = ()

    def __call__(self, chunk: Chunk, next_chunk: int, state: RollingState, resumable: bool = True) -> None:
        """After `chunk` (the schedule's next_chunk - 1) was kept in `state`: publish what it settled (if any)
        and report it done. resumable False: the stretches' state is not whole (Stretch.resumable)."""
        stage, timer, out = self.placement.stage, self.timer, self.out
        final = state.take_final(chunk.publish_to)
        if final is not None:
            if out.refines:  # it refines them where it decodes them (its `seconds` say how long)
                stretches = out.publish(final, next_chunk, state, refine=self.refine)
            else:
                steps = self.steps
                with timer(Step.sr), stage(steps.needs(Step.sr), then=out.needs or self.after):
                    final = Final(final.start, final.end, self.refine(final.z))
                # A rank that writes nothing skips the decode (its frames would be thrown away), unless the family
                # conditions later chunks on decoded frames: then every rank decodes, and only rank 0 keeps them. A
                # decode worker decodes in its own process and hands back each stretch once written.
                with ExitStack() as here:
                    if out.needs:  # the decode runs in this process
                        here.enter_context(timer(Step.decode))
                        here.enter_context(stage(out.needs, then=self.after))
                    stretches = out.publish(final, next_chunk, state)
            for stretch in stretches:
                self.on_stretch(stretch if resumable else replace(stretch, resumable=False))
        self.on_chunk(ChunkDone(chunk, now() - self.t0, state.published, self.out.held))

    def refine(self, z: torch.Tensor) -> torch.Tensor:
        """The family's refine step on final latents, with this job's reference in view."""
        return self.steps.family.refine(self.steps.models(Step.sr), z, self.ref)

    def finish(self, state: RollingState) -> RenderStats:
        """Wait for the stretches in flight, put what is held back into the Sink, report them; the render's stats,
        `state.published` frames published (every frame the schedule made)."""
        # Frame super-resolution's last frames: timed with the decode it follows, where that runs here.
        with self.timer(Step.decode) if self.out.needs else nullcontext():
            stretches = self.out.finish(state)
        for stretch in stretches:
            self.on_stretch(stretch)
        frames = state.published
        for step, seconds in self.out.seconds.items():  # a decode worker's own compute
            self.timer.seconds[step] += seconds
        # now() is system-wide (CLOCK_MONOTONIC): a worker process's first_put is on this clock too.
        first = self.out.first_put
        return RenderStats(frames=frames, wall_s=now() - self.t0,
                           ttff_s=first - self.t0 if first is not None else 0.0, compute_s=dict(self.timer.seconds),
                           flops=dict(self.timer.flops) if self.timer.flops is not None else None)
