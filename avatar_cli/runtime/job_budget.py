"""One job's budget and the decisions taken from it, shared by a render and by `avatar plan`: the family's budget
for the job's settings (`job_budget`), the working set a render keeps free on one rank (`render_working_bytes`),
where the rings wait (`render_rings`), and whether auto's decode worker can hold the job's super-resolution
(`sr_decode`). Both callers hand the same kind of input, so on the planned machine a
render makes the planned choice.

The job is duck-typed here (a loaded job and its model source, or a resolved job: job.py), so that this layer
imports nothing above it: `runtime.*` settings are read by their values, `runtime.parallel` resolved as a str
(single | sequence | steps), and the family's `needs` by step name.
"""

import torch

from avatar_cli.runtime.budget import Budget, SRBudget, rings_place, working_set
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.placement import choose_layout, plan_for


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


def rank0_bytes(job, source, size: tuple[int, int], dtype: torch.dtype, split: str, world: int, decode: str,
                free: int, host_free: int | None, sr: SRBudget | None, skip=()) -> int:
    """What rank 0's GPU holds at its fullest (weights, state, activations, a decode worker beside), the CUDA
    context aside, in the layout placement takes for `free` bytes free, with the decode run `decode` (inline |
    worker) and the job's super-resolution where that decode runs: placed with the rank's other models inline
    (streamed with them under block offload), whole in a worker. skip: components not loaded (a cached prompt's
    encoder). Not for the timestep pipeline, which has no worker."""
    family, rt = source.family, job.spec.runtime
    b = job_budget(job, source, size, dtype)
    sizes = {n: m for n, m in b.models.items() if n in family.components and n not in skip}
    if decode == "inline" and sr is not None:
        sizes |= dict(sr.models)
    rings_host = False
    if b.state:  # where the rings wait, decided before the layout as a render decides it
        ws = job_working_set(b, family, split, world, 0, decode, sr=sr)
        at, _ = rings_place(rt.rings.value, world, sum(m.total for m in sizes.values()) + sum(ws), free, b.state,
                            host_free)
        rings_host = at != "device"
    state, work, worker = job_working_set(b, family, split, world, 0, decode, rings_host, sr)
    quantized = [n for n, _ in family.parallel.quantized] if rt.weights.value != "bf16" else []
    quantized += [n for n, m in sizes.items() if m.stored_quantized and n not in quantized]
    layout = choose_layout(sizes, plan_for(family.parallel, sizes), world, free, state + work + worker,
                           rt.offload.value, rt.shard.value, rt.reshard.value, unshardable=quantized)
    return layout.weights_peak() + state + work + worker


def sr_decode(job, source, size: tuple[int, int], dtype: torch.dtype, split: str, world: int, free: int,
              host_free: int | None, sr: SRBudget, skip=()) -> str | None:
    """auto's decode worker holds the job's super-resolution whole on rank 0's GPU (a worker places nothing).
    Where that does not fit `free` and the decode inline does (the super-resolution then placed with the rank's other
    models), the reason to decode inline; None: the worker stays (it fits, or neither does)."""
    worker = rank0_bytes(job, source, size, dtype, split, world, "worker", free, host_free, sr, skip)
    if worker <= free:
        return None
    inline = rank0_bytes(job, source, size, dtype, split, world, "inline", free, host_free, sr, skip)
    if inline > free:
        return None
    return (f"auto: a decode worker would hold the super-resolution whole beside the DiT, {worker / 1e9:.1f} GB of "
            f"{free / 1e9:.1f} GB free; inline it is placed with the other models, {inline / 1e9:.1f} GB")
