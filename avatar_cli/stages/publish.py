"""Decode and publish: VAE-decode final latents in timeline order and hand the frames to a Sink.

Step 4 of the chunk loop goes through a `Publisher`: final latents in, published stretches (with their digests)
out. `PublishHere` decodes in this process (the DecodePublish stage) into a Sink; the decode worker
(stages/decode_worker.py) decodes in a process of its own. The loop never asks which one it has.
"""

from dataclasses import replace
from typing import Protocol

import torch
import torch.nn.functional as F

from avatar_cli.families.base import Final, RollingState, Step
from avatar_cli.media.sink import EMPTY_DIGEST, FrameClock, HashingSink, Sink
from avatar_cli.pipeline.events import Stretch
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
    held: frames decoded but not yet in the Sink (frame super-resolution holds some back until it knows more come).

    Stretches count the frames that reached the Sink (`state.published`), which lag the decoded ones by `held`.
    """

    needs: tuple[str, ...]
    first_put: float | None
    seconds: dict[str, float]
    held: int

    def publish(self, final: Final, next_chunk: int, state: RollingState) -> list[Stretch]:
        """Publish `final` (refined latents; `state.published` counts it after this); returns the stretches whose
        frames are now in the Sink, each with the rolling state to resume after it (the ones in flight come later)."""
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
