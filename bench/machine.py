"""What machine a figure was measured on, and its peak: so a figure from one machine can be read on another.

The peaks are measured, not looked up: a large fp32 / bf16 matmul and a 3x3 convolution like the decoder's,
with torch's default threads, best of a few runs. A stage's achieved FLOP/s over the peak of the kind of
work it does (matmul for the transformers, conv for the convolutional decoder and SR) is the figure that
carries over to other CPUs.
"""

import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from avatar_cli.runtime.device import cpu_info

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
MATMUL_STAGES = ("prompt", "context", "a2v")  # transformer work; reference (VAE encode), sr and decode are convolutions


def describe() -> dict:
    """CPU model, the flags that decide the fast paths, torch's capability and thread count."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    info = cpu_info()
    return {"cpu": model, "cores": os.cpu_count(), "flags": [f for f in FLAGS if f in flags],
            "torch_capability": info.capability, "native_bf16": info.native_bf16,
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def _best_rate(fn, flops: float, min_s: float = 0.3, repeats: int = 3) -> float:
    """GFLOP/s of the fastest of `repeats` timings, each at least min_s long (one call at the least)."""
    fn()  # warm-up: oneDNN picks and caches its kernel
    best = 0.0
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_s:
                break
        best = max(best, flops * n / dt / 1e9)
    return best


@torch.no_grad()
def peaks() -> dict[str, float]:
    """GFLOP/s: matmul (1024^2) and 3x3 conv (8 x 64 ch at 64^2, channels last) in float32 and bfloat16.

    Emulated bf16 runs ~1 GFLOP/s, so its shapes are cut to keep each timing near a second."""
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        slow = name == "bf16" and not cpu_info().native_bf16
        n = 256 if slow else 1024
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out[f"matmul_{name}"] = _best_rate(lambda: a @ b, 2 * n ** 3, repeats=1 if slow else 3)
        batch, side = (1, 16) if slow else (8, 64)
        x = torch.randn(batch, 64, side, side, dtype=dtype).contiguous(memory_format=torch.channels_last)
        w = torch.randn(64, 64, 3, 3, dtype=dtype).contiguous(memory_format=torch.channels_last)
        out[f"conv_{name}"] = _best_rate(lambda: F.conv2d(x, w, padding=1), 2 * 64 * 64 * 9 * batch * side * side,
                                         repeats=1 if slow else 3)
    return out


def stage_peak(stage: str, dtype: str, pk: dict[str, float]) -> float:
    kind = "matmul" if stage in MATMUL_STAGES else "conv"
    return pk[f"{kind}_{'bf16' if dtype == 'bfloat16' else 'fp32'}"]
