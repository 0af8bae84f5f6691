"""Fill a model built on the meta device straight from its safetensors files, one tensor at a time.

At 14B (32.6 GB of bf16 DiT) over 8 ranks, loading the whole checkpoint on every rank before FSDP2 shards it
needs 8 x 32.6 GB of host memory. Here each rank reads only what it keeps:

- a plain parameter or buffer: the whole tensor;
- an FSDP2 parameter (a DTensor sharded on dim 0): only this rank's rows. A safetensors tensor is stored
  row-major, so those rows are one contiguous byte range of the file.

Bytes go from the file into the tensor's own memory with positioned reads (os.preadv), so nothing is mapped:
the page cache holds the file (reclaimable, not in the process's RSS) and the only resident copy is the one
the model keeps. A dtype conversion or a device other than the host goes through one bounded staging buffer.

The model's names and shapes are checked against the files' headers first (strict: missing, unexpected and
mis-shaped keys are named), so a wrong checkpoint fails before any data is read.
"""

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from avatar_cli.errors import InputError
from avatar_cli.modules.tensor_files import (CheckpointFormatError, TensorInfo, read_safetensors_header,
                                             read_safetensors_index)

# Bytes staged per copy when the destination is not host memory of the file's dtype. Bounds the transient
# memory of a conversion to this, not to a whole tensor (a 14B DiT's largest is 315 MB).
STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorIndex:
    """A checkpoint's tensors by the model's state-dict names, known from the headers alone (no data read)."""

    tensors: Mapping[str, TensorInfo]
    source: str  # what messages name: the index or file path

    @classmethod
    def from_safetensors(cls, path: str | Path, rename: Callable[[str], str | None] | None = None) -> "TensorIndex":
        """path: a `.safetensors` file, an HF `*.safetensors.index.json`, or a folder holding one of them (the
        index when both are there). rename: file name -> model name, None to leave a tensor out (for layouts
        whose names differ from the model's); two file names may not map to one model name."""
        path = Path(path)
        if path.is_dir():
            path = _checkpoint_in(path)
        if path.name.endswith(".index.json"):
            infos = read_safetensors_index(path)
        elif path.suffix == ".safetensors":
            infos = read_safetensors_header(path)
        else:
            raise InputError(f"model: {path}: not a .safetensors file nor a .safetensors.index.json")
        if rename is None:
            return cls(infos, str(path))
        renamed: dict[str, TensorInfo] = {}
        origin: dict[str, str] = {}
        for name, info in infos.items():
            new = rename(name)
            if new is None:
                continue
            if new in renamed:
                raise CheckpointFormatError(f"{path}: {origin[new]!r} and {name!r} both map to {new!r}")
            renamed[new], origin[new] = info, name
        return cls(renamed, str(path))

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())

    def check(self, model: nn.Module) -> None:
        """Names and (global) shapes of the model's parameters and persistent buffers against the files;
        InputError naming every missing, unexpected and mis-shaped key."""
        expected = {name: tuple(t.shape) for name, (_, _, t) in _state_entries(model).items()}
        found = {name: info.shape for name, info in self.tensors.items()}
        problems = mismatch_problems(expected, found)
        if problems:
            raise InputError(f"model: {self.source}: weights don't match the config: " + "; ".join(problems))


def mismatch_problems(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The differences between a model's names -> shapes and a checkpoint's, in words (empty when they agree)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mismatched = sorted(k for k in set(expected) & set(found) if tuple(expected[k]) != tuple(found[k]))
    problems = []
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_names(unexpected)}")
    if mismatched:
        problems.append("shape mismatch: " + _names([f"{k} (file {list(found[k])}, config {list(expected[k])})"
                                                     for k in mismatched]))
    return problems


def _names(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _checkpoint_in(folder: Path) -> Path:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    files = sorted(folder.glob("*.safetensors"))
    if len(indexes) == 1:
        return indexes[0]
    if not indexes and len(files) == 1:
        return files[0]
    found = ", ".join(p.name for p in indexes or files) or "none"
    raise InputError(f"model: {folder}: expected one *.safetensors.index.json or one *.safetensors file, found {found}")


def _state_entries(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """state-dict name -> (owning module, attribute, tensor) for every parameter and persistent buffer, tied
    ones under each of their names (as state_dict lists them). Walked directly rather than through
    state_dict(), whose hooks (FSDP2's among them) may not run on meta tensors."""
    out: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                out[dot + name] = (module, name, p)
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[dot + name] = (module, name, b)
    return out


def materialize(model: nn.Module, index: TensorIndex, device: torch.device | str,
                dtype: torch.dtype | None = None) -> None:
    """Give every meta parameter and persistent buffer of `model` its data from the files, in place.

    A DTensor parameter (FSDP2 after `fully_shard` on the meta model) gets only this rank's rows, laid out as
    FSDP2 lays out its local shard (padded to the largest rank's row count, the padding zero); it lives where
    FSDP2 keeps it (host memory, pinned on CUDA, under CPUOffloadPolicy; else the mesh's device), which
    `device` must name. Anything else is read whole onto `device`. Buffers of a sharded model go to the
    mesh's device, where FSDP2 moves them. dtype: convert floating-point tensors to it (None keeps the
    file's). Strict: the model's names and shapes must equal the files' (InputError naming the differences).
    Non-persistent buffers left on meta are rebuilt by their module's `reset_buffers()`.
    """
    device = torch.device(device)
    index.check(model)
    fsdp = _fsdp_params(model)
    # FSDP2 moves a sharded model's buffers to its mesh's device (its shards may sit in host memory).
    buffer_home = next(iter(fsdp.values())).device if fsdp else device
    replaced: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its data: tied tensors are read once
    with _Reader() as reader, torch.no_grad():
        for name, (module, attr, t) in _state_entries(model).items():
            if t.device.type != "meta":
                continue
            if id(t) not in replaced:
                info = index[name]
                want = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
                if _is_dtensor(t):
                    data = _read_dtensor(reader, name, info, t, fsdp.get(id(t)), device, want)
                else:
                    data = torch.empty(info.shape, dtype=want, device=device if attr in module._parameters
                                       else buffer_home)
                    reader.read(info, 0, data)
                replaced[id(t)] = nn.Parameter(data, t.requires_grad) if isinstance(t, nn.Parameter) else data
            new = replaced[id(t)]
            if attr in module._parameters:
                module._parameters[attr] = new
            else:
                module._buffers[attr] = new
        for fsdp_param in fsdp.values():
            # FSDP2 caches the shard's padded storage; point it at the storage just filled (no copy).
            fsdp_param.reset_sharded_param()
    _reset_non_persistent(model, device)


def _is_dtensor(t: torch.Tensor) -> bool:
    """DTensor without importing torch.distributed.tensor (~0.9 s): no DTensor exists before that import."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _read_dtensor(reader: "_Reader", name: str, info: TensorInfo, param: "DTensor", fsdp_param, device: torch.device,
                  dtype: torch.dtype) -> "DTensor":
    """This rank's dim-0 rows of `info` as a DTensor parameter like `param` (same mesh and placements)."""
    # torch.distributed.tensor: imported by sharded loads only, not at every start.
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local_shape, offset = tuple(local_shape), tuple(offset)
    if local_shape[1:] != tuple(param.shape[1:]) or any(offset[1:]):
        raise ValueError(f"{name}: sharded as {param.placements}; only dim-0 sharding (FSDP2's Shard(0)) is read "
                         "by rows")
    if local_shape != tuple(param.to_local().shape):
        raise ValueError(f"{name}: local shard {list(param.to_local().shape)} is not the rows DTensor assigns "
                         f"this rank ({list(local_shape)})")
    rows = local_shape[0] if local_shape else 0
    pin = False
    padded_shape = local_shape
    if fsdp_param is not None:
        home = torch.device("cpu") if fsdp_param.offload_to_cpu else fsdp_param.device
        if device.type != home.type or None not in (device.index, home.index) and device.index != home.index:
            raise ValueError(f"{name}: FSDP2 keeps this shard on {home}, materialize was asked for {device}")
        device, pin = home, fsdp_param.pin_memory
        padded_shape = tuple(fsdp_param.padded_sharded_param_size)  # every rank's shard padded to rank 0's rows
    padded = torch.empty(padded_shape, dtype=dtype, device=device, pin_memory=pin)
    padded[rows:].zero_()
    local = padded.narrow(0, 0, rows)  # (rows, ...) contiguous: a prefix of the padded storage
    if rows:
        reader.read(info, offset[0], local)
    if fsdp_param is not None:
        fsdp_param._sharded_param_data = padded.view(-1)  # (padded numel,) what its all-gather reads
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _fsdp_params(model: nn.Module) -> dict[int, object]:
    """id(sharded parameter) -> FSDP2's record of it (FSDPParam), for every fully_shard unit in `model`."""
    from torch.distributed.fsdp import FSDPModule  # start-up: imported by sharded loads only

    out: dict[int, object] = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                out[id(fsdp_param.sharded_param)] = fsdp_param
    return out


def _reset_non_persistent(model: nn.Module, device: torch.device) -> None:
    for prefix, module in model.named_modules():
        meta = [n for n, b in module._buffers.items()
                if b is not None and b.device.type == "meta" and n in module._non_persistent_buffers_set]
        if not meta:
            continue
        reset = getattr(module, "reset_buffers", None)
        if reset is None:
            raise ValueError(f"{type(module).__name__} {prefix or '(root)'}: non-persistent buffer(s) "
                             f"{', '.join(meta)} are on meta and the module has no reset_buffers() to rebuild them")
        with torch.device(device):
            reset()
        still = [n for n in meta if module._buffers[n] is not None and module._buffers[n].device.type == "meta"]
        if still:
            raise ValueError(f"{type(module).__name__} {prefix or '(root)'}: reset_buffers() left "
                             f"{', '.join(still)} on meta")


class _Reader:
    """Positioned reads from the checkpoint's files into tensors; one descriptor per file, no mapping."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._staging: torch.Tensor | None = None

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._staging = None

    def read(self, info: TensorInfo, row0: int, out: torch.Tensor) -> None:
        """Rows [row0, row0 + len(out)) of the stored tensor (the whole tensor for 0-d) into `out`, which has
        their shape and any dtype or device."""
        if info.span is None:
            raise CheckpointFormatError(f"{info.file}: not a safetensors file (no byte ranges to read from)")
        numel = out.numel()
        if numel == 0:
            return
        row_elems = info.numel // info.shape[0] if info.shape else 1
        start = info.span[0] + row0 * row_elems * info.dtype.itemsize
        flat = out.view(-1)  # (numel,)
        if out.device.type == "cpu" and out.dtype == info.dtype:
            self._pread(info.file, _bytes_of(flat), start)
            return
        # Another dtype or device: through a bounded host buffer, a slice of elements at a time.
        step = max(1, STAGING_BYTES // info.dtype.itemsize)
        staging = self._staging_buffer(min(numel, step) * info.dtype.itemsize, pin=out.device.type == "cuda")
        for e0 in range(0, numel, step):
            k = min(step, numel - e0)
            chunk = staging[:k * info.dtype.itemsize]
            self._pread(info.file, chunk.numpy(), start + e0 * info.dtype.itemsize)
            flat[e0:e0 + k].copy_(chunk.view(info.dtype))  # converts dtype, crosses to the device

    def _staging_buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        s = self._staging
        if s is None or s.numel() < nbytes or (pin and not s.is_pinned()):
            s = self._staging = torch.empty(max(nbytes, s.numel() if s is not None else 0), dtype=torch.uint8,
                                            pin_memory=pin)
        return s

    def _pread(self, path: Path, buf, offset: int) -> None:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointFormatError(f"{path}: cannot read: {e.strerror or e}") from None
        view = memoryview(buf).cast("B")
        while view:
            try:
                n = os.preadv(fd, [view], offset)
            except OSError as e:
                raise CheckpointFormatError(f"{path}: cannot read: {e.strerror or e}") from None
            if n == 0:
                raise CheckpointFormatError(f"{path}: truncated: ends before byte {offset + len(view)}")
            view, offset = view[n:], offset + n


def _bytes_of(flat: torch.Tensor):
    """A host tensor's memory as a writable uint8 numpy array (no copy)."""
    return flat.view(torch.uint8).numpy()

