"""Synthetic GGUF files in the layout of city96's Wan GGUF quantizations (ComfyUI-GGUF `tools/convert.py` then
llama.cpp's quantizer, then `tools/fix_5d_tensors.py`): architecture "wan", the official tensor names, 1-D tensors,
tensors of at most 1,024 values, `.modulation` and the 5-D conv weights in F32, the other weights quantized where
their rows fit the type's block (else F16, as llama.cpp falls back).

gguf's writer quantizes Q8_0 itself (`gguf.quants.quantize`, bit-exact with ggml); it has no K-quant encoder, so
`quantize_q4_k` / `quantize_q6_k` below pack blocks in the K-quant layout from simple per-block scales (not
llama.cpp's search for the best ones: the reader is what is tested, and gguf's own `dequantize` is the reference
it is compared with).
"""

from pathlib import Path

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)  # (n, 2)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """(rows, k*256) float -> (rows, k*210) uint8 Q6_K blocks: 16 sub-blocks of 16, int8 scales, 6-bit values."""
    rows = x.shape[0]
    b = x.reshape(-1, 16, 16).astype(np.float32)  # (n, sub, 16)
    n = b.shape[0]
    sub = np.abs(b).max(-1) / 31  # (n, 16) step per sub-block
    d = np.maximum(sub.max(-1, keepdims=True) / 127, 1e-30)  # (n, 1)
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub / np.maximum(d16, 1e-30)), -128, 127)  # (n, 16)
    step = d16 * sc  # (n, 16)
    q = np.clip(np.round(b / np.where(step == 0, 1, step)[..., None]), -32, 31).astype(np.int32) + 32  # (n,16,16)
    q = q.reshape(n, 2, 4, 32)  # (n, half, row k, 32): value v = half*128 + k*32 + c
    lo, hi = q & 0x0F, q >> 4
    ql = np.zeros((n, 2, 64), dtype=np.uint8)
    ql[:, :, :32] = lo[:, :, 0] | (lo[:, :, 2] << 4)
    ql[:, :, 32:] = lo[:, :, 1] | (lo[:, :, 3] << 4)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).astype(np.uint8)  # (n,2,32)
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                          _f16_bytes(d16)], axis=1)  # (n, 210)
    return out.reshape(rows, -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(rows, k*256) float -> (rows, k*144) uint8 Q4_K blocks: 8 sub-blocks of 32, 6-bit scales and mins."""
    rows = x.shape[0]
    b = x.reshape(-1, 8, 32).astype(np.float32)  # (n, sub, 32)
    n = b.shape[0]
    lo = np.minimum(b.min(-1), 0)  # (n, 8)
    step = (b.max(-1) - lo) / 15  # (n, 8)
    d = np.maximum(step.max(-1, keepdims=True) / 63, 1e-30).astype(np.float16).astype(np.float32)  # (n, 1)
    dmin = np.maximum((-lo).max(-1, keepdims=True) / 63, 1e-30).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / d), 0, 63).astype(np.int32)  # (n, 8)
    mn = np.clip(np.round(-lo / dmin), 0, 63).astype(np.int32)  # (n, 8)
    scale = (d * sc)[..., None]
    q = np.clip(np.round((b + (dmin * mn)[..., None]) / np.where(scale == 0, 1, scale)), 0, 15).astype(np.int32)
    q = q.reshape(n, 4, 2, 32)  # (n, chunk, nibble, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).astype(np.uint8).reshape(n, 128)
    packed = np.zeros((n, 12), dtype=np.int32)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed.astype(np.uint8), qs], axis=1)  # (n, 144)
    return out.reshape(rows, -1)


ENCODERS = {T.Q8_0: lambda x: gguf.quants.quantize(x, T.Q8_0), T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}


def city96_type(name: str, shape: tuple[int, ...], want: "T") -> "T":
    """The GGML type city96's pipeline gives a tensor of an S2V DiT quantized to `want`."""
    n = int(np.prod(shape))
    if len(shape) <= 1 or len(shape) > 4 or n <= 1024 or ".modulation" in name:
        return T.F32
    block = gguf.GGML_QUANT_SIZES[want][0]
    return want if shape[-1] % block == 0 else T.F16


def write_dit_gguf(path: Path, state: dict[str, torch.Tensor], want: "T", arch: str = "wan",
                   prefix: str = "") -> dict[str, "T"]:
    """The DiT's official state dict as a GGUF file; returns each tensor's type."""
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    types = {}
    for name, t in state.items():
        x = t.detach().to(torch.float32).numpy()
        qt = city96_type(name, tuple(x.shape), want)
        if qt == T.F32:
            data = x
        elif qt == T.F16:
            data = x.astype(np.float16)
        else:
            data = ENCODERS[qt](x.reshape(-1, x.shape[-1]))
        writer.add_tensor(prefix + name, data, raw_dtype=qt if qt not in (T.F32, T.F16) else None)
        types[name] = qt
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types
