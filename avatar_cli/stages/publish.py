"""Decode and publish: VAE-decode final latents in timeline order and hand the frames to a Sink.

Step 4 of the chunk loop goes through a `Publisher`: final latents in, published stretches (with their digests)
out. `PublishHere` decodes in this process (the DecodePublish stage) into a Sink, `PublishThread` the same on a
thread of its own while the loop goes on; the decode worker (stages/decode_worker.py) decodes in a process of its
own. The loop never asks which one it has.
"""

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch
import torch.nn.functional as F

from avatar_cli.families.base import Final, RollingState, Step
from avatar_cli.media.sink import EMPTY_DIGEST, FrameClock, HashingSink, Sink
from avatar_cli.pipeline.events import Stretch
from avatar_cli.runtime.device import CoreShare
from avatar_cli.stages.base import Stage
from avatar_cli.stages.sr import FrameSR


def fit_frames(x: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """x (T, 3, S, S) -> (T, 3, height, width): scaled to fit, centred, black bars where aspects differ."""
    T, _, h, w = x.shape
    if (w, h) == (width, height):
        return x
    scale = min(width / w, height / h)
    nw, nh = max(2, round(w * scale)), max(2, round(h * scale))
    x = F.interpolate(x, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)  # (T, 3, nh, nw)
    if (nw, nh) == (width, height):
        return x
    out = x.new_full((T, 3, height, width), -1.0)  # black in [-1, 1]
    top, left = (height - nh) // 2, (width - nw) // 2
    out[:, :, top:top + nh, left:left + nw] = x
    return out


def to_sink(x: torch.Tensor, sink: Sink) -> None:
    """x (t, 3, H, W) in [-1, 1] at the output size -> uint8 frames into the Sink."""
    if len(x):
        frames = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)  # (t, H, W, 3)
        sink.put(frames.cpu().numpy())


class DecodePublish(Stage):
    step = Step.decode

    def run(self, final: Final, state: RollingState, sink: Sink | None, size: tuple[int, int],
            sr: FrameSR | None = None) -> int:
        """final: consecutive final latents; the decoder's cache carries in `state`. Returns frames decoded.
        sink None: decode for the rolling state only (a rank that writes nothing, of a family whose later chunks
        are conditioned on decoded frames). sr: the frames go through frame super-resolution on their way to the
        Sink (fitted to its input size first; it may hold some back: FrameSR.held)."""

        def put(x: torch.Tensor) -> None:  # x (t, 3, h, w) in [-1, 1]
            if sink is None:
                return
            x = fit_frames(x.float(), *(sr.plan.lq if sr is not None else size))  # (t, 3, height, width)
            to_sink(sr.push(x) if sr is not None else x, sink)  # (t', 3, H, W)

        return self.family.decode(self.models, final, state, put)


class Publisher(Protocol):
    """What the chunk loop hands final latents to, wherever they are decoded.

    needs: the components `publish` runs in this process (none: it decodes elsewhere, or not at all); the loop
    brings them onto the device around it and times it as the decode step. first_put: when the first
    frame reached the Sink (media/sink.py `now()`) (None: none yet). seconds: compute seconds it measured itself, added to the loop's.
    refines: False: `publish` is handed refined latents (the loop ran the family's refine step); True: the latents
    before it, with `refine` (the family's refine step bound to this job's models and reference) to run itself.
    held: frames decoded but not yet in the Sink (frame super-resolution holds some back until it knows more come).

    Stretches count the frames that reached the Sink (`state.published`), which lag the decoded ones by `held`.
    """

    needs: tuple[str, ...]
    first_put: float | None
    seconds: dict[str, float]
    refines: bool
    held: int

    def publish(self, final: Final, next_chunk: int, state: RollingState,
                refine: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[Stretch]:
        """Publish `final` (refined latents unless `refines`; `state.published` counts it after this); returns the
        stretches whose frames are now in the Sink, each with the rolling state to resume after it (the ones in
        flight come later). refine: given when `refines`, z_lo -> z_hi."""
        ...

    def finish(self, state: RollingState) -> list[Stretch]:
        """At the end: wait for every stretch in flight and put what is held back into the Sink (`state`, the
        last published one's, counts it); their Stretches, in order."""
        ...

    def close(self) -> object: ...  # finish the Sink

    def abort(self) -> object: ...  # after a failure: stop, keeping what the Sink has written


class PublishHere:
    """The DecodePublish stage in this process, into `sink` (None: a rank that writes nothing; it decodes only
    when the family conditions later chunks on decoded frames, and then only for the rolling state). sr: frame
    super-resolution between the decode and the Sink (only where there is a Sink); its state goes into the rolling
    state after each stretch."""

    refines = False  # the loop runs the family's refine step before `publish`

    def __init__(self, stage: DecodePublish, sink: Sink | None, size: tuple[int, int], sr: FrameSR | None = None):
        self.stage, self.size = stage, size
        self.hashing = HashingSink(sink) if sink is not None else None
        self.sr = sr if sink is not None else None
        self.decodes = sink is not None or stage.family.decode_feeds_back
        self.needs = stage.needs if self.decodes else ()
        self.seconds: dict[str, float] = {}
        self._next_chunk = 0

    @property
    def first_put(self) -> float | None:
        """When the first frame reached the Sink (media/sink.py `now()`); None: none yet, or a rank that writes
        nothing."""
        return self.hashing.first_put if self.hashing is not None else None

    @property
    def clock(self) -> FrameClock | None:
        return self.hashing.clock if self.hashing is not None else None

    @property
    def held(self) -> int:
        return self.sr.held if self.sr is not None else 0

    def publish(self, final: Final, next_chunk: int, state: RollingState) -> list[Stretch]:
        self._next_chunk = next_chunk
        if self.sr is not None:
            self.sr.resume(state)
        held = self.held
        n = self.stage.run(final, state, self.hashing, self.size, self.sr) if self.decodes else final.frames
        return [self._stretch(n + held - self.held, state)]

    def finish(self, state: RollingState) -> list[Stretch]:
        if self.sr is None or self.hashing is None:
            return []
        self.sr.resume(state)  # a render resumed after its last chunk: the frames SR held are in its state
        held = self.held
        with torch.no_grad():
            to_sink(self.sr.finish(), self.hashing)  # (held, 3, H, W)
        # No resume point after it: a finished stream takes no more frames, and there are none to come.
        return [replace(self._stretch(held - self.held, state), resumable=False)]

    def _stretch(self, n: int, state: RollingState) -> Stretch:
        """The n frames just put into the Sink; with SR, its state (held frames included) into `state`."""
        state.published += n
        if self.sr is not None:
            self.sr.keep(state)
        digest = self.hashing.take_digest() if self.hashing is not None else EMPTY_DIGEST
        return Stretch(self._next_chunk, state.published - n, state.published, digest, state)

    def close(self) -> object:
        return self.hashing.close() if self.hashing is not None else None

    def abort(self) -> object:
        return self.hashing.abort() if self.hashing is not None else None


class PublishThread:
    """The DecodePublish stage on a thread of this process (runtime.decode: thread), into `sink`: the loop hands
    each stretch over and goes on with the next chunk while the thread decodes it, on one CPU thread of its own
    (`cores`, runtime/device.py CoreShare: the loop computes on the other threads meanwhile, on all of them again
    once the thread is idle). It runs the family's refine step (the super-resolution) before the decode, so the
    loop hands it the latents as the DiT left them. On a small CPU this overlaps two streams of small ops, each on
    its own core, where both on two threads would spend much of their time waking and joining the pool.

    As the decode worker (stages/decode_worker.py) does, it keeps the decoder's cache (the state tensors
    `family.is_decode_state` names) on its own side from the first stretch on, hands back each stretch once its
    frames are in the Sink, with the loop's rolling state as it was when the stretch was handed over (a copy, where
    a resume point may follow: `resume_at(block)`) plus the decoder cache after it, and holds at most DEPTH
    stretches in flight. An error in the thread is raised in the loop at its next call. `needs` is empty: nothing
    moves onto the device for it, and the loop does not time it; `seconds` says the thread's decode seconds and the
    loop's seconds blocked on it."""

    DEPTH = 2  # one stretch decoding while the next waits: the loop never waits on the handover itself
    needs: tuple[str, ...] = ()
    refines = True  # the super-resolution runs on the thread too: it is the same kind of small convolutions
    held = 0  # no frame super-resolution here (job.resolve_decode keeps a job with sr.model inline)

    def __init__(self, stage: DecodePublish, sink: Sink, size: tuple[int, int], cores: CoreShare,
                 resume_at: Callable[[int], bool] = lambda block: True):
        self.stage, self.size, self.cores, self.resume_at = stage, size, cores, resume_at
        self.hashing = HashingSink(sink)
        self.seconds: dict[str, float] = {"sr": 0.0, "decode": 0.0, "decode_wait": 0.0}
        self._decode_state = RollingState()  # the decoder cache, the thread's from the first stretch on
        self._handed_cache = False
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._sent: deque[tuple[int, int, RollingState, bool]] = deque()  # (next_chunk, start, state, resumable)
        self._failed: BaseException | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None  # started with the first stretch

    @property
    def first_put(self) -> float | None:
        return self.hashing.first_put

    @property
    def clock(self) -> FrameClock:
        return self.hashing.clock

    def publish(self, final: Final, next_chunk: int, state: RollingState,
                refine: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[Stretch]:
        state.published += final.frames
        if self._thread is None:
            self.cores.open()
            self._thread = threading.Thread(target=self._main, name="avatar-decode", daemon=True)
            self._thread.start()
        if not self._handed_cache:  # a resumed render's decoder cache: the thread's from now on
            own = [k for k in state.tensors if self.stage.family.is_decode_state(k)]
            self._decode_state.tensors.update({k: state.tensors.pop(k) for k in own})
            self._handed_cache = True
        done = self._collect(block=False)
        while len(self._sent) >= self.DEPTH:
            done += self._collect(block=True)
        resumable = self.resume_at(next_chunk - 1)
        # The loop goes on changing its state: what a resume point after this stretch needs is kept as it is now.
        tensors = {k: v.detach().to("cpu", copy=True) for k, v in state.tensors.items() if v is not None} \
            if resumable else {}
        self._sent.append((next_chunk, state.published - final.frames,
                           RollingState(tensors, list(state.held), state.published), resumable))
        self.cores.lend()
        self._todo.put((final, refine))
        return done

    def finish(self, state: RollingState | None = None) -> list[Stretch]:
        done = []
        while self._sent:
            done += self._collect(block=True)
        return done

    def close(self) -> object:
        self.finish()
        self._stop()
        return self.hashing.close()

    def abort(self) -> object:
        """After a failure: the stretches not yet decoded are dropped; the Sink keeps what it has."""
        while True:
            try:
                self._todo.get_nowait()
                self.cores.returned()
            except queue.Empty:
                break
        self._stop()
        return self.hashing.abort()

    def _stop(self) -> None:
        if not self._stopped and self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self.cores.close()
        self._stopped = True

    def _collect(self, block: bool) -> list[Stretch]:
        """The stretches the thread finished (waiting for one when `block`), in order; raises the thread's error."""
        done = []
        while self._sent:
            if self._failed is not None:
                raise self._failed
            t0 = time.perf_counter()
            try:
                msg = self._done.get(timeout=None) if block and not done else self._done.get_nowait()
            except queue.Empty:
                break
            finally:
                self.seconds["decode_wait"] += time.perf_counter() - t0 if block and not done else 0.0
            self.cores.sync()
            if isinstance(msg, BaseException):
                self._failed = msg
                raise msg
            digest, cache, sr_s, decode_s = msg
            self.seconds["sr"] += sr_s
            self.seconds["decode"] += decode_s
            next_chunk, start, state, resumable = self._sent.popleft()
            state.tensors.update(cache)
            done.append(Stretch(next_chunk, start, state.published, digest, state, resumable))
        return done

    def _main(self) -> None:
        self.cores.helper_thread()
        with torch.no_grad():  # grad mode is per thread
            while (item := self._todo.get()) is not None:
                final, refine = item
                t0 = time.perf_counter()
                try:
                    final = Final(final.start, final.end, refine(final.z))
                    t1 = time.perf_counter()
                    self.stage.run(final, self._decode_state, self.hashing, self.size)
                    msg = (self.hashing.take_digest(), dict(self._decode_state.tensors), t1 - t0,
                           time.perf_counter() - t1)
                except BaseException as e:  # raised in the loop; this thread decodes nothing more
                    self._done.put(e)
                    self.cores.returned()
                    return
                self.cores.returned()
                self._done.put(msg)
