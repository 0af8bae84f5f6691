"""Stage: a typed execution unit. It declares the Modules it needs and holds no weights itself."""

import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import ClassVar

from avatar_cli.modules.module import Module
from avatar_cli.runtime.device import Runtime


class StageTimer:
    """Accumulates pure compute seconds per stage, to measure what the pipeline adds around them."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.runtime.synchronize()
            self.seconds[name] += time.perf_counter() - start

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
