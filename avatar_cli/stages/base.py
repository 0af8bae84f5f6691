"""Stage: a typed execution unit. It declares the Modules it needs and holds no weights itself."""

import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import ClassVar

from avatar_cli.modules.module import Module
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.flops import flop_counter


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


class Stage:
    needs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, modules: Mapping[str, Module], runtime: Runtime):
        missing = [n for n in self.needs if n not in modules]
        if missing:
            raise ValueError(f"{type(self).__name__} needs modules {missing}")
        self.modules = {n: modules[n] for n in self.needs}
        self.runtime = runtime

    def model(self, name: str):
        return self.modules[name].model
