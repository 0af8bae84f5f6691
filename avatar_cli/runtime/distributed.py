"""Process-group setup for torchrun: who am I, who leads, and failing fast instead of hanging.

Without torchrun (no WORLD_SIZE in the environment) nothing here touches torch.distributed: the
`Dist` for one process answers every question locally, so the single-process path has no
distributed calls at all.
"""

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

log = logging.getLogger(__name__)
T = TypeVar("T")

# A dead or stuck rank must end every rank within 60 s (docs/multi-gpu.md). Collectives time out after
# this many seconds; NCCL's watchdog then aborts the process, gloo raises. Leaves headroom for teardown.
DEFAULT_TIMEOUT_S = 30.0
TIMEOUT_ENV = "AVATAR_DIST_TIMEOUT_S"


def launched_by_torchrun() -> bool:
    """torchrun (and any compatible launcher) sets these for every worker."""
    return all(k in os.environ for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")) and int(os.environ["WORLD_SIZE"]) > 1


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mesh: DeviceMesh | None = None  # 1-D mesh over all ranks; None for one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group() if self.mesh is not None else None

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Every rank gets rank `src`'s `obj` (picklable). One process: returned as is."""
        if not self.enabled:
            return obj
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def agree(self, value: T, what: str) -> T:
        """Check that every rank computed the same `value` (e.g. the frame count); raise naming `what`.

        Returns rank 0's value. A disagreement means the ranks would run different schedules and
        deadlock in mismatched collectives, so it is an error rather than silently using rank 0's.
        """
        if not self.enabled:
            return value
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        if any(v != values[0] for v in values):
            raise RuntimeError(f"ranks disagree on {what}: {values}")
        return values[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)

    def destroy(self) -> None:
        """Meet every rank once more, then tear the process group down (after a run that succeeded).

        Without the barrier a rank that gets here first closes its connections while a peer is still
        finishing, and gloo can abort that peer in its teardown ("terminate called without an active
        exception", SIGABRT): 2 of 15 runs of the 2-rank equivalence script did, 1 of 18 with it (the rest
        happens at interpreter exit, which torchrun workers skip: see `avatar_cli.cli.main`).
        """
        if self.enabled and dist.is_initialized():
            dist.barrier(group=self.group)
            dist.destroy_process_group()


def collective_timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def init_distributed(device_type: str) -> Dist:
    """Join torchrun's process group: gloo on CPU, NCCL on CUDA (bound to this rank's GPU).

    Must run before any CUDA allocation on the wrong device: on CUDA it selects `cuda:LOCAL_RANK`.
    """
    if not launched_by_torchrun():
        return Dist()
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    timeout = timedelta(seconds=collective_timeout_s())
    if device_type == "cuda":
        # Abort the communicator (and the process) when a collective times out, rather than hang.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    log.info("distributed: rank %d of %d (local %d), %s, collective timeout %.0f s",
             rank, world, local, dist.get_backend(), timeout.total_seconds())
    return Dist(rank=rank, world_size=world, local_rank=local, mesh=mesh)


_CURRENT: Dist | None = None


def current_dist(device_type: str) -> Dist:
    """The process group of this process, joined on first use (one per process, shared by a batch's jobs)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = init_distributed(device_type)
    return _CURRENT


def shutdown_distributed() -> None:
    """After a run every rank finished: `Dist.destroy` (barrier, then teardown); NCCL also warns without it.

    Not called on failure: the other ranks may be gone, and the collective timeout ends them instead.
    """
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.destroy()
    _CURRENT = None
