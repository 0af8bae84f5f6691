"""Where and in what precision the models run."""

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from avatar_cli.errors import InputError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str = ""  # why this dtype: "asked for", or what `auto` saw on the device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class CpuInfo:
    capability: str  # torch's kernel level: AVX2, AVX512, ... (ATEN_CPU_CAPABILITY lowers it)
    avx512_bf16: bool
    amx: bool

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls and convolutions run in hardware: AVX512_BF16 or AMX, with torch's AVX-512 kernels on.

        Without them torch and oneDNN emulate bf16, far slower than float32 on the same CPU (bench/results.md:
        the bf16 and fp32 matmul peaks of the AVX2-capped pipeline benchmarks).
        """
        return self.capability.startswith("AVX512") and (self.avx512_bf16 or self.amx)

    def describe(self) -> str:
        flags = [f for f, on in (("avx512_bf16", self.avx512_bf16), ("amx_bf16", self.amx)) if on]
        return f"torch CPU capability {self.capability}, " + (", ".join(flags) if flags else "no avx512_bf16/amx_bf16")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_info() -> CpuInfo:
    """What this CPU computes natively, as torch sees it (cpuinfo's flags and the dispatch level in use)."""
    x86 = hasattr(torch.cpu, "_is_avx512_bf16_supported")
    return CpuInfo(capability=torch.backends.cpu.get_cpu_capability(),
                   avx512_bf16=x86 and torch.cpu._is_avx512_bf16_supported(),
                   amx=x86 and torch.cpu._is_amx_tile_supported())


def auto_dtype(device: str, cpu: CpuInfo | None = None) -> tuple[torch.dtype, str]:
    """The dtype `runtime.dtype: auto` picks, and why (said in the log and the `done` event)."""
    if device == "cuda":
        return torch.bfloat16, "auto: bfloat16 on CUDA (tensor cores)"
    cpu = cpu or cpu_info()
    if cpu.native_bf16:
        return torch.bfloat16, f"auto: bfloat16, native on this CPU ({cpu.describe()})"
    return torch.float32, (f"auto: float32, this CPU has no native bf16 ({cpu.describe()}); "
                           "emulated bf16 is far slower")


_START_THREADS = torch.get_num_threads()


def set_cpu_threads(threads: int) -> None:
    """torch's CPU threads for a job: `threads`, or with 0 torch's own count as this process started
    (OMP_NUM_THREADS, else one per core), not whatever an earlier job of the same process (a batch, a test session)
    set: the thread count changes float sums' order."""
    torch.set_num_threads(job_threads(threads))


def job_threads(threads: int) -> int:
    """The torch thread count a job with `runtime.threads: threads` computes on (0: torch's own at start)."""
    return threads if threads > 0 else _START_THREADS


@contextmanager
def one_cpu_thread(on: bool = True) -> Iterator[None]:
    """torch on one CPU thread for the block (when `on`), then the count it had.

    For loading: reading and converting weights is many small copies, each split over the pool when it is over
    torch's grain size; one thread does each as fast, where waking the pool's others costs more than the copy
    whenever another process holds those cores (bench/results.md). Copies come out the same on any count."""
    before = torch.get_num_threads()
    if on:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if on:
            torch.set_num_threads(before)


class CoreShare:
    """The CPU threads of one process shared by its render loop and a helper thread (the decode, runtime.decode:
    thread): while the helper has work it computes on one thread and the loop on the others; while it is idle the
    loop has them all.

    torch's intra-op count is per thread (OpenMP's nthreads is a per-thread setting, and oneDNN reads it on every
    call), so each side sets its own. The helper takes one thread for its whole life (`helper_thread`); the loop's
    count follows the helper's work: `lend` (the loop, handing work over) and `returned` (the helper, done with it)
    count the work in flight, and `sync`, called by the loop's thread, sets its count from that. From `open` to
    `close`, `sync` runs before each block of the loop's models (`models`: forward pre-hooks), so the loop takes
    the second core back within a block of the helper's finishing, not at the next chunk. The values computed are the
    same on any thread count where every kernel splits its outputs, not its sums, over threads (the mini renders'
    digests are the same at 1 and 2 threads: tests/test_decode_thread.py)."""

    def __init__(self, threads: int, models: Iterable[nn.Module] = ()):
        self.threads = threads  # the loop's count with the helper idle (the job's)
        self.models = list(models)
        self.owner = threading.get_ident()  # the loop's thread: the one that may `sync`
        self._lock = threading.Lock()
        self._lent = 0  # pieces of work handed to the helper and not finished
        self._now = torch.get_num_threads()
        self._hooks: list = []

    def helper_thread(self) -> None:
        """Called first in the helper thread: it computes on one thread."""
        torch.set_num_threads(1)

    def lend(self) -> None:
        with self._lock:
            self._lent += 1
        self.sync()

    def returned(self) -> None:
        with self._lock:
            self._lent -= 1

    def sync(self) -> None:
        """The loop's thread count for now: one fewer while the helper works (at least one). Other threads: no-op."""
        if threading.get_ident() != self.owner:
            return
        want = max(1, self.threads - 1) if self._lent > 0 else self.threads
        if want != self._now:
            torch.set_num_threads(want)
            self._now = want

    def open(self) -> None:
        """`sync` before each of the loop's models and each of their blocks (their children, and the members of
        their ModuleLists and Sequentials) runs, until `close`."""
        for model in self.models:
            for name, m in model.named_modules():
                if name.count(".") <= 1:  # the model, its children, and a list's members (blocks.0)
                    self._hooks.append(m.register_forward_pre_hook(lambda *_: self.sync()))

    def close(self) -> None:
        """Remove the hooks and give the loop's thread its whole count back."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with self._lock:
            self._lent = 0
        self.sync()


def resolve_runtime(device: str, dtype: str, threads: int = 0) -> Runtime:
    """device: auto | cpu | cuda; dtype: auto | float32 | bfloat16 | float16; threads: CPU threads, 0 = torch's."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise InputError("runtime.device: cuda was asked for but no CUDA device is available")
    if device == "cpu":
        set_cpu_threads(threads)
    if dtype == "auto":
        chosen, reason = auto_dtype(device)
    else:
        chosen, reason = _DTYPES[dtype], "asked for"
    if device == "cpu" and chosen == torch.float16:
        raise InputError("runtime.dtype: float16 is not supported on CPU; use bfloat16 or float32")
    return Runtime(torch.device(device), chosen, reason)
