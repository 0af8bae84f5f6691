"""A live session: audio that keeps arriving in, a live stream out, frames at the wall clock's pace.

    avatar render job.yaml audio=- -o - | ffplay -            # WAV (or Ogg, MP3, ADTS, FLAC, raw PCM) on stdin
    avatar render job.yaml -o out/live.m3u8                   # a file, paced at real time into HLS
    avatar render job.yaml audio=rtmp://0.0.0.0:1935/in -o rtmp://server/app/key

The same job as a render, set up by the same function (render/setup.py) and run by the same loop; only the source
and the sinks differ (`Job.live`). What a session does that a render does not:
- The audio comes from a `StreamAudio` (media/live_audio.py) whose length is known only when it ends; the chunk
  plan grows as it arrives, and a chunk whose audio is `live.stall_s` past due on the session's clock renders on
  silence (pipeline/live.py). The output's audio track reads the same timeline, so it is the input with those silences
  inserted, in step with the video.
- The frames go to a `LiveWriter` (media/live.py): MPEG-TS on stdout, FLV to RTMP, HLS, UDP/TCP, WebRTC to a WHIP
  endpoint (media/whip.py); with `live.record` also to a fragmented MP4. Frames leave on the frame clock
  (media/pacing.py: frame k at the first frame's time + k / fps) for a live input, and with `live.realtime` (auto:
  for a live output) for a file, so a file into a live output reaches the server as a stream, not a burst.
- There is no resume: a stream cannot be continued. A session that ends (its input ended, SIGINT, SIGTERM) finishes
  the chunk that is being published, drops the one being generated, and closes every output cleanly (an HLS
  playlist ends with EXT-X-ENDLIST, a recording is finalised).
- Slower than real time: the session says so from the first chunks' speed and warns whenever a chunk's latency
  passes `live.max_latency_s`. Latency then grows; nothing is dropped.

What it reports (pipeline/events.py): `ready` once the models are loaded and the input is being read; per chunk, the
latency from the arrival of the chunk's last audio sample to its frames being handed to the output (the frame clock
of media/sink.py); `stall` events; and in `done` the render's summary with the time from the first audio sample to
the first frame out, and the latencies' median and 95th percentile.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from avatar_cli.job import ResolvedJob
from avatar_cli.media.audio import AudioWindowReader
from avatar_cli.media.live import LiveTarget, live_target
from avatar_cli.media.live_audio import RawPCM, StreamAudio
from avatar_cli.media.preview import Preview
from avatar_cli.media.sink import FrameClock, Sink, now
from avatar_cli.media.whip import live_writer, read_bearer_token
from avatar_cli.media.writer import Mp4Writer, resolve_codec
from avatar_cli.pipeline.checkpoint import chain_digest
from avatar_cli.pipeline.events import (ChunkDone, LatencyWarning, LiveChunk, PreviewEvent, Ready, SlowWarning,
                                        StallEvent, ViewerEvent)
from avatar_cli.pipeline.live import ChunkRelay, RelayedAudio, Stall, growing_plan
from avatar_cli.render.file import summarize
from avatar_cli.render.setup import Built, ModelCache, Opened, build, opened
from avatar_cli.render.summary import LiveFigures, Summary
from avatar_cli.report import Reporter
from avatar_cli.runtime.distributed import collective_timeout_s
from avatar_cli.runtime.wire import Wire
from avatar_cli.spec import is_stream_input

__all__ = ["run_session"]

PREVIEW_LINGER_S = 60.0  # after the session, the preview serves on this long for a watching page to play to the end
SLOW_AFTER_CHUNKS = 2  # chunks measured before saying whether this machine keeps up with real time


class _Tee:
    """A Sink that hands every frame to several (a live output and its recording)."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def put(self, frames: np.ndarray) -> None:
        for s in self.sinks:
            s.put(frames)

    def close(self) -> object:
        return [s.close() for s in self.sinks]

    def abort(self) -> object:
        return [s.abort() for s in self.sinks]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


@dataclass
class Endpoints:
    """A session's source and outputs on this rank: rank 0 reads the input and writes every output; another rank
    reads the samples rank 0 relays, and writes nothing."""

    realtime: bool
    target: LiveTarget | None  # the live output (None: an MP4 file, renamed into place when the session ends)
    audio: StreamAudio | None = None  # a live input, on rank 0
    reader: AudioWindowReader | None = None  # a file input
    relayed: RelayedAudio | None = None  # a live input, on a rank other than 0
    sinks: list[Sink] = field(default_factory=list)
    preview: Preview | None = None

    @property
    def sink(self) -> Sink | None:
        return None if not self.sinks else self.sinks[0] if len(self.sinks) == 1 else _Tee(self.sinks)

    def close(self) -> None:
        if self.preview is not None:
            self.preview.linger(PREVIEW_LINGER_S)
            self.preview.close()
        for source in (self.audio, self.reader):
            if source is not None:
                source.close()


@contextlib.contextmanager
def _stdout_for_stream(main: bool, url: str | None) -> Iterator[int | None]:
    """The stream owns stdout (`-o -`): whatever else would print there goes to stderr while the session runs.
    Yields the stream's file descriptor (None: stdout is not the output)."""
    if not (main and url == "-"):
        yield None
        return
    fd = os.dup(1)
    os.dup2(2, 1)
    try:
        yield fd
    finally:
        os.dup2(fd, 1)
        os.close(fd)


def _target(p: ResolvedJob) -> LiveTarget | None:
    """The job's live output (None: an MP4 file), with a WHIP endpoint's bearer token."""
    live, token_file = p.job.spec.live, p.job.bearer_token_file
    return live_target(str(p.job.output), keep_segments=live.hls_keep_segments, hls_segment_s=live.hls_segment_s,
                       bearer_token=read_bearer_token(token_file) if token_file is not None else None)


def _open_endpoints(p: ResolvedJob, job: Opened, reporter: Reporter, target: LiveTarget | None,
                    stdout_fd: int | None) -> Endpoints:
    """Open the input and the outputs (`target`: the live one, None for an MP4 file) before any model loads: a
    stream that does not answer fails first."""
    spec, live, rate = p.job.spec, p.job.spec.live, p.model.family.geometry.sample_rate
    streaming = is_stream_input(str(p.job.audio))
    # A live input into a live output is always on the frame clock (its chunk plan times its waits against it).
    ends = Endpoints(target is not None if live.realtime == "auto" or streaming else live.realtime, target)
    if streaming and not job.main:
        ends.relayed = RelayedAudio(rate)  # the windows rank 0 reads, sent with each chunk
    elif streaming:
        raw = live.raw_audio
        ends.audio = StreamAudio.open(str(p.job.audio), rate=rate, timeout_s=live.first_audio_s,
                                      raw=RawPCM(raw.format, raw.rate, raw.channels) if raw.format else None)
    else:
        ends.reader = AudioWindowReader(p.job.audio, sample_rate=rate, info=p.audio)
    if not job.main:
        return ends
    common = dict(width=p.size[0], height=p.size[1], fps=spec.video.fps, crf=spec.video.crf,
                  preset=spec.video.preset, codec=resolve_codec(spec.video.codec.value, str(job.runtime.device)))

    def track(name: str):  # each writer reads the audio timeline (or the file) on its own
        return ends.audio.feed(name) if ends.audio is not None else str(p.job.audio)

    if target is not None:
        stream = os.fdopen(stdout_fd, "wb", buffering=0, closefd=False) if stdout_fd is not None else None
        ends.sinks.append(live_writer(target, realtime=ends.realtime, stdout=stream, audio_path=track("output"),
                                      **common))
    else:  # a live input into an MP4 file: written as a render writes it, renamed when the session ends
        ends.sinks.append(Mp4Writer(p.job.partial_output, total_frames=2**62, audio_path=track("output"), **common))
    if live.preview:
        ends.preview = Preview(Path(str(p.job.output)),
                               on_first=lambda event, t: reporter.live(ViewerEvent(event, round(t, 3))))
        reporter.live(PreviewEvent(ends.preview.url))
    if p.job.record is not None:
        p.job.record.parent.mkdir(parents=True, exist_ok=True)
        ends.sinks.append(Mp4Writer(p.job.record, total_frames=2**62, audio_path=track("record"), **common))
    return ends


@dataclass
class Watch:
    """What a session measures as it runs: stalls, waits for audio, and each chunk's latency on the frame clock."""

    rate: int
    fps: float
    max_latency_s: float
    first_audio: float | None = None  # when the first audio sample arrived (media/sink.py `now()`)
    stalls: list[Stall] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # time spent waiting for audio: not the render's
    latencies: list[float] = field(default_factory=list)
    stretches: list[list] = field(default_factory=list)  # (start, end, digest) of each stretch: the frames_digest
    warned_slow: bool = False

    def on_stall(self, s: Stall, reporter: Reporter) -> None:
        """One pause of the source is one stall, however many chunks its silence spans: silence that continues the
        last (it starts where that one ended) adds to it, and only a new pause is reported."""
        last = self.stalls[-1] if self.stalls else None
        if last is not None and s.at == last.at + last.samples:
            self.stalls[-1] = Stall(last.at, last.samples + s.samples, last.waited_s)
            return
        self.stalls.append(s)
        reporter.live(StallEvent(round(s.at / self.rate, 3), round(s.samples / self.rate, 3), round(s.waited_s, 3)))

    def latency(self, end: int, clock: FrameClock | None, ends: Endpoints) -> float | None:
        """From the arrival of the chunk's last audio sample (the input's last, where the video's last frame runs
        past it) to its last frame handed to the outputs; None where there is no arrival time (a file not paced)."""
        if clock is None or end not in clock.put_at:
            return None
        audio = ends.audio
        if audio is not None:
            arrived = audio.arrival(min(int(np.ceil(end * self.rate / self.fps)), audio.arrived) - 1)
        else:
            arrived = self.first_audio + end / self.fps if ends.realtime else None
        if arrived is None:
            return None
        latency = max(0.0, clock.put_at[end] - arrived)
        self.latencies.append(latency)
        return latency

    def on_chunk(self, d: ChunkDone, clock: FrameClock | None, ends: Endpoints, reporter: Reporter) -> None:
        latency = self.latency(d.published, clock, ends)
        reporter.live(LiveChunk(d.chunk.kind, d.chunk.index, d.chunk.keep[0], d.chunk.keep[1], d.published,
                                round(d.elapsed_s, 4), None if latency is None else round(latency, 4)))
        if latency is not None and latency > self.max_latency_s:
            reporter.live(LatencyWarning(round(latency, 3), self.max_latency_s))
        busy = d.elapsed_s - sum(self.waits)  # the render's own time, waits for audio left out
        speed = d.published / self.fps / busy if busy > 0 else float("inf")
        if not self.warned_slow and len(self.latencies) >= SLOW_AFTER_CHUNKS and speed < 1.0:
            self.warned_slow = True
            reporter.live(SlowWarning(round(speed, 3)))

    def figures(self, clock: FrameClock | None, record: Path | None) -> LiveFigures:
        lat = self.latencies
        first = clock.first if clock is not None else None
        return LiveFigures(
            first_frame_s=round(first - self.first_audio, 4) if first is not None and self.first_audio is not None
            else None,
            latency_median_s=round(statistics.median(lat), 4) if lat else None,
            latency_p95_s=round(_percentile(lat, 0.95), 4) if lat else None,
            stalls=len(self.stalls), silence_s=round(sum(s.samples for s in self.stalls) / self.rate, 4),
            record=str(record) if record is not None else None)


def _chunks(p: ResolvedJob, job: Opened, built: Built, ends: Endpoints, watch: Watch, reporter: Reporter):
    """The session's chunk plan and the audio it reads: a live input's plan grows as the audio arrives (and under
    torchrun reaches the other ranks with its samples over a gloo group of its own); a file's is made once."""
    spec, live, family, pipeline = p.job.spec, p.job.spec.live, p.model.family, built.pipeline
    loaded = {n: m.model for n, m in built.modules.items()}
    lookahead_s = family.audio_lookahead_s(loaded)
    streaming_in = ends.reader is None
    # Made by every rank now (before rank 0 waits for the first audio), its timeout lets the source take that long.
    wire = Wire.gloo(live.first_audio_s + live.stall_s + collective_timeout_s()) \
        if streaming_in and job.dist.enabled else None
    reporter.live(Ready(str(p.job.output), str(p.job.audio), spec.video.fps, list(p.size), ends.realtime))
    if ends.audio is not None:
        ends.audio.wait_started(live.first_audio_s)
        watch.first_audio = ends.audio.arrival(0) or now()
        chunks = growing_plan(lambda total: pipeline.schedule(spec, total), ends.audio, spec.video.fps,
                              lookahead_s=lookahead_s, stall_s=live.stall_s, start=watch.first_audio,
                              on_stall=lambda s: watch.on_stall(s, reporter), on_wait=watch.waits.append)
        source = ends.audio
    elif ends.relayed is not None:
        chunks, source = None, ends.relayed
    else:
        watch.first_audio = now()
        chunks, source = pipeline.schedule(spec, p.frames), ends.reader
    if wire is not None:  # every rank runs the chunks rank 0's plan hands out, on its samples
        rate, fps = watch.rate, spec.video.fps
        frame = int(np.ceil(rate / fps)) + 1
        behind = int(np.ceil(family.audio_lookbehind_s(loaded) * rate)) + frame
        ahead = int(np.ceil(lookahead_s * rate)) + frame

        def span(chunk) -> tuple[int, int]:  # the samples a chunk's features read, and a frame to spare
            return int(chunk.start * rate // fps) - behind, int(np.ceil(chunk.end * rate / fps)) + ahead

        relay = ChunkRelay(wire, job.dist.world_size, span, fps)
        chunks = relay.send(chunks, ends.audio) if job.main else relay.receive(ends.relayed)
    return chunks, source


def run_session(p: ResolvedJob, reporter: Reporter, models: ModelCache | None = None) -> Summary:
    """Run a live session (module docstring) for a resolved job whose `Job.live` holds."""
    t_start = now()
    target = _target(p)
    with opened(p, reporter) as job:
        if job.main and target is not None and target.url == "-":
            reporter.off_stdout()
        with _stdout_for_stream(job.main, target.url if target is not None else None) as stdout_fd:
            ends = _open_endpoints(p, job, reporter, target, stdout_fd)
            try:
                built = build(p, job, reporter, models)
                return _run(p, job, built, ends, reporter, t_start)
            finally:
                ends.close()


def _run(p: ResolvedJob, job: Opened, built: Built, ends: Endpoints, reporter: Reporter, t_start: float) -> Summary:
    spec, live = p.job.spec, p.job.spec.live
    watch = Watch(p.model.family.geometry.sample_rate, spec.video.fps, live.max_latency_s)
    chunks, source = _chunks(p, job, built, ends, watch, reporter)
    out = built.pipeline.publish_to(ends.sink, p.size)
    t_render = now()
    try:
        stats = built.pipeline.run(spec, built.image, source, p.frames, out,
                                   lambda d: watch.on_chunk(d, out.clock, ends, reporter),
                                   lambda s: watch.stretches.append([s.start, s.end, s.digest]), chunks=chunks,
                                   copies=lambda block: False)  # a stream never resumes: no ring copies
        out.close()
    except BaseException:
        out.abort()  # the chunk in flight is dropped; every output closes cleanly with what it has
        raise
    gen_s = now() - t_render
    if job.main and ends.target is None:
        os.replace(p.job.partial_output, p.job.output)
    summary = summarize(p, job, built, stats, chain_digest(watch.stretches), t_start, t_render, gen_s)
    summary.live = watch.figures(out.clock, p.job.record)
    return summary
