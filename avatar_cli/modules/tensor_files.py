"""Format-level readers for released checkpoint files, shared by every model family. Nothing here unpickles
arbitrary objects.

- safetensors (one file, or shards behind an HF `*.safetensors.index.json`): only the JSON header is read, so
  inspecting a 10 GB shard costs one small read; each tensor's absolute byte range is returned for loaders.
- `.pth` / `.bin` (torch.save zip archives): `torch.load(weights_only=True, mmap=True)`. weights_only refuses
  every global outside torch's tensor-rebuild allowlist before anything is called; mmap maps the data records
  instead of reading them, so a header-only look at an 11 GB file reads only the pickle and the zip directory.
  Anything but a flat dict of str -> tensor is refused with an error naming the file and the entry.

Every refusal is a `CheckpointFormatError`: an `InputError` (the CLI's exit 2) that is also a `ValueError`.
"""

import json
import pickle
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from avatar_cli.errors import InputError


class CheckpointFormatError(InputError, ValueError):
    """A checkpoint file is unreadable, inconsistent or not in the expected form (exit 2)."""


class UnsafeCheckpointError(CheckpointFormatError):
    """A pickled checkpoint holds something other than a flat dict of str -> tensor; it was not executed."""


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor, known without reading its data."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    # Absolute [start, end) byte range of the data in `file` (safetensors); None for .pth.
    span: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# safetensors dtype names (the format's spec) -> torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# The safetensors library refuses headers above 100 MB; a bigger length field means a corrupt or foreign file.
MAX_HEADER_BYTES = 100_000_000
ALIGN_BYTES = 64


def header_length(head: bytes) -> int:
    """The length of a safetensors file's JSON header, from the file's first 8 bytes (a little-endian u64, as the
    format's spec says); ValueError when fewer than 8 are given."""
    if len(head) < 8:
        raise ValueError(f"{len(head)} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head[:8])
    return n


def aligned(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors, each 64-byte aligned: an aligned one as it is, another copied once. safetensors hands out
    tensors at the file's (or the buffer's) byte offsets, often not aligned; BLAS then takes slower unaligned paths
    whose sums round differently from an aligned copy of the same values (a render would change with where its
    weights or its cached prompt encoding happened to sit)."""
    return {k: v if v.data_ptr() % ALIGN_BYTES == 0 else v.clone() for k, v in tensors.items()}


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo from one .safetensors file, reading only its header. Checks that every entry is
    well-formed, that its byte range matches dtype x shape, and that the file is long enough to hold it (a
    truncated download is caught here, not at load time)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            n = header_length(head)
            size = path.stat().st_size
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointFormatError(f"{path}: not a safetensors file (header length {n} of a {size}-byte file)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{path}: safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointFormatError(f"{path}: malformed header entry {name!r}: {entry!r}"[:300]) from None
        info = TensorInfo(dtype, shape, path, (data_start + begin, data_start + end))
        if end - begin != info.nbytes:
            raise CheckpointFormatError(f"{path}: entry {name!r} spans {end - begin} bytes but "
                                        f"{entry['dtype']} {list(shape)} needs {info.nbytes}")
        if data_start + end > size:
            raise CheckpointFormatError(
                f"{path}: truncated: entry {name!r} ends at byte {data_start + end}, the file has {size}")
        out[name] = info
    return out


def read_safetensors_index(index_path: str | Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo over all shards of an HF `*.safetensors.index.json`, reading only headers.

    The index and the shards must agree exactly: a name the index maps to a shard that lacks it, or a shard
    tensor the index does not list (a loader following the index would never load it), is refused by name."""
    index_path = Path(index_path)
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except OSError as e:
        raise CheckpointFormatError(f"{index_path}: cannot read: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointFormatError(
            f"{index_path}: not a safetensors index (needs a 'weight_map' of name -> file)") from None
    out: dict[str, TensorInfo] = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard:  # shards live beside the index; no paths into other folders
            raise CheckpointFormatError(f"{index_path}: shard name {shard!r} is not a plain file name")
        infos = read_safetensors_header(index_path.parent / shard)
        for name, info in infos.items():
            if weight_map.get(name) != shard:
                raise CheckpointFormatError(
                    f"{index_path.parent / shard}: holds {name!r}, which the index "
                    + (f"maps to {weight_map[name]}" if name in weight_map else "does not list"))
            out[name] = info
    for name, shard in weight_map.items():
        if name not in out:
            raise CheckpointFormatError(f"{index_path}: maps {name!r} to {shard}, which does not hold it")
    return out


_ACCEPTED = "only a flat dict of name -> tensor is accepted"
# Globals that stand for a tensor inside a torch.save pickle (used only to word a refusal, never to load).
_TENSOR_REBUILDERS = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
                      "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_parameter_with_state"}


class _Stub:
    """Stands in for every global a pickle names while we look for the offending entry: calling, building or
    filling it only records; the real global is never imported, so nothing in the file runs."""

    qualname = "?"

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        self.items = {}

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        self.items[key] = value

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _ShadowUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return type("Stub", (_Stub,), {"qualname": f"{module}.{name}"})

    def persistent_load(self, pid):
        return None


def _describe(value) -> str:
    if isinstance(value, _Stub):
        return f"an object built by {value.qualname!r}"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _offending_entry(path: Path) -> str | None:
    """Re-read the archive's data.pkl with stubs in place of every global to name the entry that torch's
    weights_only unpickler refused. Best effort: None when the pickle's shape is not a dict."""
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                return None
            top = _ShadowUnpickler(z.open(pkl[0])).load()
    except Exception:  # noqa: BLE001 -- only an error message is at stake here
        return None
    items = top.items if isinstance(top, _Stub) and top.qualname == "collections.OrderedDict" else top
    if not isinstance(items, dict):
        return f"the top-level object is {_describe(top)}, not a dict"
    for key, value in items.items():
        if not (isinstance(value, _Stub) and value.qualname in _TENSOR_REBUILDERS):
            return f"entry {key!r} is {_describe(value)}, not a tensor"
    return None


def _torch_reason(message: str) -> str:
    """The informative line of a torch.load error (its weights_only message opens with generic advice)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    for ln in lines:
        if "GLOBAL" in ln or "Unsupported" in ln:
            return ln[:200]
    return lines[0][:200] if lines else "unknown error"


def load_pth(path: str | Path, *, mmap: bool = True) -> dict[str, torch.Tensor]:
    """Load a torch.save checkpoint that must be a flat dict of str -> tensor, without executing anything.

    mmap=True (the default) maps the tensors' data instead of reading it: the call is cheap and memory grows
    only as tensors are touched. Files in torch's pre-1.6 (non-zip) format cannot be mapped and are read whole.
    Raises UnsafeCheckpointError naming the file and the entry for anything else (a pickled object, a
    nested dict, a number), CheckpointFormatError when the file is not a readable torch checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: no such file")
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        reason = _torch_reason(str(e))
        if "GLOBAL" not in reason:  # not a refused global: a broken or foreign file
            raise CheckpointFormatError(f"{path}: not a readable torch checkpoint: {reason}") from None
        # weights_only met a global outside its allowlist and stopped before calling it.
        why = _offending_entry(path) or reason
        raise UnsafeCheckpointError(f"{path}: refused: {why} (nothing in it was executed); {_ACCEPTED}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointFormatError(
            f"{path}: not a readable torch checkpoint: {_torch_reason(str(e))}") from None
    if not isinstance(obj, dict):
        raise UnsafeCheckpointError(f"{path}: refused: the top-level object is {_describe(obj)}; {_ACCEPTED}")
    for key, value in obj.items():
        if not isinstance(key, str):
            why = f"key {key!r} is {_describe(key)}, not a string"
        elif not isinstance(value, torch.Tensor):
            why = f"entry {key!r} is {_describe(value)}, not a tensor"
        else:
            continue
        raise UnsafeCheckpointError(f"{path}: refused: {why}; {_ACCEPTED}")
    return dict(obj)


def read_pth_header(path: str | Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo of a .pth without reading tensor data (zip format: the mapped data is never touched)."""
    path = Path(path)
    return {k: TensorInfo(v.dtype, tuple(v.shape), path) for k, v in load_pth(path, mmap=True).items()}


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Dispatch on the file name: *.safetensors.index.json, *.safetensors, else a torch.save file."""
    path = Path(path)
    if path.name.endswith(".index.json"):
        return read_safetensors_index(path)
    if path.suffix == ".safetensors":
        return read_safetensors_header(path)
    return read_pth_header(path)
