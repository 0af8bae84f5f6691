"""The publish step (pipeline/publish.py) that the loop and the timestep pipeline's decode rank share: the reference
reaches super-resolution, the refined latents reach the Publisher, stretches and chunks are reported, and a stretch
published where no rings were copied says it cannot be resumed from."""

import torch

from avatar_cli.families.base import Chunk, RollingState, Step
from avatar_cli.pipeline.events import Stretch
from avatar_cli.pipeline.publish import PublishStep
from avatar_cli.runtime.placement import Placement
from avatar_cli.stages.base import StageTimer


class _Runtime:
    def synchronize(self) -> None:
        pass


class _SR:
    """The family's steps as PublishStep sees them (stages/base.py Steps): its refine step needs "sr"."""

    def __init__(self):
        self.refs = []
        self.family = self

    def needs(self, step: Step) -> tuple[str, ...]:
        return ("sr",) if step == Step.sr else ()

    def models(self, step: Step) -> dict:
        return {}

    def refine(self, models, z, ref):
        self.refs.append(ref)
        return z * 2  # "refined"


class _Out:
    """A Publisher that decodes in this process ("vae"), one stretch per publish, and one more frame held back until
    the end."""

    needs = ("vae",)
    refines = False
    held = 1

    def __init__(self):
        self.first_put, self.seconds, self.got = None, {"decode_wait": 1.5}, []

    def publish(self, final, next_chunk, state):
        self.got.append(final)
        state.published = final.end
        self.first_put = self.first_put or 10.0
        return [Stretch(next_chunk, final.start, final.end, "d", state)]

    def finish(self, state):
        state.published = 9
        return [Stretch(9, 8, 9, "late", state)]


def _chunk(index: int, publish_to: int) -> Chunk:
    return Chunk("N", index, 0, publish_to, (), (0, publish_to), publish_to)


def test_the_reference_reaches_super_resolution_and_stretches_are_reported():
    sr, out, ref = _SR(), _Out(), {"ref_hi": torch.ones(1)}
    stretches, done = [], []
    publish = PublishStep(sr, out, ref, Placement(), StageTimer(_Runtime()), done.append, stretches.append, t0=4.0)
    state = RollingState()
    state.held.append((0, 4, torch.ones(4, 2)))
    publish(_chunk(0, 4), 1, state)
    publish(_chunk(1, 6), 2, state)  # holds nothing that ends by frame 6: nothing published, the chunk reported
    state.held.append((4, 8, torch.ones(4, 2)))
    publish(_chunk(2, 8), 3, state, resumable=False)
    stats = publish.finish(state)

    assert sr.refs == [ref, ref]
    assert [(f.start, f.end) for f in out.got] == [(0, 4), (4, 8)] and torch.equal(out.got[0].z, torch.full((4, 2), 2.))
    assert [(s.start, s.end, s.resumable) for s in stretches] == [(0, 4, True), (4, 8, False), (8, 9, True)]
    assert [(d.chunk.index, d.published, d.held) for d in done] == [(0, 4, 1), (1, 4, 1), (2, 8, 1)]
    assert stats.frames == 9 and stats.ttff_s == 6.0  # the frame held back to the end counts
    assert stats.compute_s["decode_wait"] == 1.5 and {"sr", "decode"} <= set(stats.compute_s)


class _RefiningOut(_Out):
    """A Publisher that runs the refine step itself (stages/publish.py PublishThread), where it decodes."""

    needs, refines = (), True

    def publish(self, final, next_chunk, state, refine=None):
        final.z = refine(final.z)
        return super().publish(final, next_chunk, state)


def test_a_publisher_that_refines_gets_the_latents_before_it_and_the_refine_with_the_reference():
    sr, out, ref = _SR(), _RefiningOut(), {"ref_hi": torch.ones(1)}
    stretches = []
    timer = StageTimer(_Runtime())
    publish = PublishStep(sr, out, ref, Placement(), timer, lambda _: None, stretches.append, t0=4.0)
    state = RollingState()
    state.held.append((0, 4, torch.ones(4, 2)))
    publish(_chunk(0, 4), 1, state)
    assert sr.refs == [ref] and torch.equal(out.got[0].z, torch.full((4, 2), 2.))  # refined once, by the publisher
    assert "sr" not in timer.seconds  # the loop did not time a refine it did not run
    assert [(s.start, s.end) for s in stretches] == [(0, 4)]
