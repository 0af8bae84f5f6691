"""Host memory of loading a wan-s2v DiT checkpoint FSDP2-sharded over 2 gloo ranks.

Writes a random checkpoint of the WanS2VDiT architecture in the release's layout (4 bf16 shards
`diffusion_pytorch_model-0000{1..4}-of-00004.safetensors` + `diffusion_pytorch_model.safetensors.index.json`, the
release's key names), then runs `torchrun --nproc_per_node 2` on this file: each rank builds the model lazily
(`lazy_module`, on meta) and `place()`s it sharded, which reads only the rank's rows of every tensor. Each rank
reports its RSS just before loading (the baseline), its peak RSS while loading (VmHWM, reset through
/proc/self/clear_refs just before, and a 2 ms sampling thread as a check), the checkpoint's bytes, the ratio
(peak - baseline) / checkpoint bytes and the load time. Target: ratio < 0.6 on every rank (each keeps half).

    python bench/load_memory.py [--dir /tmp/avatar-load-bench] [--size bench|test] [--cache cold|warm] [--eager]
                                [--append]

--size bench: >= 1.5 B parameters (3.1 GB); test: ~120 MB (what tests/test_loading.py runs). --cache cold first
evicts the checkpoint's pages from the page cache (posix_fadvise DONTNEED on its own files only), so the load
reads the disk; warm reads what the write left cached. --eager measures the way before, for comparison: every
rank reads every shard whole (safetensors.load_file), then shards. The checkpoint is kept and reused by later
runs. --append adds the table to bench/results.md.
"""

import argparse
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from avatar_cli.families.base import ParallelPlan  # noqa: E402
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT  # noqa: E402
from avatar_cli.modules.loading import TensorIndex  # noqa: E402
from avatar_cli.modules.module import build_meta, lazy_module, save_sharded_safetensors  # noqa: E402

# Architecture fields replaced in the released 14B's (WanDiTParams.full()); everything else is the release's.
SIZES = {
    # 1.567 B parameters, 3.13 GB in bf16. Injectors after blocks 0..19 in steps the official mapping allows
    # (block 1 would also match blocks 10-19 there, so it is left out).
    "bench": dict(dim=2048, ffn_dim=8192, num_heads=16, num_layers=20, text_dim=4096, audio_dim=1024,
                  audio_inject_layers=(0, 4, 8, 12, 16, 19)),
    # ~120 MB: big enough that the allocator's and the interpreter's noise is small beside half of it.
    "test": dict(dim=512, ffn_dim=2048, num_heads=8, num_layers=12, text_dim=512, audio_dim=256,
                 audio_inject_layers=(0, 4, 8)),
}
TARGET_RATIO = 0.6
SAMPLE_S = 0.002


def params(size: str) -> WanDiTParams:
    return dataclasses.replace(WanDiTParams.full(), **SIZES[size])


def write_checkpoint(folder: Path, p: WanDiTParams, seed: int = 0) -> Path:
    """Random bf16 weights (N(0, 0.02)) in the release's 4-shard layout; returns the index. Reused when the folder
    already holds a checkpoint of this architecture."""
    model = build_meta(WanS2VDiT, p)
    index_path = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index_path.is_file():
        try:
            TensorIndex.from_safetensors(index_path).check(model)
            return index_path
        except Exception as e:  # noqa: BLE001 -- anything else there is rewritten
            print(f"rewriting {folder}: {e}", flush=True)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < total * 1.1:
        raise SystemExit(f"{folder}: {free / 1e9:.1f} GB free, the checkpoint needs {total / 1e9:.1f} GB")
    g = torch.Generator().manual_seed(seed)

    def make(name: str) -> torch.Tensor:
        return (torch.randn(shapes[name], generator=g) * 0.02).to(torch.bfloat16)

    t0 = time.perf_counter()
    index_path = save_sharded_safetensors(folder, {k: torch.Size(s).numel() * 2 for k, s in shapes.items()}, make,
                                          shards=4)
    print(f"wrote {total / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s to {folder}", flush=True)
    return index_path


def evict(index_path: Path) -> None:
    """Drop the checkpoint's own pages from the page cache (nothing else's), so the next read is from disk."""
    for path in [index_path, *index_path.parent.glob("diffusion_pytorch_model-*.safetensors")]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: '5' to clear_refs); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """The highest RSS (bytes) of this process between enter and exit: VmHWM after a reset, and a sampling
    thread beside it (the only figure where the reset is not allowed)."""

    def __enter__(self) -> "PeakRSS":
        self.hwm_reset = _reset_peak()
        self.sampled = _status_kib("VmRSS") * 1024
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sampled = max(self.sampled, _status_kib("VmRSS") * 1024)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sampled = max(self.sampled, _status_kib("VmRSS") * 1024)
        self.hwm = _status_kib("VmHWM") * 1024 if self.hwm_reset else None
        self.peak = max(self.sampled, self.hwm or 0)


def load_eager(folder: Path, module) -> None:
    """The way before lazy loading, for comparison: every rank reads every shard whole into the meta model."""
    from safetensors.torch import load_file

    for shard in sorted(folder.glob("diffusion_pytorch_model-*.safetensors")):
        module.model.load_state_dict(load_file(shard), strict=False, assign=True)


@torch.no_grad()
def worker(folder: Path, size: str, eager: bool) -> None:
    """One torchrun rank: lazy build, then place() sharded with RSS watched; rank 0 prints every rank's JSON.
    eager: read the whole checkpoint on every rank first (inside the watched span), as before lazy loading."""
    from avatar_cli.runtime.device import Runtime
    from avatar_cli.runtime.distributed import init_distributed
    from avatar_cli.runtime.placement import place

    d = init_distributed("cpu")
    p = params(size)
    index = TensorIndex.from_safetensors(folder)
    # Before the baseline: the meta build, and what sharding imports on first use (torch._dynamo, FSDP2, DTensor):
    # ~100 MB of one-time torch set-up, not memory the load holds.
    module = lazy_module("dit", WanS2VDiT, p, index)
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    plan = ParallelPlan(sharded=("dit",), sp_heads=p.num_heads)
    gc.collect()
    d.barrier()  # both ranks start reading together, as they would in a render
    baseline = _status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    with PeakRSS() as rss:
        if eager:
            load_eager(folder, module)
        place({"dit": module}, Runtime(torch.device("cpu"), torch.bfloat16), d, plan=plan)
    seconds = time.perf_counter() - t0
    local = sum(t.to_local().nbytes for t in module.model.parameters())
    row = {"rank": d.rank, "baseline_mb": baseline / 2**20, "peak_mb": rss.peak / 2**20,
           "hwm_mb": rss.hwm / 2**20 if rss.hwm is not None else None, "sampled_peak_mb": rss.sampled / 2**20,
           "delta_mb": (rss.peak - baseline) / 2**20, "checkpoint_mb": index.nbytes / 2**20,
           "local_shard_mb": local / 2**20, "ratio": (rss.peak - baseline) / index.nbytes, "load_s": seconds,
           "params": module.num_params}
    rows: list[dict] = [{}] * d.world_size
    torch.distributed.all_gather_object(rows, row)
    if d.is_main:
        print(json.dumps(rows), flush=True)
    d.destroy()


def run_ranks(folder: Path, size: str, eager: bool = False, timeout_s: float = 1800) -> list[dict]:
    """torchrun --nproc_per_node 2 on this file's worker; every rank's figures."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", AVATAR_DIST_TIMEOUT_S="600")  # a cold 3 GB read outlasts the default 30 s
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", str(folder), "--size", size, *(["--eager"] if eager else [])]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in r.stdout.splitlines() if line.startswith("[")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"load_memory worker failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    out = ["| rank | baseline RSS MB | peak RSS MB | peak - baseline MB | local shard MB | checkpoint MB | ratio | "
           "load s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['rank']} | {r['baseline_mb']:.0f} | {r['peak_mb']:.0f} | {r['delta_mb']:.0f} | "
                   f"{r['local_shard_mb']:.0f} | {r['checkpoint_mb']:.0f} | {r['ratio']:.3f} | {r['load_s']:.1f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/avatar-load-bench"))
    ap.add_argument("--size", choices=sorted(SIZES), default="bench")
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold")
    ap.add_argument("--eager", action="store_true", help="for comparison: every rank reads the whole checkpoint")
    ap.add_argument("--append", action="store_true", help="add the table to bench/results.md")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.size, args.eager)
        sys.stdout.flush()
        os._exit(0)  # like an avatar torchrun worker: no C++ teardown at exit
    folder = args.dir / args.size
    index_path = write_checkpoint(folder, params(args.size))
    if args.cache == "cold":
        evict(index_path)
    rows = run_ranks(folder, args.size, args.eager)
    ok = all(r["ratio"] < TARGET_RATIO for r in rows)
    print(table(rows))
    print(f"{'PASS' if ok else 'FAIL'}: every rank's (peak - baseline) / checkpoint < {TARGET_RATIO}", flush=True)
    if args.append:
        from machine import describe

        m = describe()
        cmd = " ".join(["python bench/load_memory.py", *sys.argv[1:]])
        how = "; EAGER: every rank reads the whole checkpoint" if args.eager else ""
        section = (f"\n## Loading memory, {datetime.now():%Y-%m-%d %H:%M}\n\n"
                   f"- machine: {m['cpu']}, {m['cores']} CPU cores, torch {m['torch']}\n"
                   f"- command: `{cmd}` ({rows[0]['params']:,} parameters, bf16, 4 shards; page cache "
                   f"{args.cache}; 2 gloo ranks, 1 thread each{how})\n\n{table(rows)}\n\n"
                   f"{'Met' if ok else 'Not met'}: (peak - baseline) / checkpoint bytes < {TARGET_RATIO} on every "
                   "rank.\n")
        with open(ROOT / "bench" / "results.md", "a") as f:
            f.write(section)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
