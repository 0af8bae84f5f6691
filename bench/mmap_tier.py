"""The mmap host tier's staging rate on this machine: blocks of a safetensors file copied from the page cache into a
staging buffer (runtime/offload.py `_MappedGroup.fill`), as `runtime.offload_host: mmap` stages each DiT block
before its copy to the GPU. Warm page cache (the file was just written); bf16 -> bf16 (bytes as they are) and
bf16 -> float32 (a cast while staging).

    python bench/mmap_tier.py [--block-mb 700] [--blocks 4] [--repeat 3]

Prints GB/s per case. The GPU copy after it (pinned -> device) is not measured here: bench/gpu_check.py.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from avatar_cli.modules.tensor_files import read_safetensors_header  # noqa: E402
from avatar_cli.runtime.offload import BlockOffloader, HostTransfer, MappedCheckpoint  # noqa: E402


class Blocks(nn.Module):
    def __init__(self, n: int, rows: int, cols: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(cols, rows, bias=False) for _ in range(n))
        self.head = nn.Linear(cols, 1, bias=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-mb", type=float, default=700.0, help="bytes per block in bf16 (the DiT's: 703 MB)")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    cols = 5120
    rows = int(a.block_mb * 1e6 / 2 / cols)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "blocks.safetensors"
        with torch.device("meta"):
            shapes = {n: p.shape for n, p in Blocks(a.blocks, rows, cols).named_parameters()}
        save_file({n: torch.randn(s, dtype=torch.float32).to(torch.bfloat16) for n, s in shapes.items()}, str(path))
        for compute in (torch.bfloat16, torch.float32):
            with torch.device("meta"):
                model = Blocks(a.blocks, rows, cols)
            off = BlockOffloader(model, HostTransfer(), mapped=MappedCheckpoint(read_safetensors_header(path)),
                                 dtype=compute)
            stage = off._staging[0]
            best = float("inf")
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                for g in off.blocks:
                    g.fill(stage)
                best = min(best, time.perf_counter() - t0)
            moved = sum(g.nbytes for g in off.blocks) * (2 if compute == torch.bfloat16 else 1) / 2  # file bytes
            print(f"bf16 file -> {str(compute).removeprefix('torch.')} staging: {a.blocks} blocks of "
                  f"{moved / a.blocks / 1e6:.0f} MB in {best:.3f} s = {moved / best / 1e9:.2f} GB/s (file bytes)")


if __name__ == "__main__":
    main()
