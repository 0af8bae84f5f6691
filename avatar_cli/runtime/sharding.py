"""Shard or replicate: which of a family's big models FSDP2 shards over the ranks, chosen from device memory.

Sharding a model saves memory but costs an all-gather of (ranks - 1) / ranks of its weights on every forward
(for Wan2.2-S2V's 32.6 GB DiT over 8 ranks: 28.5 GB per rank per forward, 80 forwards per clip). A replica
costs nothing per forward. So where the replicas fit, replicating is the faster choice, and `auto` makes it;
where they do not, the models are sharded. Ulysses sequence parallelism is independent of this: the ranks
still split each forward's tokens.
"""

from collections.abc import Mapping
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class ShardChoice:
    sharded: tuple[str, ...]  # the components FSDP2 shards; the rest of the plan's big ones are replicated
    reason: str  # one line for the log


def choose_sharding(candidates: tuple[str, ...], sizes: Mapping[str, int], world: int, free_bytes: int | None,
                    working_bytes: int, mode: str = "auto", resident: Mapping[str, int] | None = None) -> ShardChoice:
    """candidates: the family's shardable components (its ParallelPlan.sharded), biggest benefit first.
    sizes: every component's bytes at the runtime dtype. free_bytes: the device's free memory (None: unknown,
    as on a CPU). working_bytes: activations and workspace to keep free. resident: each candidate's bytes on one
    rank while it runs when sharded (placement.resident_bytes: its shard and gathered blocks); by default an
    estimate, 1/world plus 1/40 of it.

    mode "shard" / "replicate" force the choice; "auto" replicates as many candidates (in order) as fit
    beside everything else, and shards the rest."""
    if mode not in ("auto", "shard", "replicate"):
        raise ValueError(f"runtime.shard must be auto, shard or replicate, not {mode!r}")
    if world <= 1:
        return ShardChoice((), "one rank: nothing to shard")
    if not candidates:
        return ShardChoice((), "nothing the family shards is loaded: every model replicated")
    if mode == "shard":
        return ShardChoice(candidates, "runtime.shard: shard")
    if mode == "replicate":
        return ShardChoice((), "runtime.shard: replicate")
    if free_bytes is None:
        return ShardChoice(candidates, "device memory unknown (a CPU): sharded")
    others = sum(b for name, b in sizes.items() if name not in candidates)
    sharded = list(candidates)
    replicated: list[str] = []

    shard_bytes = dict(resident or {})
    for n in candidates:
        shard_bytes.setdefault(n, sizes[n] // world + sizes[n] // 40)

    def need() -> int:
        return others + sum(sizes[n] for n in replicated) + sum(shard_bytes[n] for n in sharded) + working_bytes

    for name in candidates:
        sharded.remove(name)
        replicated.append(name)
        if need() > free_bytes:
            replicated.pop()
            sharded.append(name)
    moved = sum(sizes[n] * (world - 1) // world for n in sharded)
    if not sharded:
        why = (f"replicating {', '.join(replicated)}: {need() / GB:.1f} GB of {free_bytes / GB:.1f} GB free fits, "
               f"and a replica all-gathers nothing per forward")
    elif replicated:
        why = (f"replicating {', '.join(replicated)}, sharding {', '.join(sharded)}: replicas of all would not fit "
               f"in {free_bytes / GB:.1f} GB free; the shards all-gather {moved / GB:.1f} GB per rank per forward")
    else:
        why = (f"sharding {', '.join(sharded)}: a replica would not fit in {free_bytes / GB:.1f} GB free; "
               f"each forward all-gathers {moved / GB:.1f} GB per rank")
    return ShardChoice(tuple(sharded), why)
