"""What a file render and a live session share before their one loop: the runtime on this rank, the output lock,
the models loaded and placed, the pipeline built.

    with opened(p, reporter) as job:          # runtime, ranks checked, the output locked
        ...                                   # the caller's own: a resume point, the outputs it writes to
        built = build(p, job, reporter, models, live=...)   # text cache, rings, working set, models, pipeline

Everything a render and a session both need is here, once; what differs (the source, the sinks, resume) goes in
as arguments or stays with the caller (render/file.py, render/live.py).
"""

import contextlib
import logging
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from avatar_cli.errors import InputError, RenderError
from avatar_cli.families.registry import ModelSource, load_modules
from avatar_cli.job import ResolvedJob, Split
from avatar_cli.spec import Decode
from avatar_cli.modules.module import Module
from avatar_cli.pipeline import checkpoint as ckpt
from avatar_cli.pipeline.run import Pipeline
from avatar_cli.pipeline.steps import DECODE_RANK, rank_skips
from avatar_cli.runtime.job_budget import job_budget, render_rings, render_working_bytes, sr_decode
from avatar_cli.prompts import cache as prompt_cache
from avatar_cli.prompts.cache import PromptCache
from avatar_cli.report import Reporter
from avatar_cli.runtime.device import Runtime, dtype_name, one_cpu_thread, resolve_runtime, set_cpu_threads
from avatar_cli.runtime.distributed import Dist, current_dist, launched_by_torchrun
from avatar_cli.runtime.numa import bind_to_gpu_node
from avatar_cli.runtime.offload import Transfer, host_available
from avatar_cli.runtime.placement import Placement, place, plan_for
from avatar_cli.runtime.rings import RingStore
from avatar_cli.stages.sr import SRPlan
from avatar_cli.stages.sr import load_models as load_sr_models

log = logging.getLogger(__name__)

__all__ = ["Built", "ModelCache", "Opened", "build", "fit_decode", "opened", "runs_sr", "setup_runtime"]


@dataclass
class ModelCache:
    """Jobs of a batch that share a model load (and place) it once: the key holds everything that changes what is
    loaded or where it is placed.

    transfer, free_bytes: the device behind offload, when not CUDA's (tests: the CPU standing in).
    """

    loaded: dict[tuple, tuple[dict[str, Module], Placement]] = field(default_factory=dict)
    transfer: Transfer | None = None
    free_bytes: int | None = None
    sr: dict[tuple, Any] = field(default_factory=dict)  # frame super-resolution's models, as `loaded`

    def get_sr(self, plan: SRPlan, runtime: Runtime, weights: str) -> Any:
        """The SR models of `plan` on this rank's device (stages/sr.py load_models), loaded once for the jobs of a
        batch that share them."""
        key = (str(plan.model), str(runtime.device), str(runtime.dtype), weights)
        if key not in self.sr:
            self.sr.clear()  # one SR model resident, as one model set
            with one_cpu_thread(not runtime.is_cuda and weights == "bf16"):  # copies only, as the family's load
                self.sr[key] = load_sr_models(plan, runtime.device, runtime.dtype, weights)
        return self.sr[key]

    @staticmethod
    def key(source: ModelSource, runtime: Runtime, rt_spec, split: Split, rings: RingStore) -> tuple:
        return (source.fingerprint, str(runtime.device), str(runtime.dtype), rt_spec.offload.value,
                rt_spec.reshard.value, rt_spec.shard.value, rt_spec.weights.value, rt_spec.vae_dtype.value,
                rt_spec.offload_host.value, split.value, rings)

    def get(self, source: ModelSource, runtime: Runtime, dist: Dist, rt_spec, reporter: Reporter, *,
            split: Split = Split.single, rings: RingStore = RingStore(), skip: Collection[str] = (),
            working_bytes: int | None = None) -> tuple[dict[str, Module], Placement]:
        """split: how the job's ranks split its work; rings: where its key/value rings live (place_rings), held
        by the placement. skip: components this
        job does not need loaded (its prompt is in the text cache); a set that lacks what a later job needs gets just
        those loaded and placed beside it. working_bytes: device memory the layout keeps free for state and
        activations (None: placement's default reserve)."""
        key = self.key(source, runtime, rt_spec, split, rings)
        if key not in self.loaded:
            if not source.trained:
                reporter.info(f"note: model '{source.name}' has no trained weights yet: a seeded random init stands "
                              "in, so the video shows noise, not a face")
            self.loaded.clear()  # keep one model set resident, not one per model ever used
            self.loaded[key] = ({}, Placement(rings=rings, split=split.value))
        modules, placement = self.loaded[key]
        wanted = [n for n in source.family.components if n not in skip and n not in modules]
        if wanted:
            unwanted = [n for n in source.family.components if n not in wanted]
            # A CPU's weights are read and converted on one thread (one_cpu_thread: copies, the same on any
            # count); quantizing and LoRA merges compute, so they keep the job's threads.
            with one_cpu_thread(not runtime.is_cuda):
                more = load_modules(source, skip=unwanted) if unwanted else load_modules(source)
            copies_only = rt_spec.weights.value == "bf16" and not any(m.after_load for m in more.values())
            with one_cpu_thread(not runtime.is_cuda and copies_only):
                added = place(more, runtime, dist, rt_spec.offload.value, rt_spec.reshard.value,
                              transfer=self.transfer, free_bytes=self.free_bytes,
                              plan=plan_for(source.family.parallel.with_dtype("vae", rt_spec.vae_dtype.value), more),
                              shard=rt_spec.shard.value, weights=rt_spec.weights.value,
                              offload_host=rt_spec.offload_host.value, rings=rings,
                              **({} if working_bytes is None else {"working_bytes": working_bytes}))
            if modules:  # beside a placed set: the stages look each component up by name in either
                placement.offloaders.update(added.offloaders)
                placement.sharded.update(added.sharded)
            else:
                placement = replace(added, split=split.value)
            modules.update(more)
            self.loaded[key] = (modules, placement)
        return modules, placement


def setup_runtime(spec, runtime: Runtime | None = None) -> tuple[Runtime, Dist]:
    """The job's runtime (resolved with the job; resolved here when not given) on this rank's device, and (under
    torchrun) the process group; on a GPU, bind to its NUMA node first. Which CUDA device a rank drives is known
    only now, in the process that renders.

    The binding comes before the process group: NCCL, initialized eagerly for our device, allocates its
    own pinned host buffers, and those too should sit on the GPU's node.
    """
    rt = spec.runtime
    if runtime is None:
        runtime = resolve_runtime(rt.device.value, rt.dtype.value, rt.threads)
    elif not runtime.is_cuda:
        set_cpu_threads(rt.threads)  # this job's count, whatever another job resolved since
    if runtime.is_cuda:
        index = int(os.environ["LOCAL_RANK"]) if launched_by_torchrun() else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise InputError(f"runtime: this worker is local rank {index} but only {torch.cuda.device_count()} "
                             "GPU(s) are visible: start at most one process per GPU (--nproc)")
        runtime = Runtime(torch.device("cuda", index), runtime.dtype, runtime.dtype_reason)
        cpus = bind_to_gpu_node(runtime.device)
        if cpus and spec.runtime.threads <= 0:
            torch.set_num_threads(min(torch.get_num_threads(), len(cpus)))  # no more threads than our CPUs
    dist = current_dist(runtime.device.type)
    return runtime, dist


@dataclass
class Opened:
    """A job opened on this rank: its runtime and process group, and the frame count every rank agreed on."""

    runtime: Runtime
    dist: Dist
    frames: int

    @property
    def main(self) -> bool:
        return self.dist.is_main


def make_output_folder(output: Path) -> None:
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"output: cannot create folder {output.parent} ({e.strerror})") from None


def lock_path(p: ResolvedJob) -> Path | None:
    """Where the output lock of this job goes: beside the partial file of an output on disk (an MP4, an HLS
    playlist); None for a stream (stdout, a URL), which nothing else renders into."""
    out = p.job.output
    return p.job.partial_output if isinstance(out, Path) else None


@contextlib.contextmanager
def opened(p: ResolvedJob, reporter: Reporter) -> Iterator[Opened]:
    """The runtime on this rank and the ranks checked (their count, the frame count), then the output locked for
    as long as the job runs: one render or session per output at a time, every rank stopping alike before any
    work when another process holds it."""
    spec = p.job.spec
    runtime, dist = setup_runtime(spec, p.runtime)
    frames = dist.agree(p.frames, "the frame count")
    if dist.world_size != p.world_size:
        raise RenderError(f"the job was resolved for {p.world_size} rank(s) but runs on {dist.world_size}")
    if dist.is_main and dist.enabled:
        reporter.info(f"parallel: {p.parallel.value} ({p.parallel_why})")
    if dist.is_main and p.transitions_why:
        reporter.info(f"transitions: {'on' if spec.chunking.transitions else 'off'} ({p.transitions_why})")
    path = lock_path(p)
    lock = ckpt.OutputLock(path) if path is not None else None
    if dist.is_main and path is not None:
        make_output_folder(path)  # the lock file lives beside the output
    busy = dist.broadcast_object(lock.acquire() if dist.is_main and lock is not None else None)
    if busy:
        raise InputError(f"output: {p.job.output}: {busy}; wait for it to finish or stop it")
    try:
        yield Opened(runtime, dist, frames)
    finally:
        if lock is not None:
            lock.release()


@dataclass
class Built:
    """The models loaded and placed, and the pipeline over them, for one job on this rank."""

    pipeline: Pipeline
    placement: Placement
    modules: dict[str, Module]
    prompts: PromptCache | None
    text_cache: str  # prompts/cache.py `outcome`: hit | service | miss | off
    image: torch.Tensor  # (3, H, W) in [-1, 1]: the reference at the family's native size


def place_rings(p: ResolvedJob, runtime: Runtime, skip: Collection[str] = ()) -> tuple[RingStore, str | None]:
    """`runtime.rings` for this job, decided before placement as `avatar plan` decides it: where the rings live
    and why (None: the family keeps no rings). Rings in host memory the host cannot hold are exit 2 now, not an
    allocation failure blocks later."""
    free = torch.cuda.mem_get_info(runtime.device)[0] if runtime.is_cuda else None
    avail = host_available()
    got = render_rings(p, runtime, free, avail, skip)
    at, why = got if got is not None else ("device", None)
    folder = None
    if at == "disk":  # a scratch file beside the output (a stream's: in the working folder), not a RAM-backed /tmp
        out = p.job.output
        folder = out.parent if isinstance(out, Path) and not p.job.live else Path.cwd()
    if at == "host":
        need = p.model.family.resume_bytes(p.gen_size, p.job.spec.sampling.steps)
        if avail is not None and need > avail:
            raise InputError(f"runtime.rings: host: the key/value rings need {need / 1e9:.1f} GB of host memory, "
                             f"{avail / 1e9:.1f} GB is available (runtime.rings: disk keeps them in a file)")
    return RingStore(at, folder), why


def working_bytes(p: ResolvedJob, runtime: Runtime, dist: Dist, models: ModelCache, rings: RingStore) -> int | None:
    """Where placement chooses from free device memory (a GPU, or the CPU standing in for one), the state and
    activations it keeps free: counted on the meta device for this job, as `avatar plan` counts them, so a render
    and its plan choose the same layout. None: the family has no budget (placement's default reserve)."""
    rt = p.job.spec.runtime
    if not (runtime.is_cuda or models.transfer is not None) or "auto" not in (rt.offload.value, rt.shard.value):
        return None
    sr = None
    if p.sr is not None:  # counted as the plan counts it: only here, where placement chooses from memory
        from avatar_cli.sr.swiftvr.budget import sr_budget

        sr = sr_budget(p.sr.model, p.sr.lq, p.sr.scale, runtime.dtype, rt.weights.value)
    working = render_working_bytes(p, runtime, dist.rank, not rings.on_device, sr)
    if working is not None:
        log.info("placement: %.1f GB kept free for state and activations (counted on the meta device)",
                 working / 1e9)
    return working


def fit_decode(p: ResolvedJob, job: Opened, models: ModelCache | None = None) -> ResolvedJob:
    """The job with auto's decode worker given up for inline where the worker cannot hold the job's
    super-resolution whole beside the models rank 0's GPU places (runtime/job_budget.py `sr_decode`, as `avatar
    plan` decides it); rank 0's device decides, for every rank. Any other job as it is."""
    rt = p.job.spec.runtime
    if p.sr is None or p.decode != Decode.worker or rt.decode.value != "auto":
        return p
    why = None
    free = None
    if job.main:
        free = torch.cuda.mem_get_info(job.runtime.device)[0] if job.runtime.is_cuda else \
            models.free_bytes if models is not None else None
    if free is not None and p.model.spec.budget is not None:
        from avatar_cli.sr.swiftvr.budget import sr_budget  # meta counting: paid only with sr.model

        family, dtype = p.model.family, job.runtime.dtype
        b = job_budget(p.job, p.model, p.gen_size, dtype)
        sr = sr_budget(p.sr.model, p.sr.lq, p.sr.scale, dtype, rt.weights.value)
        why = sr_decode(b, family, rt, p.parallel.value, p.world_size, free, host_available(), sr,
                        {n: b.models[n] for n in family.components})
    why = job.dist.broadcast_object(why)
    return p if why is None else replace(p, decode=Decode.inline, decode_why=why)


def runs_sr(p: ResolvedJob, rank: int) -> bool:
    """Whether rank `rank` loads the job's frame super-resolution and runs it in the render process. It runs where
    the frames are written: on rank 0 alone, after its decode, whether the ranks split every forward (sequence
    parallel: the others decode nothing, or only for their rolling state) or one denoising step each (the timestep
    pipeline: rank 0 is its decode rank); a decode worker loads it in its own process instead. No other rank loads
    it, so a step rank's memory holds its step and nothing of SR's."""
    if p.sr is None or p.decode == Decode.worker:
        return False
    return rank == (DECODE_RANK if p.parallel == Split.steps else 0)


def build(p: ResolvedJob, job: Opened, reporter: Reporter, models: ModelCache | None = None) -> Built:
    """Load and place the job's models (those its text cache and its rank's role leave out excepted) and build the
    pipeline over them; then say what the job resolved (its warnings, the dtype auto chose)."""
    spec, runtime, dist, family = p.job.spec, job.runtime, job.dist, p.model.family
    # A prompt found in the text cache: its encoder is neither loaded nor placed.
    prompts = prompt_cache.job_prompts(spec.runtime.text_cache, p.job.path.parent, p.model, runtime.dtype,
                                       reporter.info, write=job.main, service=spec.runtime.text_service,
                                       weights=spec.runtime.weights.value)
    cached = prompt_cache.ready(prompts, spec.prompt, runtime.device, dist)
    # The timestep pipeline: each rank loads what its role runs and places it alone (nothing is sharded).
    steps = p.parallel == Split.steps
    absent = rank_skips(family, dist.rank) if steps else set()
    skip = {*prompt_cache.skipped(prompts, spec.prompt), *absent}
    rings, rings_why = place_rings(p, runtime, skip)
    if job.main and rings_why is not None:
        reporter.info(f"rings: {rings.at} ({rings_why})")
    models = models if models is not None else ModelCache()
    modules, placement = models.get(p.model, runtime, Dist() if steps else dist, spec.runtime, reporter,
                                    split=p.parallel, rings=rings, skip=skip,
                                    working_bytes=working_bytes(p, runtime, dist, models, rings))
    sr = (p.sr, models.get_sr(p.sr, runtime, spec.runtime.weights.value)) if runs_sr(p, dist.rank) else None
    pipeline = Pipeline(modules, family, runtime, placement, prompts=prompts,
                        steps_dist=dist if placement.split == Split.steps else None, absent=absent, sr=sr)
    image = family.fit_reference(p.image, *p.gen_size)  # (3, H, W) in [-1, 1]
    for warning in p.warnings if job.main else []:
        reporter.info(warning)
    if job.main and spec.runtime.dtype.value == "auto":
        reporter.info(f"dtype: {dtype_name(runtime.dtype)} ({runtime.dtype_reason})")
    return Built(pipeline, placement, modules, prompts, prompt_cache.outcome(prompts, cached), image)
