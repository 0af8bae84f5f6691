"""FSDP2 sharding of the transformer models, applied from outside: the models' code is untouched.

Each transformer block becomes one FSDP unit (one all-gather per block), then the root takes the
remaining parameters (embedders, final layer). Block i prefetches block i+1's all-gather, so the
communication for the next block overlaps the current block's compute.

Reshard policy, the memory/speed trade-off (one DiT stage = `steps` (x2 with guidance) forwards):
- "per_block": `reshard_after_forward=True`. After each block runs its full parameters are freed.
  Resident per rank: params/world + about two gathered blocks (current + prefetched). Every
  denoising step re-gathers every block: steps x model bytes of all-gather traffic per chunk.
  Use it when memory is tight (24 GB cards, or several large models sharing the GPU).
- "per_stage": `reshard_after_forward=False`. Blocks stay gathered after their first forward, so
  the later denoising steps of the stage do no all-gather at all; `reshard_stage(model)` frees
  them when the stage ends. Resident during the stage: the whole unsharded model. Faster (one
  all-gather per stage instead of per step), at the cost of the full model's bytes on every rank while the stage runs.
The root module is never resharded after forward by FSDP2 (it would be re-gathered immediately),
whatever the policy.
"""

import sys
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

Reshard = Literal["per_block", "per_stage"]


def parallelize_model(model: nn.Module, mesh: DeviceMesh, *, reshard: Reshard = "per_block",
                      param_dtype: torch.dtype | None = None, offload: bool = False) -> nn.Module:
    """Shard `model` (anything with a `blocks` ModuleList: the DiT, the text encoder) over `mesh`.

    param_dtype: the dtype blocks compute in after the all-gather (bf16 on GPU halves the gather);
    None keeps the stored dtype. The model's parameters must be on the mesh's device, or with
    `offload` anywhere: then each rank's shards live in host memory (pinned on CUDA) and every
    all-gather first copies its block's shard in, non-blocking, so the prefetch of block i+1 during
    block i covers the host-to-device copy as well as the communication.
    Returns the same model, now an FSDPModule; call it as before, under torch.no_grad() (FSDP2 in
    torch 2.14 fails under inference_mode).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # start-up: when sharding

    if reshard not in ("per_block", "per_stage"):
        raise ValueError(f"reshard must be 'per_block' or 'per_stage', got {reshard!r}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"{type(model).__name__} has no `blocks` ModuleList to shard")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard == "per_block"}
    if mp is not None:
        kwargs["mp_policy"] = mp
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # Block i issues block i+1's all-gather as soon as its own forward starts.
    for cur, nxt in zip(blocks[:-1], blocks[1:]):
        cur.set_modules_to_forward_prefetch([nxt])
    return model


def prefetch_stage(model: nn.Module) -> None:
    """Start the all-gathers a sharded model's forward begins with (its root parameters and block 0), async.

    Called while the stage before runs: the next stage's first forward then finds them done (FSDP2 waits
    on a pending unshard in the pre-forward). A collective: every rank calls it at the same point of the
    schedule, as they do everything else. A no-op for a model that was not sharded.
    """
    for m in (model, model.blocks[0]):
        if _is_sharded(m):
            m.unshard(async_op=True)


def reshard_stage(model: nn.Module) -> None:
    """Free the gathered parameters kept by reshard="per_stage" (call when the stage ends).

    Harmless under "per_block" (already resharded). A no-op for a model that was not sharded.
    """
    for m in model.modules():
        if _is_sharded(m):
            m.reshard()


def _is_sharded(m: nn.Module) -> bool:
    """An FSDPModule, without importing torch.distributed.fsdp (~0.7 s of a one-process render's start): no
    module is one before parallelize_model imports it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(m, fsdp.FSDPModule)


def gpu_param_dtype(device_type: str) -> torch.dtype | None:
    """bf16 parameters for compute on GPU; on CPU keep the stored dtype (tests compare in float32)."""
    return torch.bfloat16 if device_type == "cuda" else None
