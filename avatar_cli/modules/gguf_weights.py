"""GGUF checkpoints (llama.cpp's format, as ComfyUI-GGUF's diffusion-model quantizations use it): read with the
`gguf` package, kept quantized in memory, dequantized per layer when a forward reads the weight.

Reading: `gguf.GGUFReader` maps the file and lists its tensors (name, GGML type, shape in GGML's reversed order)
without reading their data; `comfy.gguf.orig_shape.<name>` metadata, where present, gives a tensor's shape before
ComfyUI-GGUF's converter reshaped it. F32 / F16 / BF16 tensors become ordinary tensors. A quantized tensor stays
its file bytes (a uint8 tensor of (rows, bytes per row)) and the parameter it fills is replaced, from outside the
model, by a `torch.nn.utils.parametrize` parametrization that dequantizes those bytes whenever the module reads
its weight: the layer's forward is unchanged, and only one layer's float weight exists at a time.

Dequantization: Q8_0, Q4_K, Q5_K and Q6_K (what Q8_0 / Q6_K / Q5_K_M / Q4_K_M files hold) run as torch ports of
gguf's own numpy reference (`gguf.quants`, the same arithmetic block by block), on the device the bytes live on, so
a GPU dequantizes on the GPU; every other type gguf can dequantize goes through gguf's numpy code on the host (slow
on a GPU: the bytes cross to the host and back each forward). A type gguf cannot dequantize is refused by name.
"""

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from avatar_cli.modules.tensor_files import CheckpointFormatError

UNQUANTIZED = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
TORCH_DEQUANT = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")  # ported below; the rest through gguf's numpy reference
QK_K = 256


def _gguf():
    """The `gguf` package (the optional extra `avatar-cli[gguf]`), imported where a GGUF file is read."""
    try:
        import gguf
    except ImportError:
        raise CheckpointFormatError("reading a .gguf file needs the gguf package: pip install 'avatar-cli[gguf]'") \
            from None
    return gguf


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: str  # the GGML type's name: F32, BF16, Q8_0, Q4_K, ...
    shape: tuple[int, ...]  # torch order (the file stores GGML's reversed order)
    nbytes: int

    @property
    def quantized(self) -> bool:
        return self.qtype not in UNQUANTIZED


def supported(qtype: str) -> bool:
    """Whether a GGML type can be read: unquantized, ported, or dequantizable by gguf's numpy reference."""
    if qtype in UNQUANTIZED or qtype in TORCH_DEQUANT:
        return True
    gguf = _gguf()
    t = getattr(gguf.GGMLQuantizationType, qtype, None)
    if t is None:
        return False
    try:  # gguf raises NotImplementedError for the types its numpy code cannot dequantize
        block, size = gguf.GGML_QUANT_SIZES[t]
        gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), t)
        return True
    except (NotImplementedError, KeyError, ValueError):
        return False


class GGUFFile:
    """A GGUF file's metadata and tensor list (headers only until `raw` or `tensor` is asked for)."""

    def __init__(self, path: str | Path):
        gguf = _gguf()
        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(str(path))
        except Exception as e:  # gguf raises ValueError/struct errors for a file that is not GGUF
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointFormatError(f"{path}: not a readable GGUF file ({why})") from None
        self.tensors: dict[str, GGUFTensor] = {}
        self._by_name = {}
        for t in self._reader.tensors:
            shape = self._orig_shape(t.name) or tuple(int(v) for v in reversed(t.shape.tolist()))
            qtype = gguf.GGMLQuantizationType(t.tensor_type).name
            self.tensors[t.name] = GGUFTensor(t.name, qtype, shape, int(t.n_bytes))
            self._by_name[t.name] = t

    def field(self, key: str) -> str | int | None:
        """A string or integer metadata field (general.architecture, general.file_type, ...), None if absent."""
        f = self._reader.get_field(key)
        if f is None or not f.data:
            return None
        part = f.parts[f.data[-1]]
        if part.dtype == np.uint8:
            return bytes(part).decode("utf-8", "replace")
        return int(part[0])

    def _orig_shape(self, name: str) -> tuple[int, ...] | None:
        f = self._reader.get_field(f"comfy.gguf.orig_shape.{name}")
        if f is None:
            return None
        return tuple(int(f.parts[i][0]) for i in f.data)

    def raw(self, name: str) -> torch.Tensor:
        """The stored bytes of a quantized tensor, (rows, bytes per row) uint8, copied out of the mapping."""
        data = self._by_name[name].data
        return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1, data.shape[-1]).copy())

    def tensor(self, name: str) -> torch.Tensor:
        """An unquantized tensor in its stored dtype and torch shape."""
        info = self.tensors[name]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(np.ascontiguousarray(self._by_name[name].data).copy())
        if info.qtype == "BF16":
            data = data.view(torch.bfloat16)
        return data.reshape(info.shape)


# --- dequantization -------------------------------------------------------------------------------------------

def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 -> (n, 1) float32 from little-endian float16."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in 12 bytes of a Q4_K / Q5_K block (gguf Q4_K.get_scale_min)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4).to(torch.int32)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]  # (n, 4) each
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)  # (n, 8)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)  # (n, 8)
    return sc.to(torch.float32), mn.to(torch.float32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])  # (n, 1)
    return blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d  # (n, 32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # (n, 1)
    sc, mn = _scale_min_k4(blocks[:, 4:16])  # (n, 8)
    qs = blocks[:, 16:].to(torch.int32).reshape(n, 4, 1, 32)  # (n, 4 chunks, 1, 32)
    q = (qs >> torch.tensor([0, 4], dtype=torch.int32, device=blocks.device).view(1, 1, 2, 1)) & 0x0F
    q = q.reshape(n, 8, 32).to(torch.float32)  # (n, 8 sub-blocks, 32)
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # (n, 1)
    sc, mn = _scale_min_k4(blocks[:, 4:16])  # (n, 8)
    qh = blocks[:, 16:48].to(torch.int32).reshape(n, 1, 32)  # (n, 1, 32)
    qs = blocks[:, 48:].to(torch.int32).reshape(n, 4, 1, 32)  # (n, 4, 1, 32)
    dev = blocks.device
    ql = ((qs >> torch.tensor([0, 4], dtype=torch.int32, device=dev).view(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    hi = ((qh >> torch.arange(8, dtype=torch.int32, device=dev).view(1, 8, 1)) & 0x01)  # (n, 8, 32)
    q = (ql | (hi << 4)).to(torch.float32)  # (n, 8, 32)
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    dev = blocks.device
    ql = blocks[:, :128].to(torch.int32).reshape(n, 2, 1, 64)  # (n, halves, 1, 64)
    qh = blocks[:, 128:192].to(torch.int32).reshape(n, 2, 1, 32)  # (n, halves, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)  # (n, 16)
    d = _f16(blocks[:, 208:210]) * scales  # (n, 16)
    lo = ((ql >> torch.tensor([0, 4], dtype=torch.int32, device=dev).view(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    hi = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=dev).view(1, 1, 4, 1)) & 0x03).reshape(n, 8, 32)
    q = ((lo | (hi << 4)) - 32).reshape(n, 16, 16).to(torch.float32)  # (n, 16 sub-blocks, 16)
    return (d.unsqueeze(-1) * q).reshape(n, QK_K)


_PORTS = {"Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of `shape` that a quantized tensor's bytes (rows, bytes per row) hold."""
    gguf = _gguf()
    t = getattr(gguf.GGMLQuantizationType, qtype)
    block, size = gguf.GGML_QUANT_SIZES[t]
    port = _PORTS.get(qtype)
    if port is not None:
        blocks = raw.reshape(-1, size)  # (n blocks, block bytes)
        return port(blocks).reshape(shape)
    out = gguf.quants.dequantize(raw.cpu().numpy(), t)  # gguf's numpy reference, on the host
    return torch.from_numpy(np.ascontiguousarray(out)).to(raw.device).reshape(shape)


class Dequantize(nn.Module):
    """The parametrization of one quantized weight: its stored bytes -> the float weight, in the dtype of `like`,
    a 0-d parameter that `model.to(dtype)` casts with the rest of the model (the bytes, uint8, stay as they are).
    A parameter rather than a buffer: offload moves parameters only."""

    def __init__(self, qtype: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.qtype, self.shape = qtype, tuple(shape)
        self.like = nn.Parameter(torch.zeros((), dtype=dtype), requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        """What the weight dequantizes to, known without dequantizing it."""
        return self.like.dtype

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        return dequantize(raw, self.qtype, self.shape).to(self.like.dtype)  # (shape) the layer's weight

    def extra_repr(self) -> str:
        return f"{self.qtype}, shape={list(self.shape)}"


def attach_quantized(module: nn.Module, attr: str, raw: torch.Tensor, qtype: str, shape: tuple[int, ...],
                     dtype: torch.dtype = torch.float32) -> None:
    """Make `module.<attr>` the dequantization of `raw` (its stored bytes), from outside the module: the
    parameter becomes the bytes, and reading the attribute dequantizes them (torch.nn.utils.parametrize)."""
    if hasattr(module, "parametrizations") and attr in module.parametrizations:
        raise ValueError(f"{type(module).__name__}.{attr} is already parametrized")
    module._parameters.pop(attr, None)
    module.register_parameter(attr, nn.Parameter(raw, requires_grad=False))
    parametrize.register_parametrization(module, attr, Dequantize(qtype, shape, dtype), unsafe=True)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes held by a model's parameters and buffers as stored (quantized weights at their packed size)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def fill_from_gguf(model: nn.Module, file: GGUFFile, names: Mapping[str, str], dtype: torch.dtype) -> None:
    """Fill a model built on the meta device from a GGUF file: model name -> file name for every parameter and
    persistent buffer; unquantized tensors become plain tensors in `dtype` (floating ones), quantized ones stay
    their bytes behind a Dequantize parametrization producing `dtype`."""
    entries = {}
    for prefix, module in model.named_modules():
        dot = prefix + "." if prefix else ""
        for attr, p in list(module._parameters.items()) + list(module._buffers.items()):
            if p is not None and not (attr in module._buffers and attr in module._non_persistent_buffers_set):
                entries[dot + attr] = (module, attr, p)
    with torch.no_grad():
        for name, (module, attr, t) in entries.items():
            info = file.tensors[names[name]]
            if tuple(info.shape) != tuple(t.shape):
                raise CheckpointFormatError(f"{file.path}: {info.name} has shape {list(info.shape)}, the model "
                                            f"{name} {list(t.shape)}")
            if info.quantized:
                attach_quantized(module, attr, file.raw(info.name), info.qtype, info.shape, dtype)
                continue
            data = file.tensor(info.name)
            data = data.to(dtype) if data.is_floating_point() else data
            if attr in module._parameters:
                module._parameters[attr] = nn.Parameter(data, requires_grad=False)
            else:
                module._buffers[attr] = data
