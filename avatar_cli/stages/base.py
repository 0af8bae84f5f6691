"""What the pipeline runs a family's steps with: `Steps`, the family bound to one job's models, device and rings
(each step sees only the components it declares); `Stage`, for the steps that add something of their own (the
prompt's text cache, stages/prompt.py; the decode into a Sink, stages/publish.py); and `StageTimer`.

The family's other steps (reference, context, denoise, refine) are called on the family directly, with
`Steps.models(step)`: a stage class around each would repeat the family's signature and add nothing
(docs/design.md).
"""

import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import ClassVar

from torch import nn

from avatar_cli.families.base import Family, Step
from avatar_cli.modules.module import Module
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.flops import flop_counter
from avatar_cli.runtime.rings import RingStore


class StageTimer:
    """Accumulates pure compute seconds per stage, to measure what the pipeline adds around them.

    flops: also count each stage's floating-point operations (`make bench` reports them against the
    machine's peak); the counting itself slows the stages, so their seconds are then not representative.
    """

    def __init__(self, runtime: Runtime, flops: bool = False):
        self.runtime = runtime
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops: dict[str, int] | None = defaultdict(int) if flops else None

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time a step (a families.base.Step, or another name such as the decode worker's wait) under its name."""
        name = getattr(name, "value", name)  # the plain string: compute_s's keys in the render summary
        counter = flop_counter() if self.flops is not None else nullcontext()
        start = time.perf_counter()
        try:
            with counter:
                yield
        finally:
            self.runtime.synchronize()
            self.seconds[name] += time.perf_counter() - start
            if self.flops is not None:
                self.flops[name] += counter.get_total_flops()

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


class ModelView(Mapping):
    """The models of some components, looked up at call time: placement may wrap a model (sharded, sequence
    parallel) or swap its parameters in and out after the stage was made."""

    def __init__(self, modules: Mapping[str, Module]):
        self.modules = modules

    def __getitem__(self, name: str) -> nn.Module:
        return self.modules[name].model

    def __iter__(self):
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)


class Stage:
    step: ClassVar[Step]  # the family step this stage runs

    def __init__(self, family: Family, modules: Mapping[str, Module], runtime: Runtime):
        self.needs = family.needs.get(self.step, ())
        missing = [n for n in self.needs if n not in modules]
        if missing:
            raise ValueError(f"{type(self).__name__} needs modules {missing}")
        self.family = family
        self.models = ModelView({n: modules[n] for n in self.needs})
        self.runtime = runtime


class Steps:
    """A family's reference, context, denoising and refine steps for one job on this rank (the prompt and the
    decode are stages: they add the text cache and the Sink): `models(step)` the components the step declares
    (family.needs), `needs(step)` their names, with the runtime they run on and where the denoising's rings live
    (the placement's decision). ValueError naming a step whose components are missing."""

    RUN = (Step.reference, Step.context, Step.a2v, Step.sr)

    def __init__(self, family: Family, modules: Mapping[str, Module], runtime: Runtime,
                 rings: RingStore = RingStore()):
        self.family, self.runtime, self.rings = family, runtime, rings
        self._views: dict[Step, ModelView] = {}
        for step in self.RUN:
            needs = tuple(family.needs.get(step, ()))
            missing = [n for n in needs if n not in modules]
            if missing:
                raise ValueError(f"the {step.value} step needs modules {missing}")
            self._views[step] = ModelView({n: modules[n] for n in needs})

    def models(self, step: Step) -> ModelView:
        return self._views[step]

    def needs(self, step: Step) -> tuple[str, ...]:
        return tuple(self._views[step])
