"""Offload for the single-GPU path: models that are not running live in pinned host memory.

`BlockOffloader` (policy "block") streams a model's transformer blocks onto the device just in time:
- every block's parameters live in one contiguous pinned host slab (one copy per block, no per-tensor calls);
- two device buffers, each the size of the largest block: while block n computes from one, block n+1 is
  copied into the other on a side stream (double buffer). The compute stream waits on the copy's
  event, and a copy into a buffer waits on the event recorded after the previous user's kernels;
  nothing calls synchronize;
- the parameters outside the blocks (embedders, final layer) are loaded once per stage; `prefetch()`
  issues that copy and block 0's while the stage before still computes, so the handoff waits for no copy;
- when the stage ends the device copies are dropped by pointing each `param.data` back at its host
  view: nothing is copied back (inference never changes a weight).
`ModelOffloader` (policy "model") does the same with the whole model as one slab: on the device for
its stage, dropped after.

Where the blocks wait (`runtime.offload_host`, chosen by `host_tier_choice`): pinned host slabs as above, or, for a
model read lazily from safetensors, the memory-mapped checkpoint itself (`MappedCheckpoint`): each block is staged
from the page cache into one of two pinned buffers the size of the largest block, cast to the compute dtype where
the file's differs, then copied like a slab; a staging buffer is refilled only once the copy out of it has landed
(`Transfer.host_wait`). The host then holds the non-block parameters and the two staging buffers, not the blocks.

A block comes in at its forward pre-hook: every model offloaded this way calls its blocks (the wan-s2v streaming
forward too, with its per-row arguments), so the hook fires for each.

The device sits behind `Transfer`, so tests run the same state machine with the CPU standing in for
the GPU (`HostTransfer`: copies are plain copies, events are no-ops, allocations are counted).
Everything is attached from outside with forward pre-hooks; the models' forward is untouched.
torch 2.14's FSDP2 CPU offload copies synchronously at world size 1, hence this module.
"""

import contextlib
import mmap
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from avatar_cli.runtime.quantize import is_quantized, stored_bytes

ALIGN = 256  # bytes; keeps every view aligned for any dtype and for vectorized copies

OffloadPolicy = Literal["auto", "none", "model", "block"]


class Transfer(Protocol):
    """What the offloader needs from a device: memory on both sides, async copies, events."""

    def host_empty(self, nbytes: int) -> torch.Tensor: ...  # uint8, pinned where that exists
    def device_empty(self, nbytes: int) -> torch.Tensor: ...  # uint8 on the compute device
    def free(self, buf: torch.Tensor) -> None: ...  # the offloader drops its last reference after this
    def load(self, dst: torch.Tensor, src: torch.Tensor, after: Any, label: str) -> Any: ...  # -> done event
    def compute_mark(self) -> Any: ...  # event after all compute queued so far
    def wait(self, event: Any) -> None: ...  # compute waits for `event` (not the host)
    def host_wait(self, event: Any) -> None: ...  # the host waits until the copy behind `event` has landed
    def is_device(self, t: torch.Tensor) -> bool: ...


class CudaTransfer:
    """Copies on a dedicated load stream; ordering by CUDA events only."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_empty(self, nbytes: int) -> torch.Tensor:
        # Allocated on the load stream, the stream that writes it first. Memory the compute stream freed
        # is then never handed to a copy that could overwrite it while a kernel still reads it (the caching
        # allocator reuses a block only on the stream it belongs to).
        with torch.cuda.stream(self.stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def free(self, buf: torch.Tensor) -> None:
        # The compute stream read it: the allocator must not reuse it (for the next copy) before those
        # kernels are done. record_stream makes it wait on an event, not the host.
        buf.record_stream(torch.cuda.current_stream(self.device))

    def load(self, dst: torch.Tensor, src: torch.Tensor, after: Any, label: str) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)  # the buffer's previous block has finished computing
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def compute_mark(self) -> torch.cuda.Event:
        e = torch.cuda.Event()
        e.record(torch.cuda.current_stream(self.device))
        return e

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def is_device(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"


class HostTransfer:
    """The CPU standing in for the GPU: same calls, and a log of what happened.

    Like a side stream, a copy does not land when issued: it lands when compute waits on its
    event (copies land in issue order). Fresh "device" memory is filled with 0xFF bytes (NaN in
    floats), so a block used without waiting for its copy gives a visibly wrong result. A copy
    into a buffer whose contents were put to use must be ordered after a compute mark taken
    since then (on a GPU it would otherwise overwrite weights a kernel is still reading).
    """

    def __init__(self) -> None:
        self.loads: list[str] = []  # labels, in issue order
        self.live_bytes = 0
        self.peak_bytes = 0
        self._device_ptrs: dict[int, int] = {}  # data_ptr -> nbytes of each "device" allocation
        self._queue: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (event id, dst, src) in flight
        self._next_event = 0
        self._clock = 0  # advances at every landing and compute mark
        self._in_use_since: dict[int, int] = {}  # buffer data_ptr -> clock when its last copy landed

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def device_empty(self, nbytes: int) -> torch.Tensor:
        buf = torch.full((nbytes,), 0xFF, dtype=torch.uint8)
        self._device_ptrs[buf.data_ptr()] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return buf

    def free(self, buf: torch.Tensor) -> None:
        if any(dst.untyped_storage().data_ptr() == buf.data_ptr() for _, dst, _ in self._queue):
            raise RuntimeError("freed a device buffer with a copy into it still in flight")
        self._in_use_since.pop(buf.data_ptr(), None)
        self.live_bytes -= self._device_ptrs.pop(buf.data_ptr())

    def load(self, dst: torch.Tensor, src: torch.Tensor, after: Any, label: str) -> int:
        since = self._in_use_since.get(dst.untyped_storage().data_ptr())
        if since is not None and (after is None or after <= since):
            raise RuntimeError(f"copy of {label} into a buffer whose last user may still be computing")
        self.loads.append(label)
        self._next_event += 1
        self._queue.append((self._next_event, dst, src))
        return self._next_event

    def compute_mark(self) -> int:
        self._clock += 1  # compute is synchronous here: everything queued so far has run
        return self._clock

    def wait(self, event: int) -> None:
        while self._queue and self._queue[0][0] <= event:
            _, dst, src = self._queue.pop(0)
            dst.copy_(src)
            self._clock += 1
            self._in_use_since[dst.untyped_storage().data_ptr()] = self._clock

    def host_wait(self, event: int) -> None:
        self.wait(event)  # compute is the host here: landing the copy is all there is to wait for

    def is_device(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(p <= ptr < p + n for p, n in self._device_ptrs.items())


def make_transfer(device: torch.device) -> Transfer:
    return CudaTransfer(device) if device.type == "cuda" else HostTransfer()


@dataclass
class _Group:
    """Parameters packed into one host slab; `offsets` place each one in any same-sized buffer."""

    label: str
    params: list[nn.Parameter]
    offsets: list[int]
    strides: list[tuple[int, ...]]  # each parameter's own layout (channels-last conv weights stay so)
    nbytes: int
    slab: torch.Tensor  # (nbytes,) uint8 host
    host_views: list[torch.Tensor]

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[o:o + p.nbytes].view(p.dtype).as_strided(p.shape, st)
                for p, o, st in zip(self.params, self.offsets, self.strides)]

    def point_at(self, views: list[torch.Tensor]) -> None:
        for p, v in zip(self.params, views):
            p.data = v  # a pointer swap: no copy


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill exactly numel() slots (any dim order: contiguous, channels-last...)."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.numel() == 0 or (min(t.stride(), default=1) >= 0 and span == t.numel())


class _Inner:
    """One plain tensor inside a quantized weight (runtime/quantize.py: torchao's quantized data, its scales),
    packed and swapped like a parameter: `data` reads and sets that attribute of the weight."""

    def __init__(self, owner: torch.Tensor, attr: str):
        self.owner, self.attr = owner, attr

    @property
    def data(self) -> torch.Tensor:
        return getattr(self.owner, self.attr)

    @data.setter
    def data(self, v: torch.Tensor) -> None:
        setattr(self.owner, self.attr, v)

    def __getattr__(self, name: str):  # nbytes, dtype, shape, stride: the inner tensor's
        return getattr(self.data, name)


def _leaves(params: list[nn.Parameter]) -> list:
    """The plain tensors to pack: a parameter itself, or a quantized weight's inner tensors."""
    out = []
    for p in params:
        inner = p.__tensor_flatten__()[0] if is_quantized(p) else None
        out += [_Inner(p, a) for a in inner] if inner else [p]
    return out


def _pack(label: str, params: list[nn.Parameter], transfer: Transfer) -> _Group:
    params = _leaves(params)
    offsets, n = [], 0
    for p in params:
        if not _dense(p.data):
            raise ValueError(f"offload: a parameter of {label} is a strided view; it cannot live in a slab")
        offsets.append(n)
        n += -(-p.nbytes // ALIGN) * ALIGN
    slab = transfer.host_empty(max(n, ALIGN))
    group = _Group(label, params, offsets, [p.stride() for p in params], n, slab, [])
    group.host_views = group.views(slab)
    for p, v in zip(params, group.host_views):
        v.copy_(p.data.to("cpu"))
    group.point_at(group.host_views)
    return group


class MappedCheckpoint:
    """A safetensors checkpoint memory-mapped: the mmap host tier of block offload.

    Each tensor is a zero-copy view of the file's pages (a private, copy-on-write mapping: nothing writes to it);
    its bytes come from the page cache, or the disk, only when a block is staged for the device. The page cache is
    reclaimable and shared by every process that maps the file, so N ranks on one host hold one copy, and a host
    with less memory than the model still runs it (at the disk's speed for what the cache cannot hold).

    infos: state-dict name -> a TensorInfo (modules/tensor_files.py: file, absolute byte span, dtype, shape)."""

    def __init__(self, infos: Mapping[str, Any]):
        self.infos = infos
        self._maps: dict[str, mmap.mmap] = {}

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes in the file, (nbytes,) uint8, without reading them."""
        info = self.infos[name]
        if info.span is None:
            raise ValueError(f"{name}: not in a safetensors file; only those can be memory-mapped")
        key = str(info.file)
        if key not in self._maps:
            with open(info.file, "rb") as f:
                self._maps[key] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        start, end = info.span
        if end == start:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():  # a copy-on-write mapping is writable; torch warns about read-only ones
            warnings.simplefilter("ignore")
            return torch.frombuffer(self._maps[key], dtype=torch.uint8, count=end - start, offset=start)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor in its file dtype and shape (a view of the mapping where aligned, else a copy)."""
        info, raw = self.infos[name], self.raw(name)
        if raw.data_ptr() % info.dtype.itemsize:
            raw = raw.clone()
        return raw.view(info.dtype).view(info.shape)


@dataclass
class _MappedGroup(_Group):
    """A block whose parameters stay in a memory-mapped checkpoint: `fill` stages them (cast to the compute dtype
    where the file's differs) into a pinned buffer laid out as the device buffer is; between stages each
    parameter points at a meta placeholder of its shape and dtype (no host copy exists)."""

    sources: list[tuple[torch.Tensor, torch.dtype, tuple[int, ...]]] = field(default_factory=list)

    def fill(self, stage: torch.Tensor) -> None:
        for p, o, st, (raw, file_dtype, shape) in zip(self.params, self.offsets, self.strides, self.sources):
            if file_dtype == p.dtype:
                stage[o:o + p.nbytes].copy_(raw)  # bytes as they are: the page cache -> pinned memory
            else:
                typed = raw.clone() if raw.data_ptr() % file_dtype.itemsize else raw
                stage[o:o + p.nbytes].view(p.dtype).as_strided(p.shape, st).copy_(typed.view(file_dtype).view(shape))


def _map(label: str, params: list[nn.Parameter], names: list[str], mapped: MappedCheckpoint,
         dtype: torch.dtype) -> _MappedGroup:
    offsets, n, sources = [], 0, []
    for p, name in zip(params, names):
        info = mapped.infos[name]
        if tuple(info.shape) != tuple(p.shape):
            raise ValueError(f"offload: {name}: file shape {list(info.shape)}, model {list(p.shape)}")
        offsets.append(n)
        n += -(-p.nbytes // ALIGN) * ALIGN
        sources.append((mapped.raw(name), info.dtype, tuple(info.shape)))
    strides = [torch.empty(p.shape, device="meta").stride() for p in params]  # laid out as in the file
    group = _MappedGroup(label, params, offsets, strides, n, torch.empty(0, dtype=torch.uint8),
                         [p.data for p in params], sources)
    return group


def _off_meta(model: nn.Module, in_blocks: set[int], mapped: MappedCheckpoint, dtype: torch.dtype) -> None:
    """Give the model's meta parameters host tensors (a meta tensor's data cannot be swapped for another device's,
    so each is replaced in its module): the parameters outside the blocks read from the mapping (then packed into
    a pinned slab as usual); the blocks' a placeholder of their shape and compute dtype, one NaN broadcast (no
    memory, and a block used without its copy shows at once): no host copy of a block exists."""
    new: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in new:
                if id(p) in in_blocks:
                    data = torch.full((), float("nan"), dtype=dtype).expand(p.shape)
                else:
                    t = mapped.tensor(f"{prefix}.{attr}" if prefix else attr)
                    data = t.to(dtype if t.is_floating_point() else t.dtype).clone()
                new[id(p)] = nn.Parameter(data, p.requires_grad)
            module._parameters[attr] = new[id(p)]


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    if any(True for _ in module.buffers()):
        raise ValueError(f"{type(module).__name__}: offload handles parameters only; this module has buffers")
    return list({id(p): p for p in module.parameters()}.values())


class _Stage:
    """`with offloader.stage():` brings the model onto the device for a stage and drops it after."""

    def prefetch(self) -> None: ...

    def begin(self) -> None: ...

    def end(self) -> None: ...

    @contextlib.contextmanager
    def stage(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()


class PartMerge(Protocol):
    """A change of a model's weights that can be applied a part at a time (families/wan_s2v/lora.py LoraMerge):
    part(prefix, exclude) is the change of the targets under the submodule `prefix` names, as a function of that
    submodule."""

    def part(self, prefix: str, exclude: tuple[str, ...] = ()) -> Callable[[nn.Module], None]: ...


class BlockOffloader(_Stage):
    """Double-buffered block streaming for `model.blocks` (see the module docstring).

    The stage starts at the model's first forward (or `begin()`); call `end()` when it ends, or use
    `with offloader.stage():`. Between forwards of one stage (denoising steps) the prefetch wraps
    around: the last block starts block 0's copy for the next step.
    """

    def __init__(self, model: nn.Module, transfer: Transfer, blocks: nn.ModuleList | None = None, name: str = "",
                 mapped: MappedCheckpoint | None = None, dtype: torch.dtype | None = None,
                 merge: "PartMerge | None" = None):
        """mapped: the mmap host tier: the model (on meta) reads its blocks from this mapped checkpoint at every
        stage, staged through two pinned buffers the size of the largest block, and its other parameters once
        into a pinned slab; dtype: the dtype it computes in (the file's is cast while staging where it differs).
        Without it, every parameter is copied into pinned host slabs (the pinned tier).
        merge (with mapped): a change of the weights that a loaded model would get once (a LoRA merge): its part
        outside the blocks is applied once to the host slab; a block's part on the device, each time the block's
        copy lands (the file's bytes are never changed)."""
        self.transfer = transfer
        blocks = blocks if blocks is not None else model.blocks
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        prefix = f"{name}: " if name else ""
        self.mapped = mapped
        if mapped is not None:
            dtype = dtype or next(iter(model.parameters())).dtype
            _off_meta(model, in_blocks, mapped, dtype)
            in_blocks = {id(p) for b in blocks for p in b.parameters()}
        root = [p for p in _unique_params(model) if id(p) not in in_blocks]
        self._merges: list[Callable[[nn.Module], None]] = []
        if mapped is not None and merge is not None:
            where = {id(m): n for n, m in model.named_modules()}
            prefix_of_blocks = where[id(blocks)] + "."
            merge.part("", exclude=(prefix_of_blocks,))(model)  # the root's targets, on the host, once
            self._merges = [merge.part(f"{prefix_of_blocks}{i}.") for i in range(len(blocks))]
        elif merge is not None:
            raise ValueError("BlockOffloader: merge goes with mapped (a pinned model is merged before it is packed)")
        if mapped is not None:
            names = {}
            for n, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), n)
            self.blocks = [_map(f"{prefix}block {i}", ps, [names[id(p)] for p in ps], mapped, dtype)
                           for i, ps in enumerate(_unique_params(b) for b in blocks)]
        else:
            self.blocks = [_pack(f"{prefix}block {i}", _unique_params(b), transfer) for i, b in enumerate(blocks)]
        self.root = _pack(prefix + "root", root, transfer)
        self.block_bytes = max(g.nbytes for g in self.blocks)
        # mmap tier: block i is staged into the pinned buffer of the device buffer it goes to; a buffer is refilled
        # only once the copy out of it has landed (`_staged`: that copy's event).
        self._staging = [transfer.host_empty(self.block_bytes) for _ in range(2)] if mapped is not None else []
        self._staged: list[Any] = [None, None]
        self.active = False
        self._bufs: list[torch.Tensor] = []  # 2 device buffers of block_bytes
        self._root_buf: torch.Tensor | None = None
        self._resident: list[int | None] = [None, None]  # block swapped in, per buffer
        self._pending: dict[int, tuple[int, Any]] = {}  # block -> (buffer, copy-done event)
        self._free_after: list[Any] = [None, None]  # per buffer: compute event its next copy waits for
        self._current: int | None = None
        self._root_done: Any = None  # the root's copy, issued by prefetch() or begin()
        self._hooks = [model.register_forward_pre_hook(lambda *_: None if self.active else self.begin())]
        self._hooks += [b.register_forward_pre_hook(self._enter_hook(i)) for i, b in enumerate(blocks)]
        self._blocks = blocks

    def params(self) -> list[nn.Parameter]:
        return [p for g in [self.root, *self.blocks] for p in g.params]

    @property
    def bound_bytes(self) -> int:
        """Device bytes this offloader ever holds: the non-block parameters and two block buffers."""
        return self.root.nbytes + 2 * self.block_bytes

    @property
    def host_bytes(self) -> int:
        """Host bytes it holds: the non-block slab, and every block's slab (pinned tier) or two staging buffers
        (mmap tier: the blocks stay in the page cache, which the kernel may reclaim and every process shares)."""
        if self.mapped is not None:
            return self.root.slab.numel() + sum(b.numel() for b in self._staging)
        return self.root.slab.numel() + sum(g.slab.numel() for g in self.blocks)

    def prefetch(self) -> None:
        """Start copying the non-block parameters and block 0 in, without waiting: call it while the stage
        before runs, and this stage's begin() finds them there (the handoff costs no copy)."""
        if self.active or self._root_done is not None:
            return
        t = self.transfer
        self._root_buf = t.device_empty(max(self.root.nbytes, ALIGN))
        self._bufs = [t.device_empty(self.block_bytes) for _ in range(2)]
        self._root_done = t.load(self._root_buf[:self.root.nbytes], self.root.slab[:self.root.nbytes], None,
                                 self.root.label)
        self._issue(0, 0)  # block 0 rides the load stream right behind: it lands while the embedders run

    def begin(self) -> None:
        if self.active:
            return
        self.prefetch()
        self.transfer.wait(self._root_done)
        self.root.point_at(self.root.views(self._root_buf))
        self.active = True

    def end(self) -> None:
        """Drop every device copy by pointer swap and give the buffers back (also a prefetch never used)."""
        if not self.active and self._root_done is None:
            return
        t = self.transfer
        for done in [self._root_done, *(d for _, d in self._pending.values())]:
            t.wait(done)  # a buffer must not be reused while a copy into it is in flight
        for g in [self.root] + self.blocks:
            g.point_at(g.host_views)
        for buf in [self._root_buf, *self._bufs]:
            t.free(buf)
        self._root_buf, self._bufs, self._root_done = None, [], None
        self._resident, self._pending, self._free_after, self._current = [None, None], {}, [None, None], None
        self._staged = [None, None]  # every copy has landed (waited on above)
        self.active = False

    def remove(self) -> None:
        """End any stage and detach the hooks; parameters stay in their host slabs."""
        self.end()
        for h in self._hooks:
            h.remove()

    def _enter_hook(self, i: int):
        def hook(_module: nn.Module, _args: Any) -> None:
            self._enter(i)
        return hook

    def _issue(self, i: int, buf: int) -> None:
        """Start copying block i into buffer `buf`, once that buffer's last user has computed."""
        self._pending = {b: v for b, v in self._pending.items() if v[0] != buf}  # a later copy replaces it
        g = self.blocks[i]
        src = g.slab[:g.nbytes]
        if self.mapped is not None:
            if self._staged[buf] is not None:
                self.transfer.host_wait(self._staged[buf])  # the last copy out of this staging buffer has landed
            g.fill(self._staging[buf])
            src = self._staging[buf][:g.nbytes]
        done = self.transfer.load(self._bufs[buf][:g.nbytes], src, self._free_after[buf], g.label)
        if self.mapped is not None:
            self._staged[buf] = done
        self._pending[i] = (buf, done)

    def _evict(self, buf: int) -> None:
        """Point the block in `buf` back at its host slab; its kernels are all queued before this mark."""
        j = self._resident[buf]
        if j is not None:
            self.blocks[j].point_at(self.blocks[j].host_views)
            self._free_after[buf] = self.transfer.compute_mark()
            self._resident[buf] = None

    def _enter(self, i: int) -> None:
        if not self.active:
            self.begin()
        landed = i not in self._resident
        if not landed:
            buf = self._resident.index(i)
        else:
            if i not in self._pending:  # out of order (not prefetched): load into the buffer not in use
                cur = self._resident.index(self._current) if self._current in self._resident else 1
                buf = 1 - cur
                self._evict(buf)
                self._issue(i, buf)
            buf, done = self._pending.pop(i)
            self.transfer.wait(done)
            self._evict(buf)
            self.blocks[i].point_at(self.blocks[i].views(self._bufs[buf]))
            self._resident[buf] = i
        self._current = i
        # Prefetch: block i+1 (block 0 after the last) into the other buffer, once block i-1 is done.
        nxt, other = (i + 1) % len(self.blocks), 1 - buf
        if nxt not in self._resident and nxt not in self._pending:
            self._evict(other)
            self._issue(nxt, other)
        if landed and self._merges:  # after the next copy is on its way: the merge's kernels overlap it
            self._merges[i](self._blocks[i])


class ModelOffloader(_Stage):
    """Policy "model": the whole model is one slab, on the device for its stage and dropped after."""

    def __init__(self, model: nn.Module, transfer: Transfer, name: str = ""):
        self.transfer = transfer
        self.group = _pack(f"{name}: model" if name else "model", _unique_params(model), transfer)
        self.active = False
        self._buf: torch.Tensor | None = None
        self._done: Any = None  # the copy in, issued by prefetch() or begin()
        self._hook = model.register_forward_pre_hook(lambda *_: None if self.active else self.begin())

    def params(self) -> list[nn.Parameter]:
        return list(self.group.params)

    @property
    def bound_bytes(self) -> int:
        return self.group.nbytes

    def prefetch(self) -> None:
        """Start the copy in without waiting (while the stage before runs); begin() then only waits on it."""
        if self.active or self._done is not None:
            return
        t, g = self.transfer, self.group
        self._buf = t.device_empty(max(g.nbytes, ALIGN))
        self._done = t.load(self._buf[:g.nbytes], g.slab[:g.nbytes], None, g.label)

    def begin(self) -> None:
        if self.active:
            return
        self.prefetch()
        self.transfer.wait(self._done)
        self.group.point_at(self.group.views(self._buf))
        self.active = True

    def end(self) -> None:
        if not self.active and self._done is None:
            return
        self.transfer.wait(self._done)  # a prefetch never used: its copy must land before the buffer goes
        self.group.point_at(self.group.host_views)
        self.transfer.free(self._buf)
        self._buf, self._done, self.active = None, None, False

    def remove(self) -> None:
        self.end()
        self._hook.remove()


def model_bytes(model: nn.Module) -> int:
    return sum(stored_bytes(p) for p in model.parameters())  # a quantized weight: its data and scales


def offload_choice(policy: OffloadPolicy, free_bytes: int, model_sizes: Mapping[str, int],
                   working_bytes: int = 0) -> tuple[Literal["none", "model", "block"], str]:
    """Resolve `runtime.offload` -> (choice, why); "auto" decides from free device memory.

    model_sizes: bytes each model holds on the device while it runs (for a sharded one: its shard and gathered
    blocks); working_bytes: activations, workspace and state the largest stage needs on top of its weights.
    - "none": every model fits at once, with the working set;
    - "model": the largest model fits whole while it runs, beside the next stage's, prefetched (counted as
      the second largest); the rest wait in host memory;
    - "block": even that doesn't fit; stream the blocks.
    """
    if policy != "auto":
        return policy, f"{policy} (set by runtime.offload)"
    total, largest = sum(model_sizes.values()), max(model_sizes.values(), default=0)
    two = sum(sorted(model_sizes.values())[-2:])
    if total + working_bytes <= free_bytes:
        choice = "none"
    elif two + working_bytes <= free_bytes:
        choice = "model"
    else:
        choice = "block"
    gib = 2**30
    return choice, (f"auto chose {choice} (free {free_bytes / gib:.2f} GiB; models {total / gib:.2f} GiB in all, "
                    f"largest {largest / gib:.2f} GiB; working {working_bytes / gib:.2f} GiB)")


def host_tier_choice(setting: str, host_free: int | None, pinned_bytes: int, mappable: str | None
                     ) -> tuple[Literal["pinned", "mmap"], str]:
    """Resolve `runtime.offload_host` for block offload -> (tier, why).

    pinned_bytes: host bytes the pinned tier would hold on this host (every process's copies of the offloaded
    weights); host_free: the host's available memory (None: unknown); mappable: None when the blocks can be
    read from a memory-mapped checkpoint, else why not.
    - pinned: the weights copied once into pinned host memory; every copy to the GPU is a DMA at the link's speed.
    - mmap: the blocks stay in the checkpoint file; each forward reads them from the page cache (disk the first
      time, and whenever the page cache cannot hold the file) into a small pinned staging pair. The page cache is
      reclaimable and shared by every process on the host, so a host smaller than the model runs it.
    auto: pinned when it fits the available memory with a quarter to spare, else mmap (where mappable)."""
    if setting == "pinned":
        return "pinned", "pinned (set by runtime.offload_host)"
    if setting == "mmap":
        if mappable is not None:
            raise ValueError(f"runtime.offload_host: mmap: {mappable}")
        return "mmap", "mmap (set by runtime.offload_host)"
    gb = 1e9
    if host_free is None:
        return "pinned", "auto: pinned (the host's free memory is not known)"
    if pinned_bytes <= 0.75 * host_free:
        return "pinned", (f"auto: pinned: {pinned_bytes / gb:.1f} GB of copies fit the host's {host_free / gb:.1f} GB "
                          "available, and copies from pinned memory run at the link's full speed")
    if mappable is not None:
        return "pinned", (f"auto: pinned, though {pinned_bytes / gb:.1f} GB of copies crowd the host's "
                          f"{host_free / gb:.1f} GB: mmap is not possible ({mappable})")
    return "mmap", (f"auto: mmap: {pinned_bytes / gb:.1f} GB of pinned copies would not fit the host's "
                    f"{host_free / gb:.1f} GB available; the checkpoint is read through the page cache instead")


def host_available() -> int | None:
    """The host's available memory (MemAvailable: free plus reclaimable page cache), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
