"""torchrun --nproc_per_node 2: a render with runtime.offload=block over 2 ranks, the CPU standing in for the GPU.

argv[1]: a job file. The sharded models (DiT, text encoder) keep their shards in host memory (FSDP2's
CPUOffloadPolicy), the replicated ones stream through a HostTransfer; the video must be the same bytes as
the same 2-rank render without offload, and after it nothing may be left on the stand-in device.
Prints one JSON line on rank 0; exits non-zero on any mismatch.
"""

import json
import sys
from pathlib import Path

from avatar_cli import render as rendering

from avatar_cli.job import resolve

from avatar_cli.report import QuietReporter
from avatar_cli.runtime.distributed import shutdown_distributed
from avatar_cli.runtime.offload import HostTransfer
from avatar_cli.spec import load_job
from common import exit_now


def render(job: Path, name: str, offload: str, cache: rendering.ModelCache) -> dict:
    # No text cache: the text encoder is sharded and offloaded too (a cached prompt would leave it unloaded).
    spec = load_job(job, [f"runtime.offload={offload}", "runtime.dtype=float32", "runtime.text_cache=off"],
                    output=str(job.parent / name))
    return rendering.render(resolve(spec, force=True), QuietReporter(0), models=cache)


def main() -> int:
    job = Path(sys.argv[1])
    plain = render(job, "plain.mp4", "none", rendering.ModelCache())
    t = HostTransfer()
    cache = rendering.ModelCache(transfer=t, free_bytes=1 << 30)
    off = render(job, "offload.mp4", "block", cache)
    (modules, placement), = cache.loaded.values()
    fsdp_offload = {name: all(fp.offload_to_cpu for fp in _fsdp_params(model)) and bool(_fsdp_params(model))
                    for name, model in placement.sharded.items()}
    result = {
        "ranks": off["ranks"], "same_video": off["frames_digest"] == plain["frames_digest"],
        "offload": placement.offload, "offloaders": sorted(placement.offloaders), "fsdp_offload": fsdp_offload,
        "live_bytes": t.live_bytes, "peak_bytes": t.peak_bytes, "loads": len(t.loads),
    }
    ok = (result["same_video"] and result["offload"] == "block" and result["offloaders"] == ["audio", "sr", "vae"]
          and all(fsdp_offload.values()) and sorted(fsdp_offload) == ["dit", "text"] and t.live_bytes == 0
          and 0 < t.peak_bytes)
    if off["ranks"] == 2 and int(__import__("os").environ["RANK"]) == 0:
        print(json.dumps({"ok": ok, **result}), flush=True)
    shutdown_distributed()
    return 0 if ok else 1


def _fsdp_params(model):
    from torch.distributed.fsdp import FSDPModule

    found = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            found += group.fsdp_params if group is not None else []
    return found


if __name__ == "__main__":
    exit_now(main())
