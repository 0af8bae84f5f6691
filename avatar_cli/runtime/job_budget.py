"""One job's budget and the decisions taken from it, shared by a render and by `avatar plan`: the family's budget
for the job's settings (`job_budget`), the working set a render keeps free on one rank (`render_working_bytes`),
and where the rings wait (`render_rings`). Both callers hand the same kind of input, so on the planned machine a
render makes the planned choice.

The job is duck-typed here (a loaded job and its model source, or a resolved job: job.py), so that this layer
imports nothing above it: `runtime.*` settings are read by their values, `runtime.parallel` resolved as a str
(single | sequence | steps), and the family's `needs` by step name.
"""

import torch

from avatar_cli.runtime.budget import Budget, SRBudget, rings_place, working_set
from avatar_cli.runtime.device import Runtime


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
