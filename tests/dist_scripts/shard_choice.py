"""torchrun --nproc_per_node 2: place() with shard="replicate" keeps whole DiT replicas (no FSDP2), with
shard="shard" FSDP2 shards, and with shard="auto" and ample free memory replicates; the sequence-parallel
forward is the same either way. Prints one JSON line on rank 0."""

import copy
import json

import torch
from torch.distributed.tensor import DTensor

from avatar_cli.families.base import ParallelPlan
from avatar_cli.families.mini.parallel import SequenceParallelDiT
from avatar_cli.modules.module import Module
from avatar_cli.runtime.device import Runtime
from avatar_cli.runtime.distributed import init_distributed
from avatar_cli.runtime.placement import place
from common import exit_now, inputs, tiny_dit


@torch.no_grad()  # not inference_mode: FSDP2 fails under it in torch 2.14
def main() -> int:
    d = init_distributed("cpu")
    plain = tiny_dit(seed=0)
    p = plain.params
    plan = ParallelPlan(sharded=("dit",), sequence_parallel="dit", sp_wrap=SequenceParallelDiT, sp_heads=p.heads)
    rt = Runtime(torch.device("cpu"), torch.float32, "asked for")
    x = inputs(p, frames=5)
    want = plain(*x)
    out, res = {}, {}
    for mode, free in (("replicate", None), ("shard", None), ("auto", 10**12), ("auto", None)):
        modules = {"dit": Module("dit", copy.deepcopy(plain), "test")}
        placement = place(modules, rt, d, offload="none", plan=plan, shard=mode, free_bytes=free)
        dit = modules["dit"].model
        key = f"{mode}/{'ample' if free else 'unknown'}"
        res[key] = {"fsdp": bool(placement.sharded),
                    "dtensor": isinstance(dit.dit.blocks[0].attn.qkv.weight, DTensor),
                    "rel": float((dit(*x) - want).abs().max() / want.abs().max())}
    if d.rank == 0:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    exit_now(main())
