"""What the chunk loop reports: a chunk done, a published stretch, where a resumed render continues, the stats;
and the events of a live session, typed.

The loop (pipeline/run.py), the timestep driver (pipeline/steps.py) and the publishers (stages/publish.py,
stages/decode_worker.py) all speak these; the module imports nothing but the families' shared types.
"""

from dataclasses import dataclass, field

from avatar_cli.families.base import Chunk, RollingState


@dataclass
class ChunkDone:
    chunk: Chunk
    elapsed_s: float  # since the render started
    published: int  # frames handed to the encoder so far
    held: int = 0  # frames decoded but held back by frame super-resolution (stages/sr.py), not yet handed on


@dataclass
class Stretch:
    """A published stretch of the timeline: frames [start, end) and the sha256 of their uint8 pixels."""

    next_chunk: int  # schedule index of the first chunk still to run
    start: int
    end: int
    digest: str
    state: RollingState  # the rolling state at this point: enough to resume from here (where resumable)
    resumable: bool = True  # False: `state` is not whole here (the timestep pipeline copied no rings after it)


@dataclass
class ResumeFrom:
    next_chunk: int
    state: RollingState


@dataclass
class RenderStats:
    frames: int
    wall_s: float  # render start (models loaded) to the last frame published
    ttff_s: float  # render start to the first frame handed to the encoder
    compute_s: dict[str, float] = field(default_factory=dict)
    flops: dict[str, int] | None = None  # per stage, when the pipeline counts them (count_flops)


# --- A live session's events (`Reporter.live`): each is one JSON line, "event" first, and a line for people ---


class LiveEvent:
    """A live session's event. `name` is its JSON "event"; `fields()` the rest, in order; `text()` what a person
    reads (None: nothing to say)."""

    name: str = ""

    def fields(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}

    def as_dict(self) -> dict:
        return {"event": self.name, **self.fields()}

    def text(self) -> str | None:
        return None


@dataclass
class Ready(LiveEvent):
    """The models are loaded and the input is being read."""

    output: str
    audio: str
    fps: float
    size: list[int]
    realtime: bool
    name = "ready"

    def text(self) -> str:
        return (f"ready: reading {'stdin' if self.audio == '-' else self.audio}, "
                f"writing {'stdout' if self.output == '-' else self.output}")


@dataclass
class LiveChunk(LiveEvent):
    """A chunk's frames handed to the outputs; latency_s: from the chunk's last audio sample's arrival (None: a file
    not paced at real time has no arrival time); sr_held: frames decoded but held back by frame super-resolution
    (at most one SR chunk: they leave with a later chunk's frames)."""

    kind: str
    index: int
    start: int
    end: int
    published: int
    elapsed_s: float
    latency_s: float | None
    sr_held: int = 0
    name = "chunk"


@dataclass
class StallEvent(LiveEvent):
    """Silence inserted at `at_s` of the timeline, where the audio due was `waited_s` late on the session's clock."""

    at_s: float
    silence_s: float
    waited_s: float
    name = "stall"

    def text(self) -> str:
        return (f"stall: audio {self.waited_s:.1f} s late at {self.at_s:.2f} s: {self.silence_s:.2f} s of silence "
                "inserted")


@dataclass
class LatencyWarning(LiveEvent):
    latency_s: float
    max_latency_s: float
    name = "warning"

    def fields(self) -> dict:
        return {"latency_s": self.latency_s}

    def text(self) -> str:
        return f"warning: latency {self.latency_s:.1f} s (over live.max_latency_s {self.max_latency_s:g} s)"


@dataclass
class SlowWarning(LiveEvent):
    """This machine renders slower than real time: latency grows, nothing is dropped."""

    realtime_factor: float
    name = "warning"

    def text(self) -> str:
        speed = self.realtime_factor
        return (f"warning: this machine renders at {speed:.2f}x real time: latency grows by {1 / speed - 1:.2f} s "
                "each second; nothing is dropped")


@dataclass
class PreviewEvent(LiveEvent):
    url: str
    name = "preview"

    def text(self) -> str:
        return f"preview: {self.url}"


@dataclass
class ViewerEvent(LiveEvent):
    """What a preview page's player reported (playing, waiting, time...) at `t` seconds of the stream."""

    playback: str
    t: float
    name = "viewer"

    def text(self) -> str | None:
        return f"preview: a viewer's player is {self.playback} at {self.t:.1f} s" if self.playback != "time" else None
