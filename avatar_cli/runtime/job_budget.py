"""One job's budget and the decisions taken from it, shared by a render and by `avatar plan`: the family's budget
for the job's settings (`job_budget`), the working set a render keeps free on one rank (`render_working_bytes`),
where the rings wait (`render_rings`), and whether auto's decode worker can hold the job's super-resolution
(`sr_decode`). Both callers hand the same kind of input, so on the planned machine a
render makes the planned choice.

The job is duck-typed here (a loaded job and its model source, or a resolved job: job.py), so that this layer
imports nothing above it: `runtime.*` settings are read by their values, `runtime.parallel` resolved as a str
(single | sequence | steps), and the family's `needs` by step name.
"""

from dataclasses import dataclass

import torch

from avatar_cli.runtime.budget import Budget, ModelBytes, SRBudget, rings_place, working_set
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.placement import Layout, choose_layout, plan_for


def job_budget(job, source, size: tuple[int, int], dtype: torch.dtype) -> Budget:
    """The family's budget for this job's settings: its mode, frame size, steps and guidance, `runtime.weights`, and
    the VAE's dtype as placement gives it (`runtime.vae_dtype`). job: a loaded job (spec.Job); source: its model
    source in the job's mode (families/registry.py ModelSource), whose config names a `dit:` file when it has one."""
    rt, sp, family = job.spec.runtime, job.spec.sampling, source.family
    pp = family.parallel.with_dtype("vae", rt.vae_dtype.value)
    vae_dtype = torch.float32 if "vae" in pp.float32 else torch.bfloat16 if "vae" in pp.bfloat16 else dtype
    return source.spec.budget(source.config, source.mode, size, dtype, sp.steps, sp.guidance, rt.weights.value,
                              vae_dtype)


def job_working_set(b: Budget, family, split: str, world: int, rank: int, decode: str,
                    rings_host: bool = False, sr: SRBudget | None = None) -> tuple[int, int, int]:
    """budget.working_set for one rank of a job of `family` (its decode's models from `family.needs`); sr: the job's
    frame super-resolution (`sr.model`), counted where the decode runs."""
    return working_set(b, split, world, rank, decode, family.needs["decode"], rings_host, sr)


def render_working_bytes(p, runtime: Runtime, rank: int, rings_host: bool = False,
                         sr: SRBudget | None = None) -> int | None:
    """The working set a render of the resolved job `p` keeps free on this rank's GPU, counted on meta as `avatar
    plan` counts it (sr: its super-resolution's budget, as the plan counts it: avatar_cli/sr/swiftvr/budget.py); None where
    the family has no budget (the placement then keeps its default reserve)."""
    source = p.model
    if source.spec.budget is None:
        return None
    b = job_budget(p.job, source, p.gen_size, runtime.dtype)
    return sum(job_working_set(b, source.family, p.parallel, p.world_size, rank, p.decode.value, rings_host, sr))


def render_rings(p, runtime: Runtime, free: int | None, host_free: int | None, skip=()) -> tuple[str, str] | None:
    """`runtime.rings` for a render of the resolved job `p` on one rank's device with `free` bytes free, as
    `avatar plan` decides it; None where the family keeps no rings (or has no budget to count them)."""
    source, setting = p.model, p.job.spec.runtime.rings.value
    if source.spec.budget is None or (setting in ("auto", "device") and (not runtime.is_cuda
                                                                         or p.parallel == "steps")):
        return None
    b = job_budget(p.job, source, p.gen_size, runtime.dtype)
    if not b.state:
        return None
    models = sum(m.total for n, m in b.models.items() if n not in skip)
    ws = job_working_set(b, source.family, p.parallel, p.world_size, 0, p.decode.value)
    return rings_place(setting, p.world_size, models + sum(ws), free, b.state, host_free)


def rank_layout(sizes: dict[str, ModelBytes], family, rt, world: int, free: int | None, working: int) -> Layout:
    """choose_layout for one rank's models with `working` bytes kept free, as placement counts them: quantized
    components (`runtime.weights`, or stored quantized) are replicated, not sharded."""
    quantized = [n for n, _ in family.parallel.quantized] if rt.weights.value != "bf16" else []
    quantized += [n for n, m in sizes.items() if m.stored_quantized and n not in quantized]
    return choose_layout(sizes, plan_for(family.parallel, sizes), world, free, working, rt.offload.value,
                         rt.shard.value, rt.reshard.value, unshardable=quantized)


@dataclass
class Rank0:
    """Rank 0's GPU outside the timestep pipeline: its layout, its working set (state, activations, a decode
    worker beside) and where the rings wait."""

    layout: Layout
    working: tuple[int, int, int]
    rings_at: str
    rings_why: str

    @property
    def gpu_bytes(self) -> int:
        """What it holds at its fullest, the CUDA context aside."""
        return self.layout.weights_peak() + sum(self.working)


def place_rank0(b: Budget, family, rt, split: str, world: int, decode: str, sizes: dict[str, ModelBytes],
                free: int, host_free: int | None, sr: SRBudget | None) -> Rank0:
    """Where the rings wait (decided first, as a render decides it), then the layout of `sizes` (rank 0's models,
    the super-resolution's among them where it runs in this process) with its working set kept free; decode:
    inline | worker."""
    rings_at, rings_why = "device", ""
    if b.state:
        ws = job_working_set(b, family, split, world, 0, decode, sr=sr)
        rings_at, rings_why = rings_place(rt.rings.value, world, sum(m.total for m in sizes.values()) + sum(ws),
                                          free, b.state, host_free)
    working = job_working_set(b, family, split, world, 0, decode, rings_at != "device", sr)
    return Rank0(rank_layout(sizes, family, rt, world, free, sum(working)), working, rings_at, rings_why)


def sr_decode(b: Budget, family, rt, split: str, world: int, free: int, host_free: int | None, sr: SRBudget,
              sizes: dict[str, ModelBytes]) -> str | None:
    """auto's decode worker holds the job's super-resolution whole on rank 0's GPU (a worker places nothing).
    Where that does not fit `free` and the decode inline does (the super-resolution then placed with rank 0's other
    models, `sizes`), the reason to decode inline; None: the worker stays (it fits, or neither does)."""
    worker = place_rank0(b, family, rt, split, world, "worker", sizes, free, host_free, sr).gpu_bytes
    if worker <= free:
        return None
    inline = place_rank0(b, family, rt, split, world, "inline", sizes | dict(sr.models), free, host_free,
                         sr).gpu_bytes
    if inline > free:
        return None
    return (f"auto: a decode worker would hold the super-resolution whole beside the DiT, {worker / 1e9:.1f} GB of "
            f"{free / 1e9:.1f} GB free; inline it is placed with the other models, {inline / 1e9:.1f} GB")
