"""A live session: audio that keeps arriving in, a live stream out, frames at the wall clock's pace.

    avatar render job.yaml audio=- -o - | ffplay -            # WAV (or Ogg, MP3, ADTS, FLAC, raw PCM) on stdin
    avatar render job.yaml -o out/live.m3u8                   # a file, paced at real time into HLS
    avatar render job.yaml audio=rtmp://0.0.0.0:1935/in -o rtmp://server/app/key

The same job spec as a render; only `audio` and `output` differ (`Job.live`). What a session does that a render
does not:
- The audio comes from a `StreamAudio` (media/live_audio.py) whose length is known only when it ends; the chunk
  plan grows as it arrives, and a chunk whose audio stalls renders on silence after `live.stall_s`
  (pipeline/live.py). The output's audio track reads the same timeline, so it is the input with those silences
  inserted, in step with the video.
- The frames go to a `LiveWriter` (media/live.py): MPEG-TS on stdout, FLV to RTMP, HLS, UDP/TCP; with `live.record`
  also to a fragmented MP4. With `live.realtime` (auto: for a live output) frames leave at the stream's pace, so a
  file into a live output reaches the server as a stream, not a burst.
- There is no resume: a stream cannot be continued. A session that ends (its input ended, SIGINT, SIGTERM) finishes
  the chunk that is being published, drops the one being generated, and closes every output cleanly (an HLS
  playlist ends with EXT-X-ENDLIST, a recording is finalised).
- Slower than real time: the session says so from the first chunks' speed and warns whenever a chunk's latency
  passes `live.max_latency_s`. Latency then grows; nothing is dropped.

What it reports: a `ready` event once the models are loaded and the input is being read; per chunk, the latency from
the arrival of the chunk's last audio sample to its frames being handed to the output; `stall` events; and in `done`
the time from the first audio sample to the first frame out, and the latencies' median and 95th percentile.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from avatar_cli.job import ResolvedJob, Split
from avatar_cli.media.audio import AudioWindowReader
from avatar_cli.media.live import LiveWriter, live_target
from avatar_cli.media.live_audio import RawPCM, StreamAudio
from avatar_cli.media.preview import Preview
from avatar_cli.media.sink import Sink
from avatar_cli.media.writer import Mp4Writer, resolve_codec
from avatar_cli.pipeline.checkpoint import chain_digest
from avatar_cli.pipeline.events import ChunkDone
from avatar_cli.pipeline.live import ChunkRelay, GlooWire, RelayedAudio, Stall, growing_plan
from avatar_cli.pipeline.run import Pipeline
from avatar_cli.pipeline.steps import rank_skips
from avatar_cli.prompts import cache as prompt_cache
from avatar_cli.report import Reporter, peak_rss_mb
from avatar_cli.runner import ModelCache, place_rings, setup_runtime
from avatar_cli.runtime.distributed import Dist, collective_timeout_s
from avatar_cli.spec import is_stream_input

__all__ = ["run_session", "SessionSummary"]

PREVIEW_LINGER_S = 60.0  # after the session, the preview serves on this long for a watching page to play to the end
SLOW_AFTER_CHUNKS = 2  # chunks measured before saying whether this machine keeps up with real time


@dataclass
class SessionSummary:
    """The `done` event of a session."""

    output: str
    frames: int
    video_fps: float
    duration_s: float
    wall_s: float
    first_frame_s: float | None  # first audio sample in -> first frame handed to the output
    latency_median_s: float | None  # per chunk: its last audio sample in -> its frames handed to the output
    latency_p95_s: float | None
    stalls: int
    silence_s: float  # silence inserted where the input stalled
    frames_digest: str
    peak_rss_mb: float
    record: str | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


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


class _Clock:
    """When each frame was handed to the outputs (monotonic), for the latency figures."""

    def __init__(self, sink: Sink):
        self.sink, self.frames, self.first = sink, 0, None
        self.put_at: dict[int, float] = {}  # last frame index of each put -> time

    def put(self, frames: np.ndarray) -> None:
        self.sink.put(frames)
        now = time.monotonic()
        self.first = self.first if self.first is not None else now
        self.frames += len(frames)
        self.put_at[self.frames] = now

    def close(self) -> object:
        return self.sink.close()

    def abort(self) -> object:
        return self.sink.abort()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_session(p: ResolvedJob, reporter: Reporter, models: ModelCache | None = None) -> SessionSummary:
    """Run a live session (module docstring) for a resolved job whose `Job.live` holds."""
    t_start = time.monotonic()
    spec, live, job = p.job.spec, p.job.spec.live, p.job
    family = p.model.family
    streaming_in = is_stream_input(str(job.audio))
    steps = p.parallel == Split.steps  # the timestep pipeline: rank 0 decodes, rank 1 + s runs step s
    runtime, dist = setup_runtime(spec, p.runtime)
    main = dist.is_main  # under torchrun rank 0 reads the source and writes the outputs; every rank computes
    if main and dist.enabled:
        reporter.info(f"parallel: {p.parallel.value} ({p.parallel_why})")
    fps, rate = spec.video.fps, family.geometry.sample_rate
    target = live_target(str(job.output), keep_segments=live.hls_keep_segments)
    realtime = live.realtime if isinstance(live.realtime, bool) else target is not None

    # The stream owns stdout: whatever else would print there goes to stderr while the session runs.
    stdout_fd = None
    if main and target is not None and target.url == "-":
        reporter.off_stdout()
        stdout_fd = os.dup(1)
        os.dup2(2, 1)
    audio = reader = preview = relayed = None
    sinks: list[Sink] = []
    try:
        if streaming_in and not main:
            relayed = RelayedAudio(rate)  # the windows rank 0 reads, sent with each chunk
        elif streaming_in:
            raw = live.raw_audio
            audio = StreamAudio.open(str(job.audio), rate=rate, timeout_s=live.first_audio_s,
                                     raw=RawPCM(raw.format, raw.rate, raw.channels) if raw.format else None)
        else:
            reader = AudioWindowReader(job.audio, sample_rate=rate, info=p.audio)

        codec = resolve_codec(spec.video.codec.value, str(runtime.device))
        common = dict(width=p.size[0], height=p.size[1], fps=fps, codec=codec, crf=spec.video.crf,
                      preset=spec.video.preset)

        def track(name: str):  # each writer reads the audio timeline (or the file) on its own
            return audio.feed(name) if audio is not None else str(job.audio)

        if not main:
            pass  # a rank other than 0 writes nothing
        elif target is not None:
            stream = os.fdopen(stdout_fd, "wb", buffering=0, closefd=False) if stdout_fd is not None else None
            sinks.append(LiveWriter(target, realtime=realtime, stdout=stream, audio_path=track("output"), **common))
        else:  # a live input into an MP4 file: written as a render writes it, renamed when the session ends
            sinks.append(Mp4Writer(job.partial_output, total_frames=2**62, audio_path=track("output"), **common))
        if main and live.preview:
            preview = Preview(Path(str(job.output)), on_first=lambda event, t: reporter.live(
                {"event": "viewer", "playback": event, "t": round(t, 3)},
                f"preview: a viewer's player is {event} at {t:.1f} s" if event != "time" else None))
            reporter.live({"event": "preview", "url": preview.url}, f"preview: {preview.url}")
        if main and job.record is not None:
            job.record.parent.mkdir(parents=True, exist_ok=True)
            sinks.append(Mp4Writer(job.record, total_frames=2**62, audio_path=track("record"), **common))
        clock = _Clock(sinks[0] if len(sinks) == 1 else _Tee(sinks)) if main else None

        prompts = prompt_cache.job_prompts(spec.runtime.text_cache, job.path.parent, p.model, runtime.dtype,
                                           reporter.info, write=main, service=spec.runtime.text_service,
                                           weights=spec.runtime.weights.value)
        prompt_cache.ready(prompts, spec.prompt, runtime.device, dist)
        # The timestep pipeline: each rank loads what its role runs and places it alone (nothing is sharded).
        absent = rank_skips(family, dist.rank) if steps else set()
        skip = {*prompt_cache.skipped(prompts, spec.prompt), *absent}
        rings, _ = place_rings(p, runtime, skip)
        modules, placement = (models or ModelCache()).get(p.model, runtime, Dist() if steps else dist, spec.runtime,
                                                          reporter, skip=skip, rings=rings)
        pipeline = Pipeline(modules, family, runtime, placement, prompts=prompts,
                            steps_dist=dist if steps else None, absent=absent)
        image = family.fit_reference(p.image, *p.gen_size)  # (3, H, W) in [-1, 1]

        # Under torchrun the chunks and their audio reach the other ranks over a gloo group of their own, made by
        # every rank now (before rank 0 waits for the first audio), whose timeout lets the source take that long.
        if streaming_in and dist.enabled:
            wire = GlooWire(live.first_audio_s + live.stall_s + collective_timeout_s())

        stalls: list[Stall] = []
        waits: list[float] = []  # time spent waiting for audio: not the render's
        latencies: list[float] = []
        first_audio: float | None = None  # when the first audio sample arrived (monotonic)

        def on_stall(s: Stall) -> None:
            stalls.append(s)
            reporter.live({"event": "stall", "at_s": round(s.at / rate, 3), "silence_s": round(s.samples / rate, 3),
                           "waited_s": round(s.waited_s, 3)},
                          f"stall: no audio for {s.waited_s:.1f} s at {s.at / rate:.2f} s: "
                          f"{s.samples / rate:.2f} s of silence inserted")

        reporter.live({"event": "ready", "output": str(job.output), "audio": str(job.audio), "fps": fps,
                       "size": list(p.size), "realtime": realtime},
                      f"ready: reading {'stdin' if str(job.audio) == '-' else job.audio}, "
                      f"writing {'stdout' if str(job.output) == '-' else job.output}")
        loaded = {n: m.model for n, m in modules.items()}
        lookahead_s = family.audio_lookahead_s(loaded)
        if audio is not None:
            audio.wait_started(live.first_audio_s)
            first_audio = audio.arrival(0) or time.monotonic()
            chunks = growing_plan(lambda total: pipeline.schedule(spec, total), audio, fps, lookahead_s=lookahead_s,
                                  stall_s=live.stall_s, on_stall=on_stall, on_wait=waits.append)
            source = audio
        elif relayed is not None:
            chunks, source = None, relayed
        else:
            first_audio = time.monotonic()
            chunks = pipeline.schedule(spec, p.frames)
            source = reader
        if streaming_in and dist.enabled:  # every rank runs the chunks rank 0's plan hands out, on its samples
            frame = int(np.ceil(rate / fps)) + 1
            behind = int(np.ceil(family.audio_lookbehind_s(loaded) * rate)) + frame
            ahead = int(np.ceil(lookahead_s * rate)) + frame

            def span(chunk) -> tuple[int, int]:  # the samples a chunk's features read, and a frame to spare
                return int(chunk.start * rate // fps) - behind, int(np.ceil(chunk.end * rate / fps)) + ahead

            relay = ChunkRelay(wire, dist.world_size, span, fps)
            chunks = relay.send(chunks, audio) if main else relay.receive(relayed)
        out = pipeline.publish_to(clock, p.size)
        stretches: list[list] = []  # (start, end, digest) of each published stretch: the render's frames_digest
        warned_slow = False

        def on_chunk(d: ChunkDone) -> None:
            nonlocal warned_slow
            end = d.published
            latency = None
            if clock is not None and end in clock.put_at:
                # The chunk's last audio sample (the input's last, where the video's last frame runs past it).
                arrived = audio.arrival(min(int(np.ceil(end * rate / fps)), audio.arrived) - 1) if audio is not None \
                    else first_audio + end / fps if realtime else None  # a file not paced: no arrival time
                if arrived is not None:
                    latency = max(0.0, clock.put_at[end] - arrived)
                    latencies.append(latency)
            reporter.live({"event": "chunk", "kind": d.chunk.kind, "index": d.chunk.index, "start": d.chunk.keep[0],
                           "end": d.chunk.keep[1], "published": end, "elapsed_s": round(d.elapsed_s, 4),
                           "latency_s": None if latency is None else round(latency, 4)}, None)
            if latency is not None and latency > live.max_latency_s:
                reporter.live({"event": "warning", "latency_s": round(latency, 3)},
                              f"warning: latency {latency:.1f} s (over live.max_latency_s {live.max_latency_s:g} s)")
            busy = d.elapsed_s - sum(waits)  # the render's own time, waits for audio left out
            speed = end / fps / busy if busy > 0 else float("inf")
            if not warned_slow and len(latencies) >= SLOW_AFTER_CHUNKS and speed < 1.0:
                warned_slow = True
                reporter.live({"event": "warning", "realtime_factor": round(speed, 3)},
                              f"warning: this machine renders at {speed:.2f}x real time: latency grows by "
                              f"{1 / speed - 1:.2f} s each second; nothing is dropped")

        try:
            stats = pipeline.run(spec, image, source, p.frames, out, on_chunk,
                                 lambda s: stretches.append([s.start, s.end, s.digest]), chunks=chunks,
                                 copies=lambda block: False)  # a stream never resumes: no ring copies
            out.close()
        except BaseException:
            out.abort()  # the chunk in flight is dropped; every output closes cleanly with what it has
            raise
        if main and target is None:
            os.replace(job.partial_output, job.output)
    finally:
        if preview is not None:
            preview.linger(PREVIEW_LINGER_S)
            preview.close()
        if audio is not None:
            audio.close()
        if reader is not None:
            reader.close()
        if stdout_fd is not None:
            os.dup2(stdout_fd, 1)
            os.close(stdout_fd)

    silence = sum(s.samples for s in stalls) / rate
    return SessionSummary(
        output=str(job.output), frames=stats.frames, video_fps=fps, duration_s=round(stats.frames / fps, 4),
        wall_s=round(time.monotonic() - t_start, 4),
        first_frame_s=round(clock.first - first_audio, 4) if clock is not None and clock.first is not None
        and first_audio is not None else None,
        latency_median_s=round(statistics.median(latencies), 4) if latencies else None,
        latency_p95_s=round(_percentile(latencies, 0.95), 4) if latencies else None,
        stalls=len(stalls), silence_s=round(silence, 4), frames_digest=chain_digest(stretches),
        peak_rss_mb=round(peak_rss_mb(), 1), record=str(job.record) if job.record is not None else None)
