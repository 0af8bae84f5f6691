"""Bytes of the released Wan2.2-S2V DiT in each file format avatar reads, counted on the meta device (no weights).

For each format: the bytes its weights take in memory once loaded (runtime dtype bf16), and the largest single
weight a layer dequantizes at a time. GGUF types follow city96's conversion (tests/gguf_files.city96_type: 1-D
tensors, tensors of at most 1,024 values, `.modulation` and the 5-D convs in F32, rows that do not fill the type's
block in F16, the rest quantized); those F32/F16 tensors are cast to the runtime dtype at load. A real Q4_K_M /
Q5_K_M file mixes in Q6_K for some tensors, so it lands between the pure types listed.

    python bench/dit_file_sizes.py
"""

import sys
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT  # noqa: E402
from avatar_cli.families.wan_s2v.family import QUANTIZED  # noqa: E402
from avatar_cli.modules.module import build_meta  # noqa: E402
from avatar_cli.runtime.quantize import quantized_bytes  # noqa: E402
from tests.gguf_files import T, city96_type  # noqa: E402

BF16 = 2


def main() -> None:
    state = {k: tuple(v.shape) for k, v in build_meta(WanS2VDiT, WanDiTParams.full()).state_dict().items()}
    numel = {k: int(torch.Size(s).numel()) for k, s in state.items()}
    total = sum(numel.values())
    print(f"Wan2.2-S2V DiT: {len(state)} tensors, {total:,} parameters\n")
    print("| format | in memory (GB) | quantized tensors | largest weight dequantized per layer (MB, bf16) |")
    print("|---|---|---|---|")
    print(f"| bf16 (official shards, Diffusers, ComfyUI bf16) | {total * BF16 / 1e9:.2f} | 0 | - |")
    # The file's FP8 Linears of the blocks and injectors stay FP8 (1 byte a weight; torchao's layout counts the
    # scale per row where the file has one per tensor: 4 bytes x rows more, under 0.01 GB in all).
    model = build_meta(WanS2VDiT, WanDiTParams.full())
    paths = dict(QUANTIZED)["dit"]
    fp8 = quantized_bytes(model, "fp8", paths, torch.bfloat16)
    print(f"| ComfyUI fp8_scaled (its block and injector Linears kept FP8) | {fp8 / 1e9:.2f} | - | - |")
    print(f"| ComfyUI fp8_scaled with a LoRA (dequantized at load) | {total * BF16 / 1e9:.2f} | 0 | - |")
    for qtype in (T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_K):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes, largest, count = 0, 0, 0
        for k, s in state.items():
            t = city96_type(k, s, qtype)
            if t == qtype:
                nbytes += numel[k] // block * size
                largest, count = max(largest, numel[k]), count + 1
            else:
                nbytes += numel[k] * BF16
        print(f"| GGUF {qtype.name} | {nbytes / 1e9:.2f} | {count} | {largest * BF16 / 1e6:.0f} |")


if __name__ == "__main__":
    main()
