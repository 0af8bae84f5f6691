"""Where each model lives while a job runs, applied from outside the models.

- Several ranks (torchrun): the DiT and the text encoder are FSDP2-sharded per block, and the DiT runs
  Ulysses sequence parallel; the small models (VAE, SR, audio encoder) are replicated, and the ranks
  split the SR's frames (frame parallel).
- `runtime.offload` (auto | none | model | block), on one GPU and on several: idle models wait in pinned
  host memory. One GPU: a stage's model comes onto the GPU when the stage starts (block by block,
  double-buffered, for "block") and is dropped by pointer swap when it ends. Several GPUs: the sharded
  models keep their shards in pinned host memory (FSDP2's CPUOffloadPolicy: each block's shard is copied
  in as part of its all-gather, which block i-1 prefetches), and the replicated ones are offloaded as on
  one GPU.
- CPU: everything stays where it is (the host is the device).
- Lazy modules (`lazy_module`: still on the meta device) are read from their files where they run: whole onto
  the device (or host, when offloaded); a sharded one is sharded on meta first, then each rank reads only
  its shards' rows, so no rank ever holds the whole checkpoint.
- `runtime.weights: fp8 | int8`: the components the family lists (ParallelPlan.quantized) are read in the runtime
  dtype and have their block Linears quantized (runtime/quantize.py) before anything else happens to them, a block
  at a time (on the GPU where there is one, then kept in host memory), each block's after-load step (a LoRA merge,
  into the float weights, before any rounding) first. Offload packs the quantized bytes, and only those reach the
  device. FSDP2 cannot shard torchao's quantized tensors, so under several ranks a quantized component is
  replicated (at half its bf16 size) and `runtime.shard: shard` refuses it.

The choices are `choose_layout`'s (shard or replicate, then offload), a pure function of the models' sizes, the
rank count and the free memory: `avatar plan` (plan.py) calls it with sizes counted on the meta device for a
machine it does not have, a render with the sizes of the models it loaded. Block offload's host tier (pinned copies
or the memory-mapped checkpoint) is `offload.host_tier_choice`'s.

The device behind offload is a `Transfer` plus the free memory it reports; tests pass a `HostTransfer`,
so the whole placement runs on the CPU with the CPU standing in for the GPU.
"""

import contextlib
import logging
import os
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from avatar_cli.errors import InputError
from avatar_cli.modules.loading import materialize
from avatar_cli.modules.module import Module
from avatar_cli.runtime.budget import ModelBytes
from avatar_cli.runtime.device import Runtime, dtype_name
from avatar_cli.runtime.distributed import Dist
from avatar_cli.runtime.frame_parallel import FrameParallel
from avatar_cli.runtime.offload import (BlockOffloader, CudaTransfer, MappedCheckpoint, ModelOffloader, Transfer,
                                        host_available, host_tier_choice, model_bytes, offload_choice)
from avatar_cli.runtime.parallelize import gpu_param_dtype, parallelize_model, prefetch_stage, reshard_stage
from avatar_cli.runtime.quantize import check_weights, load_quantized, quantize_linears, stored_bytes
from avatar_cli.runtime.rings import RingStore
from avatar_cli.runtime.sharding import choose_sharding
from avatar_cli.families.base import ParallelPlan, check_degree

log = logging.getLogger(__name__)


@dataclass
class Placement:
    """Where one job's models live on this rank and how its work is laid out: offloaded and sharded models, where
    the rings live, and how the ranks split the work (`runtime.parallel` as resolved: single | sequence | steps)."""

    offloaders: dict[str, BlockOffloader | ModelOffloader] = field(default_factory=dict)
    sharded: dict[str, torch.nn.Module] = field(default_factory=dict)
    reshard_per_stage: bool = False
    offload: str = "none"
    rings: RingStore = RingStore()  # where a streaming family's key/value rings live (runtime.rings)
    split: str = "single"  # how the ranks split the work: single | sequence | steps (the timestep pipeline)

    @contextlib.contextmanager
    def stage(self, names: str | Iterable[str], then: str | Iterable[str] = ()) -> Iterator[None]:
        """Bring the stage's models in for its duration; afterwards drop them (offload) or reshard (FSDP).

        then: the models the next stage runs. Their copy in (offload) or first all-gathers (FSDP) start
        now and overlap this stage's compute, so the handoff between the two stages waits for neither.
        """
        names = (names,) if isinstance(names, str) else tuple(names)
        then = (then,) if isinstance(then, str) else tuple(then)
        for name in names:
            if name in self.offloaders:
                self.offloaders[name].begin()
        for name in then:
            if name in names:
                continue
            if name in self.offloaders:
                self.offloaders[name].prefetch()
            if name in self.sharded:
                prefetch_stage(self.sharded[name])
        try:
            yield
        finally:
            for name in names:
                if name in self.offloaders:
                    self.offloaders[name].end()
                if self.reshard_per_stage and name in self.sharded:
                    reshard_stage(self.sharded[name])

    def release(self) -> None:
        """Drop whatever is still on the device: a prefetch no stage used, a stage an error left open."""
        for offloader in self.offloaders.values():
            offloader.end()


def _stored(model: torch.nn.Module) -> int:
    """Parameter bytes as held (a quantized weight: its data and scales)."""
    return sum(stored_bytes(p) for p in model.parameters())


def model_sizes(model: torch.nn.Module) -> ModelBytes:
    """A model's parameter bytes as the layout choice reads them (on meta this costs nothing): whole, and its
    `blocks` (the units block offload streams and FSDP2 gathers) when it has them."""
    blocks = getattr(model, "blocks", None)
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        return ModelBytes(_stored(model), dtype_name(dtype))
    sizes = [_stored(b) for b in blocks]
    return ModelBytes(_stored(model), dtype_name(dtype), len(sizes), max(sizes), sum(sizes))


def resident_bytes(size: ModelBytes, world_size: int, reshard: str) -> int:
    """Device bytes a sharded model needs on one rank while it runs: its shard plus what the all-gathers hold
    (per_block: the root, which FSDP2 never reshards, and the running and the prefetched block; per_stage: the
    whole model, kept gathered)."""
    if reshard == "per_stage" or not size.blocks:
        return size.total // world_size + size.total
    return size.total // world_size + size.root + 2 * size.block


@dataclass(frozen=True)
class Layout:
    """Where a job's models live: chosen by `choose_layout` from sizes alone, so a render (sizes of the models it
    loaded) and `avatar plan` (sizes counted on meta for a machine it does not have) make the same choice."""

    sharded: tuple[str, ...]  # FSDP2-sharded over the ranks; the rest replicated
    offload: str  # none | model | block
    shard_why: str
    offload_why: str
    device: Mapping[str, int]  # bytes each model holds on one rank's device while it runs (its stage)

    def weights_peak(self) -> int:
        """Weight bytes on one device at its fullest: every model (offload none), else the largest stage's and the
        next stage's, prefetched during it (the two largest)."""
        if self.offload == "none":
            return sum(self.device.values())
        return sum(sorted(self.device.values())[-2:])


def choose_layout(sizes: Mapping[str, ModelBytes], plan: ParallelPlan, world: int, free_bytes: int | None,
                  working_bytes: int, offload: str = "auto", shard: str = "auto", reshard: str = "per_block",
                  can_offload: bool = True, unshardable: Collection[str] = ()) -> Layout:
    """Shard or replicate (several ranks), then offload none / model / block, from the models' sizes and the
    device's free memory (None: unknown, a CPU). can_offload: a device with a host to offload to (not a CPU);
    unshardable: components FSDP2 cannot shard (quantized weights): replicated."""
    if world > 1:
        candidates = tuple(n for n in plan.sharded if n in sizes and n not in unshardable)
        resident = {n: resident_bytes(sizes[n], world, reshard) for n in candidates}
        sc = choose_sharding(candidates, {n: b.total for n, b in sizes.items()},
                             world, free_bytes, working_bytes, shard, resident=resident)
        sharded, shard_why = sc.sharded, sc.reason
        held = [n for n in plan.sharded if n in sizes and n in unshardable]
        if held:
            shard_why = f"{', '.join(held)} replicated: quantized weights are not sharded; " + (
                shard_why if candidates else "nothing else to shard")
    else:
        sharded, shard_why = (), "one rank: nothing to shard"
    need = {n: resident_bytes(b, world, reshard) if n in sharded else b.total for n, b in sizes.items()}
    if not can_offload:
        return Layout(sharded, "none", shard_why, "no host to offload to (a CPU)", need)
    choice, why = offload_choice(offload, _known(free_bytes), need, working_bytes)
    device = dict(need)
    for n, b in sizes.items():
        if choice != "none" and n in sharded and b.blocks:
            # FSDP2's CPU offload: the shard waits on the host; on the device, the root (kept gathered) and the
            # running and the prefetched block, gathered
            device[n] = b.root + 2 * b.block
        elif choice == "block" and b.blocks:  # its root and two block buffers (no blocks: it comes in whole)
            device[n] = b.root + 2 * b.block
    return Layout(sharded, choice, shard_why, why, device)


def plan_for(plan: ParallelPlan, names: Collection[str]) -> ParallelPlan:
    """The family's parallel plan restricted to the components being placed now."""
    return replace(plan, sharded=tuple(n for n in plan.sharded if n in names),
                   frame_parallel=tuple(n for n in plan.frame_parallel if n in names),
                   sequence_parallel=plan.sequence_parallel if plan.sequence_parallel in names else None)


def place(modules: Mapping[str, Module], runtime: Runtime, dist: Dist, offload: str = "auto",
          reshard: str = "per_block", working_bytes: int = 2 << 30, transfer: Transfer | None = None,
          free_bytes: int | None = None, plan: ParallelPlan | None = None, shard: str = "auto",
          weights: str = "bf16", offload_host: str = "auto", host_free: int | None = None,
          rings: RingStore = RingStore()) -> Placement:
    """Put each model where it runs, shard and offload as configured; returns what the stages enter.

    shard: auto | shard | replicate, for the plan's shardable models on several ranks (runtime/sharding.py):
    auto replicates those whose replicas fit the device's free memory (no all-gather per forward) and shards
    the rest; on a CPU, whose free memory is not known, it shards.

    plan: the family's ParallelPlan (which components to shard, split by frames, run sequence parallel, quantize);
    needed when `dist` has several ranks.
    weights: `runtime.weights`, bf16 | fp8 | int8: fp8 and int8 quantize the plan's `quantized` Linears first.
    transfer, free_bytes: the device behind offload; by default CUDA's (a side copy stream, and
    `mem_get_info`). Without a transfer on a CPU run nothing is offloaded.
    offload_host: where block-offloaded blocks wait (runtime.offload_host: auto | pinned | mmap), chosen by
    offload.host_tier_choice from host_free (default: the host's MemAvailable).
    rings: where the family's key/value rings live (runtime/rings.py), decided before placement; the Placement
    holds it for the stage that denoises.
    """
    if transfer is None and runtime.is_cuda:
        transfer = CudaTransfer(runtime.device)
    if free_bytes is None and runtime.is_cuda:
        free_bytes = torch.cuda.mem_get_info(runtime.device)[0]
    plan = plan or ParallelPlan()
    for name, module in modules.items():
        if module.is_lazy:  # on meta this costs nothing, and the sizes the offload choice reads come out right
            module.model.to(dtype=_dtype(name, runtime, plan))
    quantized = _quantize(modules, runtime, plan, weights)
    quantized += tuple(n for n, m in modules.items() if m.stored_quantized and n not in quantized)
    if dist.enabled:
        return replace(_place_sharded(modules, runtime, dist, offload, reshard, working_bytes, transfer, free_bytes,
                                      plan, shard, quantized, offload_host, host_free), rings=rings)
    if transfer is None:
        for name, module in modules.items():
            module.to(runtime.device, _dtype(name, runtime, plan))
            _after_load(module)
        return Placement(rings=rings)

    layout = choose_layout({name: model_sizes(m.model) for name, m in modules.items()}, plan, 1, free_bytes,
                           working_bytes, offload)
    log.info("offload: %s", layout.offload_why)
    placement = Placement(offload=layout.offload, rings=rings)
    tier = _host_tier(modules, layout.offload, offload_host, host_free, _local_ranks())
    _offload_replicated(modules, runtime, layout.offload, transfer, placement, plan, tier)
    return placement


def _quantize(modules: Mapping[str, Module], runtime: Runtime, plan: ParallelPlan, weights: str) -> tuple[str, ...]:
    """Quantize the plan's `quantized` components into host memory (read in the runtime dtype a block at a time, or
    whole when their after-load step cannot run by parts); returns their names. bf16: nothing."""
    check_weights(weights)
    if weights == "bf16":
        return ()
    done = []
    for name, module in modules.items():
        paths = plan.quantized_paths(name)
        if paths is None:
            continue
        dtype = _dtype(name, runtime, plan)
        step = module.after_load
        if module.is_lazy and hasattr(module.model, "blocks") and (step is None or hasattr(step, "part")):
            # A block at a time, its LoRA merged into its float weights first; quantized on the GPU where there is one.
            module.after_load = None
            n = load_quantized(module.model, module.index, dtype, weights, paths, step,
                               runtime.device if runtime.is_cuda else "cpu")
        else:  # read whole: an after-load step (a LoRA) merges into the float weights before they are rounded
            module.to("cpu", dtype)
            _after_load(module)
            n = quantize_linears(module.model, weights, paths)
        log.info("weights: %s: %d Linears quantized to %s", name, n, weights)
        done.append(name)
    return tuple(done)


def _dtype(name: str, runtime: Runtime, plan: ParallelPlan) -> torch.dtype:
    """The runtime's dtype, except for the components the plan keeps in float32 or in bfloat16."""
    return torch.float32 if name in plan.float32 else torch.bfloat16 if name in plan.bfloat16 else runtime.dtype


def _place_sharded(modules: Mapping[str, Module], runtime: Runtime, dist: Dist, offload: str, reshard: str,
                   working_bytes: int, transfer: Transfer | None, free_bytes: int | None,
                   plan: ParallelPlan, shard: str = "auto", quantized: tuple[str, ...] = (),
                   offload_host: str = "auto", host_free: int | None = None) -> Placement:
    """FSDP2 for the transformers, sequence parallel for the DiT; offload (if chosen) from the outside of both.
    quantized: components whose weights are quantized, which FSDP2 cannot shard: replicated."""
    try:
        check_degree(plan.sp_heads, dist.world_size)
    except ValueError as e:
        raise InputError(str(e)) from None  # a choice of rank count, not a render failure: exit 2
    unshardable = [n for n in plan.sharded if n in quantized]
    if unshardable and shard == "shard":
        raise InputError(f"runtime.shard: shard with runtime.weights quantized: FSDP2 cannot shard the quantized "
                         f"weights of {', '.join(unshardable)}; use runtime.shard: auto or replicate, or "
                         "runtime.weights: bf16")
    if unshardable:
        log.info("placement: %s replicated (quantized weights are not sharded)", ", ".join(unshardable))
    layout = choose_layout({name: model_sizes(m.model) for name, m in modules.items()}, plan, dist.world_size,
                           free_bytes, working_bytes, offload, shard, reshard, can_offload=transfer is not None,
                           unshardable=quantized)
    SHARDED, choice = layout.sharded, layout.offload
    if set(plan.sharded) - set(SHARDED) - set(unshardable):
        log.info("placement: %s", layout.shard_why)
    if transfer is not None:
        log.info("offload: %s", layout.offload_why)
    placement = Placement(reshard_per_stage=reshard == "per_stage", offload=choice)
    param_dtype = gpu_param_dtype(runtime.device.type)
    for name in SHARDED:
        module = modules[name]
        # Offloaded shards start on the host: FSDP2 moves one block at a time to the device to shard it.
        home = torch.device("cpu") if choice != "none" else runtime.device
        lazy = module.is_lazy
        if not lazy:
            module.to(home, _dtype(name, runtime, plan))
        placement.sharded[name] = parallelize_model(module.model, dist.mesh, reshard=reshard,
                                                    param_dtype=param_dtype, offload=choice != "none")
        if lazy:  # sharded on meta: each rank now reads only its own rows of every tensor
            materialize(module.model, module.index, home, _dtype(name, runtime, plan))
        _after_load(module)  # on this rank's rows, before the first all-gather
    replicated = {name: m for name, m in modules.items() if name not in SHARDED}
    tier = _host_tier(replicated, choice, offload_host, host_free, _local_ranks())
    _offload_replicated(replicated, runtime, choice, transfer, placement, plan, tier)
    if plan.sequence_parallel is not None:
        sp = modules[plan.sequence_parallel]
        sp.model = plan.sp_wrap(sp.model, dist.group)
    for name in plan.frame_parallel:
        modules[name].model = FrameParallel(modules[name].model, dist.group)
    log.info("placement: %s sharded over %d ranks (reshard %s%s); %s sequence parallel; %s frame parallel",
             ", ".join(SHARDED) or "nothing", dist.world_size, reshard, ", shards in pinned host memory" if choice != "none" else "",
             plan.sequence_parallel or "nothing", ", ".join(plan.frame_parallel) or "nothing")
    return placement


def mmap_blocker(module: Module) -> str | None:
    """None when `module` can stream its blocks from its memory-mapped checkpoint, else why not."""
    if not hasattr(module.model, "blocks"):
        return f"{module.name} has no blocks"
    if not module.is_lazy:
        return f"{module.name} is not read lazily from a safetensors file"
    if module.after_load is not None and not hasattr(module.after_load, "part"):
        return f"{module.name}'s weights are changed at load as a whole, so they are not the file's"
    if any(info.span is None for info in module.index.tensors.values()):
        return f"{module.name}'s checkpoint is not safetensors"
    return None


def _host_tier(modules: Mapping[str, Module], choice: str, setting: str, host_free: int | None,
               local_ranks: int) -> str:
    """runtime.offload_host for this placement: "pinned" or "mmap" (only under block offload)."""
    if choice != "block":
        return "pinned"
    blockers = [mmap_blocker(m) for m in modules.values() if hasattr(m.model, "blocks")]
    mappable = None if any(b is None for b in blockers) else (blockers[0] if blockers else "no model has blocks")
    pinned = local_ranks * sum(_stored(m.model) for m in modules.values())
    if host_free is None:
        host_free = host_available()
    try:
        tier, why = host_tier_choice(setting, host_free, pinned, mappable)
    except ValueError as e:
        raise InputError(str(e)) from None
    log.info("offload host: %s", why)
    return tier


def _offload_replicated(modules: Mapping[str, Module], runtime: Runtime, choice: str, transfer: Transfer | None,
                        placement: Placement, plan: ParallelPlan, tier: str = "pinned") -> None:
    """Whole models on the device ("none"), or in host slabs that stages bring in ("model", "block"); with the
    mmap tier, the blocks of a lazily read model stay in its memory-mapped checkpoint."""
    for name, module in modules.items():
        if choice == "none":
            module.to(runtime.device, _dtype(name, runtime, plan))
            _after_load(module)
            continue
        if choice == "block" and tier == "mmap" and mmap_blocker(module) is None:
            # A LoRA (after_load) merges into each block on the device as its copy lands, the root's once here.
            merge, module.after_load = module.after_load, None
            placement.offloaders[name] = BlockOffloader(module.model, transfer, name=name,
                                                        mapped=MappedCheckpoint(module.index.tensors),
                                                        dtype=_dtype(name, runtime, plan), merge=merge)
            continue
        module.to("cpu", _dtype(name, runtime, plan))
        _after_load(module)  # before the offloader takes the weights into its host slabs
        if choice == "block" and hasattr(module.model, "blocks"):
            placement.offloaders[name] = BlockOffloader(module.model, transfer, name=name)
        else:
            placement.offloaders[name] = ModelOffloader(module.model, transfer, name=name)


def _after_load(module: Module) -> None:
    """The module's after-load step (a LoRA merge), once: its weights are now loaded where they stay."""
    step, module.after_load = module.after_load, None
    if step is not None:
        step(module.model)


def _known(free_bytes: int | None) -> int:
    if free_bytes is None:
        raise ValueError("offload needs the device's free memory (free_bytes) along with its transfer")
    return free_bytes


def _local_ranks() -> int:
    """Processes on this host (torchrun's LOCAL_WORLD_SIZE; the timestep pipeline's ranks place themselves one by
    one, but share the host): each holds its own pinned copies, where a memory-mapped checkpoint is shared."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
