"""Where each model lives while a job runs, applied from outside the models.

- Several ranks (torchrun): the DiT and the text encoder are FSDP2-sharded per block, and the DiT runs
  Ulysses sequence parallel; the small models (VAE, SR, audio encoder) are replicated.
- One GPU: `runtime.offload` (auto | none | model | block). Idle models wait in pinned host memory;
  a stage's model comes onto the GPU when the stage starts (block by block, double-buffered, for
  "block") and is dropped by pointer swap when it ends.
- CPU: everything stays where it is.
"""

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from avatar_cli.modules.module import Module
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.distributed import Dist
from avatar_cli.runtime.offload import BlockOffloader, CudaTransfer, ModelOffloader, choose_offload, model_bytes
from avatar_cli.runtime.parallelize import gpu_param_dtype, parallelize_model, reshard_stage
from avatar_cli.runtime.sequence_parallel import SequenceParallelDiT

log = logging.getLogger(__name__)
SHARDED = ("dit", "text")  # the transformer models; the rest are small and replicated


@dataclass
class Placement:
    offloaders: dict[str, BlockOffloader | ModelOffloader] = field(default_factory=dict)
    sharded: dict[str, torch.nn.Module] = field(default_factory=dict)
    reshard_per_stage: bool = False
    offload: str = "none"

    @contextlib.contextmanager
    def stage(self, *names: str) -> Iterator[None]:
        """Bring the stage's models in for its duration; afterwards drop them (offload) or reshard (FSDP)."""
        for name in names:
            if name in self.offloaders:
                self.offloaders[name].begin()
        try:
            yield
        finally:
            for name in names:
                if name in self.offloaders:
                    self.offloaders[name].end()
                if self.reshard_per_stage and name in self.sharded:
                    reshard_stage(self.sharded[name])


def place(modules: Mapping[str, Module], runtime: Runtime, dist: Dist, offload: str = "auto",
          reshard: str = "per_block", working_bytes: int = 2 << 30) -> Placement:
    if dist.enabled:
        for module in modules.values():
            module.to(runtime.device, runtime.dtype)
        placement = Placement(reshard_per_stage=reshard == "per_stage")
        param_dtype = gpu_param_dtype(runtime.device.type)
        for name in SHARDED:
            model = parallelize_model(modules[name].model, dist.mesh, reshard=reshard, param_dtype=param_dtype)
            placement.sharded[name] = model
        modules["dit"].model = SequenceParallelDiT(modules["dit"].model, dist.group)
        log.info("placement: %s sharded over %d ranks (reshard %s); DiT sequence parallel", ", ".join(SHARDED),
                 dist.world_size, reshard)
        return placement
    if not runtime.is_cuda:
        for module in modules.values():
            module.to(runtime.device, runtime.dtype)
        return Placement()

    for module in modules.values():
        module.to("cpu", runtime.dtype)
    sizes = {name: model_bytes(m.model) for name, m in modules.items()}
    choice = choose_offload(offload, torch.cuda.mem_get_info(runtime.device)[0], sizes, working_bytes)
    placement = Placement(offload=choice)
    if choice == "none":
        for module in modules.values():
            module.to(runtime.device)
        return placement
    transfer = CudaTransfer(runtime.device)
    for name, module in modules.items():
        if choice == "block" and hasattr(module.model, "blocks"):
            placement.offloaders[name] = BlockOffloader(module.model, transfer)
        else:
            placement.offloaders[name] = ModelOffloader(module.model, transfer)
    return placement
