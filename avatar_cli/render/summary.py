"""What a finished render or live session reports: one `Summary`, the `done` event's fields in its order."""

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class LiveFigures:
    """A live session's own figures, after the render's in its `done` event."""

    first_frame_s: float | None  # first audio sample in -> first frame handed to the output
    latency_median_s: float | None  # per chunk: its last audio sample in -> its frames handed to the output
    latency_p95_s: float | None
    stalls: int
    silence_s: float  # silence inserted where the input stalled
    record: str | None  # live.record's path


@dataclass(eq=False)
class Summary(MutableMapping):
    """The `done` event of a render or a live session. Read and written as a mapping too (`summary["frames"]`,
    `{**summary}`), as the event's JSON object; keys a caller adds (a benchmark's own figures) go to `extra` and
    follow the fields."""

    output: str
    frames: int
    video_fps: float
    duration_s: float  # the video's length
    wall_s: float  # start to the committed file (a session: to its end)
    ttff_s: float  # models loaded to the first frame handed to the encoder
    render_fps: float  # frames generated per second of generation (a resumed render's copied frames excluded)
    rtf: float  # video seconds generated per second of generation
    peak_rss_mb: float
    load_s: float  # start to the first chunk: runtime, resume, load and place
    generate_s: float
    compute_s: dict[str, float]  # seconds per step (families.base.Step names; decode_wait with a decode worker)
    resumed_at: int  # the frame generation continued from (0: from the start)
    frames_digest: str  # sha256 over every frame's pixels, in order: equal renders have equal digests
    ranks: int
    parallel: str  # how the ranks split the work, as the models were placed: single | sequence | steps
    text_cache: str  # hit | service | miss | off
    dtype: str
    dtype_reason: str
    cpu_capability: str
    transitions: bool  # chunking.transitions as resolved
    decode_worker_peak_rss_mb: float | None = None  # runtime.decode=worker only (absent from the event otherwise)
    live: LiveFigures | None = None  # a live session only (its fields follow the render's)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "live")}
        if out["decode_worker_peak_rss_mb"] is None:
            del out["decode_worker_peak_rss_mb"]
        live = {f.name: getattr(self.live, f.name) for f in fields(self.live)} if self.live is not None else {}
        return {**out, **live, **self.extra}

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _FIELDS:
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key in _FIELDS:
            raise KeyError(f"{key}: a field of the render summary")
        del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


_FIELDS = {f.name for f in fields(Summary)} - {"extra", "live"}
