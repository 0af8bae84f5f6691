"""runtime.decode=worker: the VAE decode and the MP4 encoder in a process of their own, fed by a bounded queue.

`DecodeWorker` is the render process's side: a Publisher (stages/publish.py), as the inline decode is, so the
chunk loop hands it final latents without knowing where they are decoded.

The render process hands each published stretch (its latents after super-resolution) to the worker through one
of DEPTH preallocated shared-memory slots and goes on with the next chunk; it blocks only when every slot is still
in flight, so the queue's depth, not the video's length, bounds the memory the handoff holds. The worker loads only
the decode step's components (`family.needs["decode"]`), keeps the decoder's causal cache (the rolling-state
tensors `family.is_decode_state` names) from stretch to stretch, decodes, writes the frames to the MP4, hashes them
as the inline decode does (media/sink.py HashingSink), and acknowledges each stretch with its digest and a snapshot
of the decoder cache (in the slot's own shared-memory buffer). The render process saves a stretch's resume point only on its
acknowledgment: its own rolling state as it was when it sent the stretch (kept until then: at most DEPTH snapshots),
plus the worker's cache. The checkpoint is the inline one, so a render resumes in either mode. Snapshots are taken
only for the stretches a resume point may follow (pipeline/checkpoint.py resume_schedule): every one for a small
state, one block in 39 for the streaming mode's 41.5 GB of rings at full size, where two snapshots in flight would
hold ~90 GB of host memory; and a snapshot over SPILL_BYTES waits on disk (`spill`), not in host memory.

Faults: a worker that dies is seen at the next stretch handed over (or while waiting on one) and stops the render
with a RenderError naming it; an error inside the worker comes back as a RenderError naming it. The worker polls its
parent and exits at once, writing nothing more, when the render process is gone. Ctrl-C and SIGTERM reach the whole
process group: the worker ignores both and lets the render process stop it (its abort keeps the partial file
playable).

Why DEPTH = 2: one stretch decoding in the worker while the next is already waiting, so the worker never idles on
the handoff itself; the throughput is min(DiT, decode) either way, and a deeper queue would only hold more latents
(and more rolling-state snapshots) without more overlap. Two absorbs the alternation of long N and short I stretches.

Messages between the two processes are small tuples of numbers and strings on multiprocessing queues; every tensor
travels through the shared-memory slots (torch's shared storage, handed over once, by file descriptor: no files).
"""

import os
import queue
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from avatar_cli.errors import AvatarError, InputError, RenderError
from avatar_cli.families.base import Family, Final, ParallelPlan, RollingState
from avatar_cli.families.registry import load_modules
from avatar_cli.media.sink import HashingSink
from avatar_cli.media.writer import Mp4Writer
from avatar_cli.pipeline.events import Stretch
from avatar_cli.report import peak_rss_mb
from avatar_cli.runtime.device import Runtime, dtype_name
from avatar_cli.runtime.distributed import Dist
from avatar_cli.runtime.placement import place
from avatar_cli.stages.publish import DecodePublish, to_sink
from avatar_cli.stages.sr import PREFIX as SR_PREFIX
from avatar_cli.stages.sr import FrameSR, SRPlan
from avatar_cli.stages.sr import load_models as load_sr_models

DEPTH = 2  # stretches in flight: see the module docstring
SPILL_BYTES = 256 << 20  # a snapshot bigger than this waits on disk until its acknowledgment, not in host memory
SLICE_BYTES = 64 << 20  # what a spill copies through host memory at once
_ALIGN = 64  # byte offset of each tensor in a slot: any dtype's view of the flat buffer is then aligned
_POLL_S = 0.1  # how often a waiting render process checks that the worker lives, and the worker its parent


def spill(tensors: Mapping[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """Copies of `tensors` (on any device) that live in a file, not in host memory: written SLICE_BYTES at a time
    into an unnamed file in `folder` (its name is removed once mapped: nothing is left behind, even after kill -9
    once this returns), then mapped back privately, so their pages are read only when used (the resume point's
    write) and the page cache can drop them."""
    fd, name = tempfile.mkstemp(prefix=".avatar-snapshot-", dir=folder)
    layout, offset = [], 0
    try:
        with os.fdopen(fd, "wb") as f:
            for key, t in tensors.items():
                flat = t.detach().contiguous().reshape(-1).view(torch.uint8)  # (bytes,)
                for a in range(0, flat.numel(), SLICE_BYTES):
                    f.write(flat[a:a + SLICE_BYTES].cpu().numpy().data)
                pad = -flat.numel() % _ALIGN  # every tensor starts aligned for its dtype
                f.write(bytes(pad))
                layout.append((key, offset, flat.numel(), t.dtype, t.shape))
                offset += flat.numel() + pad
        data = torch.from_file(name, shared=False, size=offset, dtype=torch.uint8) if offset else torch.empty(0)
    except OSError as e:
        raise RenderError(f"cannot keep a resume snapshot in {folder} ({e.strerror})") from None
    finally:
        os.unlink(name)
    return {key: data[o:o + n].view(dtype).view(shape) for key, o, n, dtype, shape in layout}


def check_setting(setting: str, family: Family) -> None:
    """Raise InputError for a decode setting this family cannot run (called at prepare, before any load)."""
    if setting in ("worker", "thread") and family.decode_feeds_back:
        raise InputError(f"runtime.decode: {setting}: the {family.name} family conditions later chunks on decoded "
                         "frames (its decode feeds back), so its decode cannot run apart from the DiT; use inline "
                         "or auto")


# auto's thread: a CPU of 2 to 4 torch threads, computing in bf16, or in float32 where the family's frames do not
# follow the thread count. At 2 it was measured faster than inline, with the same frames (bench/results.md,
# "Pipeline benchmark" and "The decode thread as auto's choice"); the decode thread's one core keeps up with the
# loop's others up to about 4 (its per-frame SR + decode on one thread against the DiT's per-frame work on 3, same
# section), past which it would hold the loop. The loop lends a thread while the decode works, so its DiT runs a
# chunk on either count: a float32 GEMM over a few rows can sum in another order on 1 thread than on 2, and only a
# family that keeps its bits on any count (Family.thread_count_invariant) gets the thread in float32.
THREAD_CORES = range(2, 5)


def choose(setting: str, family: Family, runtime: Runtime, threads: int = 1) -> tuple[str, str]:
    """("inline" | "worker" | "thread", why); threads: the job's torch threads. auto: the worker on CUDA (the decode
    overlaps the DiT's next chunk on another device, or between its kernels); on a CPU the worker's process shares
    the same cores and gains nothing over inline (bench/results.md, "decode worker"), while a thread of the render
    process with a core of its own overlaps the decode with the DiT on THREAD_CORES threads."""
    if setting != "auto":
        return setting, "asked for"
    if family.decode_feeds_back:
        return "inline", f"auto: the {family.name} family's later chunks need the decoded frames"
    if runtime.is_cuda:
        return "worker", "auto: CUDA, and the family's decode does not feed back"
    if threads not in THREAD_CORES:
        return "inline", (f"auto: a CPU of {threads} thread{'s' if threads > 1 else ''}, where neither a worker "
                          "process nor a decode thread pays")
    name = dtype_name(runtime.dtype)
    if runtime.dtype == torch.bfloat16 or (runtime.dtype == torch.float32 and family.thread_count_invariant):
        return "thread", f"auto: a CPU of {threads} threads in {name}, where a core of its own decodes beside the DiT"
    return "inline", (f"auto: {name} on a CPU, where the {family.name} family's frames could differ with the "
                      "thread count a decode thread leaves the DiT")


def worker_device(runtime: Runtime, world_size: int) -> torch.device:
    """Under torchrun with world_size ranks on cuda:0..world_size-1, the worker takes cuda:world_size when that many
    + 1 GPUs are visible (a device of its own, as LiveAvatar gives its decode), else it shares rank 0's device."""
    if runtime.is_cuda and torch.cuda.device_count() > world_size:
        return torch.device("cuda", world_size)
    return runtime.device


# --- shared-memory slots ------------------------------------------------------------------------------------------

Layout = list[tuple[str, str, tuple[int, ...], tuple[int, ...], int]]  # (name, dtype, shape, stride, byte offset)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t itself when its elements fill its storage span exactly (any dimension order), else a contiguous copy; the
    slot keeps the strides, because the decoder's convolutions pick their kernels (and roundings) by memory layout."""
    if t.numel() == 0 or t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return t
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t if span == t.numel() and min(t.stride()) > 0 else t.contiguous()


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors.values())


def _shared_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(max(nbytes, _ALIGN), dtype=torch.uint8).share_memory_()  # (nbytes,)


def pack(buf: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> Layout:
    """Copy `tensors` into the flat uint8 buffer (layouts kept); returns where each lies. The buffer must hold
    _nbytes(tensors)."""
    layout, offset = [], 0
    for name, t in tensors.items():
        t = _dense(t.detach())
        n = t.numel() * t.element_size()
        flat = buf[offset:offset + n].view(t.dtype)  # (numel,)
        flat.as_strided(t.shape, t.stride()).copy_(t)
        layout.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), offset))
        offset += -(-n // _ALIGN) * _ALIGN
    return layout


def unpack(buf: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Views into the buffer (no copy): valid until the buffer is written again."""
    out = {}
    for name, dtype, shape, stride, offset in layout:
        dt = getattr(torch, dtype)
        n = 1
        for d in shape:
            n *= d
        flat = buf[offset:offset + n * dt.itemsize].view(dt)  # (numel,)
        out[name] = flat.as_strided(shape, stride)
    return out


# --- the render process's side ------------------------------------------------------------------------------------

@dataclass
class _Sent:
    seq: int
    slot: int
    next_chunk: int
    start: int
    end: int
    tensors: dict[str, torch.Tensor]  # the render process's own rolling tensors when it sent the stretch (CPU copies)
    resumable: bool  # whether a resume point may follow it: only then are `tensors` copied
    held: list[tuple[int, int, torch.Tensor]]
    published: int


class DecodeWorker:
    """The render process's handle on the worker: `submit` stretches in timeline order, `drain` at the end, then
    `close` (finish the MP4) or `abort` (after a failure: keep what was encoded). Rank 0 alone makes one.

    As a Publisher (stages/publish.py): `publish` submits, `finish` drains; the decode runs in the worker, so
    nothing is brought onto this process's device for it and the loop does not time it (`needs` is empty):
    `seconds` gives the worker's decode seconds and this process's seconds blocked on it."""

    needs: tuple[str, ...] = ()
    refines = False

    def __init__(self, source: Any, runtime: Runtime, world_size: int, writer_path: str, writer_args: dict,
                 size: tuple[int, int], threads: int | None = None,
                 resume_at: Callable[[int], bool] = lambda block: True, vae_dtype: str = "auto",
                 sr: SRPlan | None = None, weights: str = "bf16"):
        """source: the job's ModelSource; writer_path, writer_args: Mp4Writer's arguments (the worker owns it);
        size: the output (width, height). threads: the worker's torch threads (default: the render process's, so
        its CPU decode rounds as the inline one does). resume_at(block): whether a resume point may follow the
        stretch published after that block (pipeline/checkpoint.py resume_schedule): only those stretches keep a
        snapshot of the rolling state while in flight. vae_dtype: `runtime.vae_dtype`. sr: frame super-resolution,
        run in the worker after its decode (stages/sr.py), with `weights` (`runtime.weights`) for its DiT."""
        self.resume_at = resume_at
        self.sr = sr
        self._handed: int | None = None  # frames handed over, counted from the Sink's first (a resumed render's)
        self._out = 0  # frames the worker has put into the MP4, counted alike
        self._next_chunk = 0
        self._folder = Path(writer_path).parent  # where big snapshots wait (the output's disk)
        self.family: Family = source.family
        self.device = worker_device(runtime, world_size)
        ctx = mp.get_context("spawn")  # never fork: the render process already runs torch's threads
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._slots: list[torch.Tensor] = [_shared_buffer(0) for _ in range(DEPTH)]
        self._acks: list[torch.Tensor | None] = [None] * DEPTH  # the worker's cache buffers, one per slot
        self._free = deque(range(DEPTH))
        self._sent: deque[_Sent] = deque()
        self._seq = 0
        self._handed_cache = False
        self._ready = False
        self._closed = False  # closed or aborted: the worker is gone
        self._stopping = False  # it stopped by itself (an error) or died
        self.first_put: float | None = None  # media/sink.py now() (system-wide monotonic) of the worker's first frame
        self.decode_s = 0.0  # the worker's decode seconds
        self.wait_s = 0.0  # the render process's seconds blocked on the queue
        self.peak_rss_mb: float | None = None  # the worker's, once closed
        wrt = Runtime(self.device, runtime.dtype, runtime.dtype_reason)
        self._proc = ctx.Process(target=_worker_main, name="avatar-decode", daemon=True, args=(
            source, wrt, threads or torch.get_num_threads(), writer_path, writer_args, size, list(self._slots),
            self._inbox, self._outbox, os.getpid(), vae_dtype, sr, weights))
        self._proc.start()
        self.pid = self._proc.pid

    # The render loop's calls (the Publisher protocol).

    @property
    def held(self) -> int:
        """With frame super-resolution: frames handed over and not yet in the MP4 (in flight, or held back by SR)."""
        return self._handed - self._out if self.sr is not None and self._handed is not None else 0

    def publish(self, final: Final, next_chunk: int, state: RollingState) -> list[Stretch]:
        """Handed over; its resume point is saved once the worker has written it (acknowledged)."""
        if self._handed is None:  # the Sink's frames so far: a resumed render's point
            self._handed = self._out = state.published
        self._handed += final.frames
        self._next_chunk = next_chunk
        state.published += final.frames
        return self.submit(final, next_chunk, state)

    def finish(self, state: RollingState) -> list[Stretch]:
        """Every stretch acknowledged; with SR, the frames it held back written too (`state` counts them)."""
        done = self.drain()
        if self.sr is not None:
            if self._handed is None:  # resumed after its last chunk: SR's state (its held frames) goes over now
                self._handed = self._out = state.published
            slot = self._free.popleft()  # every slot is free once drained
            layout, grown = self._fill(slot, {}, state)
            self._seq += 1
            self._sent.append(_Sent(self._seq, slot, self._next_chunk, 0, 0, {}, False, [], 0))
            self._inbox.put(("flush", self._seq, slot, layout, grown))
            done += self.drain()
            state.published = self._out
        return done

    @property
    def seconds(self) -> dict[str, float]:
        """The worker's decode seconds (overlapping the chunks after), and the seconds the loop waited on it."""
        return {"decode": self.decode_s, "decode_wait": self.wait_s}

    def submit(self, final: Final, next_chunk: int, state: RollingState) -> list[Stretch]:
        """Hand the stretch `final` (refined latents) over; returns the stretches acknowledged meanwhile, in order.
        Blocks while DEPTH stretches are in flight. `state` is the render process's rolling state after this
        stretch (state.published counts it); its decode-owned tensors (a resumed render's decoder cache) go to the
        worker with the first stretch and leave `state`."""
        done = self._collect(block=False)
        while not self._free:
            done += self._collect(block=True)
        slot = self._free.popleft()
        layout, grown = self._fill(slot, {"z": final.z}, state)
        self._seq += 1
        # A snapshot only where a resume point may follow; a big one (the streaming mode's is ~44 GB at full size)
        # on disk, not in host memory.
        resumable = self.resume_at(next_chunk - 1)
        mine = {k: v for k, v in state.tensors.items() if v is not None} if resumable else {}
        if sum(v.numel() * v.element_size() for v in mine.values()) > SPILL_BYTES:
            mine = spill(mine, self._folder)
        else:
            mine = {k: v.detach().to("cpu", copy=True) for k, v in mine.items()}
        self._sent.append(_Sent(self._seq, slot, next_chunk, final.start, final.end, mine, resumable,
                                list(state.held), state.published))
        self._inbox.put(("stretch", self._seq, slot, layout, final.start, final.end, grown, resumable))
        return done

    def _fill(self, slot: int, tensors: dict[str, torch.Tensor], state: RollingState) -> tuple[Layout, Any]:
        """Pack `tensors` into the slot, with (the first time) the worker's own tensors out of `state`: a resumed
        render's decoder cache and SR state. -> (their layout, the slot's new buffer or None)."""
        if not self._handed_cache:
            own = [k for k in state.tensors if self.family.is_decode_state(k) or k.startswith(SR_PREFIX)]
            tensors.update({f"state.{k}": state.tensors.pop(k) for k in own})
            self._handed_cache = True
        grown = None
        need = _nbytes(tensors)
        if self._slots[slot].numel() < need:
            # Sized by the largest stretch so far (+25% for the next N chunk's): a handful of reallocations per
            # render, each handed to the worker once with the stretch that needed it.
            self._slots[slot] = grown = _shared_buffer(need + need // 4)
        return pack(self._slots[slot], tensors), grown

    def drain(self) -> list[Stretch]:
        """Wait for every stretch in flight; returns their acknowledgments in order."""
        done = []
        while self._sent:
            done += self._collect(block=True)
        return done

    # Mp4Writer's ending calls, as the runner makes them.

    def close(self) -> None:
        """Finish the MP4 (every stretch must be acknowledged: `drain` first) and stop the worker."""
        self.drain()
        self._inbox.put(("close",))
        while True:
            msg = self._next(block=True)
            if msg[0] == "closed":
                self.peak_rss_mb = msg[1]
                break
        self._closed = True
        self._proc.join(timeout=30)

    def abort(self) -> None:
        """After a failure: the worker drops what it has not encoded and closes the file with what it has; a worker
        that does not answer within 30 s is killed (the fragmented MP4 stays playable either way)."""
        if self._closed:
            return
        deadline = time.monotonic() + 30
        if self._proc.is_alive() and not self._stopping:
            self._inbox.put(("abort",))
            while self._proc.is_alive() and time.monotonic() < deadline:
                try:
                    if self._outbox.get(timeout=_POLL_S)[0] in ("aborted", "error"):
                        break
                except (queue.Empty, OSError, EOFError):
                    pass
        self._closed = True
        self._proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        for q in (self._inbox, self._outbox):
            q.cancel_join_thread()  # a dead reader must not hold up this process's exit

    # Internals.

    def _collect(self, block: bool) -> list[Stretch]:
        done = []
        while self._sent:
            msg = self._next(block=block and not done)
            if msg is None:
                break
            done.append(self._acked(msg))
        return done

    def _next(self, block: bool) -> tuple | None:
        """The worker's next message ("ready" handled here); None when not blocking and nothing came. Raises the
        worker's error, or RenderError when it is gone."""
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    msg = self._outbox.get(timeout=_POLL_S) if block else self._outbox.get_nowait()
                except queue.Empty:
                    if not self._proc.is_alive():
                        self._raise_dead()
                    if not block:
                        return None
                    continue
                except (OSError, EOFError):
                    # A message that hands over a new cache buffer reads its file descriptor from the worker: gone
                    # with a worker that died right after sending it (its stretch is then not checkpointed).
                    # The worker may have sent its error right after that message: let it exit, and raise that
                    # error rather than the lost handover.
                    self._proc.join(timeout=5)
                    if self._proc.is_alive():
                        raise
                    block = False
                    continue
                if msg[0] == "ready":
                    self._ready = True
                    continue
                if msg[0] == "error":
                    self._stopping = True  # the worker aborted its writer and is exiting
                    _, kind, text = msg
                    raise (InputError if kind == "InputError" else RenderError)(f"decode worker: {text}")
                return msg
        finally:
            self.wait_s += time.perf_counter() - t0 if block else 0.0

    def _raise_dead(self) -> None:
        try:  # an error it put before dying is still readable
            while True:
                msg = self._outbox.get_nowait()
                if msg[0] == "error":
                    raise RenderError(f"decode worker: {msg[2]}")
        except (queue.Empty, OSError, EOFError):
            pass
        self._proc.join(timeout=1)
        code = self._proc.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        self._stopping = True
        raise RenderError(f"the decode worker (pid {self.pid}) died ({how}) "
                          f"{'while rendering' if self._ready else 'while starting'}")

    def _acked(self, msg: tuple) -> Stretch:
        """A stretch the worker decoded, wrote and hashed, with the rolling state to resume after it."""
        _, seq, slot, layout, digest, grown, first_put, decode_s, written = msg
        sent = self._sent.popleft()
        assert sent.seq == seq, f"decode worker answered stretch {seq}, expected {sent.seq}"
        if grown is not None:
            self._acks[slot] = grown
        cache = unpack(self._acks[slot], layout) if layout else {}
        self._free.append(slot)
        if self.first_put is None:
            self.first_put = first_put
        self.decode_s += decode_s
        # Saved before this slot is written again (the checkpoint is written from on_stretch, synchronously).
        # The MP4's frames: the stretch's own, or (frame SR) those SR let out, which lag the decoded ones.
        start, self._out = self._out, self._out + written
        state = RollingState(tensors={**sent.tensors, **cache}, held=sent.held, published=self._out)
        return Stretch(sent.next_chunk, start, self._out, digest, state, sent.resumable)


# --- the worker process -------------------------------------------------------------------------------------------

def _watch_parent(parent: int) -> None:
    """No orphan keeps writing: once the render process is gone (re-parented), exit at once."""
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    os._exit(3)


def _worker_main(source: Any, runtime: Runtime, threads: int, writer_path: str, writer_args: dict,
                 size: tuple[int, int], slots: list[torch.Tensor], inbox: Any, outbox: Any, parent: int,
                 vae_dtype: str = "auto", sr_plan: SRPlan | None = None, weights: str = "bf16") -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the render process decides when the worker stops (abort or close)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="parent-watch").start()
    torch.set_num_threads(threads)
    writer = None
    try:
        family: Family = source.family
        skip = [c for c in family.components if c not in family.needs["decode"]]
        modules = load_modules(source, skip=skip)
        plan = ParallelPlan(float32=family.parallel.float32, bfloat16=family.parallel.bfloat16)
        place(modules, runtime, Dist(), offload="none", plan=plan.with_dtype("vae", vae_dtype))
        publish = DecodePublish(family, modules, runtime)
        sr = None
        if sr_plan is not None:
            sr_models = load_sr_models(sr_plan, runtime.device, runtime.dtype, weights)
            sr = FrameSR(sr_models, sr_plan, runtime.device, runtime.dtype)
        writer = Mp4Writer(writer_path, **writer_args)
        outbox.put(("ready", os.getpid()))
        _serve(family, publish, runtime, writer, size, slots, inbox, outbox, sr)
    except BaseException as e:  # every failure goes back as one line; the writer keeps what it encoded
        if writer is not None:
            try:
                writer.abort()
            except Exception:
                pass  # the first error is the one to report
        kind = "InputError" if isinstance(e, InputError) else "RenderError"
        text = str(e) if isinstance(e, AvatarError) else f"{type(e).__name__}: {e}"
        outbox.put(("error", kind, text))
    finally:
        outbox.close()
        outbox.join_thread()  # the last message reaches the pipe before the process exits


def _serve(family: Family, publish: Any, runtime: Runtime, writer: Any, size: tuple[int, int],
           slots: list[torch.Tensor], inbox: Any, outbox: Any, sr: FrameSR | None = None) -> None:
    state = RollingState()
    acks: list[torch.Tensor | None] = [None] * len(slots)
    hashing = HashingSink(writer)  # its first_put: when the first frame reached the writer (the render's ttff)
    while True:
        msg = inbox.get()
        if msg[0] == "close":
            writer.close()
            outbox.put(("closed", round(peak_rss_mb(), 1)))
            return
        if msg[0] == "abort":
            writer.abort()
            outbox.put(("aborted",))
            return
        if msg[0] == "flush":  # the end: SR's held frames into the MP4
            _, seq, slot, layout, grown = msg
            if grown is not None:
                slots[slot] = grown
            got = unpack(slots[slot], layout)  # a render resumed after its last chunk: SR's state comes only now
            state.tensors.update({k.removeprefix("state."): v.clone().to(runtime.device) for k, v in got.items()})
            t0 = time.perf_counter()
            sr.resume(state)
            with torch.no_grad():
                last = sr.finish()  # (held, 3, H, W)
                to_sink(last, hashing)
            outbox.put(("done", seq, slot, [], hashing.take_digest(), None, hashing.first_put,
                        time.perf_counter() - t0, len(last)))
            continue
        _, seq, slot, layout, start, end, grown, resumable = msg
        if grown is not None:
            slots[slot] = grown
        # Copies out of the slot: the decoder may keep views of its input (mini's cache is its last latent), and
        # the render process writes the slot again once this stretch is acknowledged.
        got = {k: v.clone() for k, v in unpack(slots[slot], layout).items()}
        z = got.pop("z").to(runtime.device)
        state.tensors.update({k.removeprefix("state."): v.to(runtime.device) for k, v in got.items()})
        t0 = time.perf_counter()
        if sr is not None:
            sr.resume(state)  # a resumed render's SR state came with the first stretch
        held = sr.held if sr is not None else 0
        with torch.no_grad():
            n = publish.run(Final(start, end, z), state, hashing, size, sr)
        written = n + held - (sr.held if sr is not None else 0)
        if sr is not None:
            sr.keep(state)
        runtime.synchronize()
        decode_s = time.perf_counter() - t0
        stray = [k for k in state.tensors if not (family.is_decode_state(k) or k.startswith(SR_PREFIX))]
        if stray:
            raise RenderError(f"the {family.name} family's decode keeps '{stray[0]}' in the rolling state, which its "
                              "is_decode_state does not declare: the worker cannot carry it; use runtime.decode=inline")
        cache = {k: v for k, v in state.tensors.items() if v is not None} if resumable else {}
        need = _nbytes(cache)
        new = None
        if cache and (acks[slot] is None or acks[slot].numel() < need):
            acks[slot] = new = _shared_buffer(need)
        layout = pack(acks[slot], cache) if cache else []
        outbox.put(("done", seq, slot, layout, hashing.take_digest(), new, hashing.first_put, decode_s, written))
