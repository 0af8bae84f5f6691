"""Two ranks render chunks with FSDP2 + Ulysses; one rank then dies or hangs mid-render.

argv[1]: "die" (rank 1 SIGKILLs itself between collectives), "hang" (rank 1 stops calling collectives
but stays alive) or "raise" (rank 1 raises). The surviving rank must exit non-zero on its own,
within the collective timeout, never hang; each rank prints each chunk it finished.
"""

import os
import signal
import sys
import time

import torch

from avatar_cli.families.mini.config import SIZES
from avatar_cli.runtime.distributed import init_distributed
from avatar_cli.runtime.parallelize import parallelize_model
from avatar_cli.families.mini.parallel import SequenceParallelDiT
from common import inputs, tiny_dit


@torch.no_grad()
def main(mode: str) -> None:
    d = init_distributed("cpu")
    p = SIZES["tiny"].dit
    dit = SequenceParallelDiT(parallelize_model(tiny_dit(), d.mesh), d.group)
    args = inputs(p, 5)
    for chunk in range(10_000):
        if chunk == 3 and d.rank == 1:
            print(f"rank 1: {mode} at chunk {chunk}", flush=True)
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            elif mode == "hang":
                time.sleep(600)
            else:
                raise RuntimeError("rank 1 failed on purpose")
        dit(*args)
        print(f"rank {d.rank}: chunk {chunk} done", flush=True)
    print("unreachable: rendered every chunk", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
