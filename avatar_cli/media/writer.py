"""The live MP4 writer: H.264 + AAC into a fragmented MP4, encoded on a thread while frames are generated.

Why fragmented: a render killed at minute 40 still leaves 40 playable minutes, and a copy taken
mid-write decodes (with flush_packets=1 the bytes reach the file as each packet is muxed).

Timeline rules that keep lip sync exact (all measured with PyAV 18.1, see tests/test_media.py):
- No B-frames: with them a fragmented file gets no edit list and video starts at +80 ms.
- AAC priming: the encoder emits 1024 samples of priming silence first, and a fragmented MP4
  has no edit list to hide them, so decoders play the audio 1024 samples late (64 ms at
  16 kHz) and the track runs 1024 samples long. We drop the first 1024 input samples and
  give the remaining ones pts = their input index, so the first AAC packet gets pts 0, the
  priming occupies [0, 1024), and input sample k plays at exactly k / rate. The cost is the
  first 21-128 ms of the input (usually leading silence) being replaced by the priming.
- Audio is written up to (i + 1) / fps after video frame i, so the track always ends with
  the last frame written (trimmed, or padded with silence when the file is shorter).
"""

from __future__ import annotations

import errno
import functools
import os
import queue
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Protocol

import av
import numpy as np

from avatar_cli.errors import InputError, RenderError
from avatar_cli.media._files import reason
from avatar_cli.media.audio import iter_audio_chunks

__all__ = ["resolve_codec", "Mp4Writer", "AudioFeed", "WriterStats", "video_rate", "AAC_RATES", "AAC_PRIMING"]

FRAGMENTED_MP4 = {"movflags": "frag_keyframe+empty_moov+default_base_moof", "flush_packets": "1"}
AAC_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000)
AAC_PRIMING = 1024  # FFmpeg's native AAC encoder: initial_padding (checked on the first packet)
_BT709 = 1  # AVCOL_PRI/TRC/SPC_BT709; AVCOL_RANGE_MPEG is also 1
_STOP = object()


@dataclass(frozen=True)
class WriterStats:
    """What a finished (or aborted) writer produced."""

    frames: int
    bytes: int
    encode_s: float  # time the writer thread spent converting, encoding and muxing

    @property
    def encode_fps(self) -> float:
        return self.frames / self.encode_s if self.encode_s > 0 else 0.0


@functools.lru_cache(maxsize=None)
def _nvenc_works() -> str | None:
    """Open h264_nvenc and encode one small frame; None if it works, else the reason."""
    try:
        ctx = av.CodecContext.create("h264_nvenc", "w")
        ctx.width, ctx.height, ctx.pix_fmt = 256, 256, "yuv420p"
        ctx.time_base = Fraction(1, 25)
        ctx.framerate = Fraction(25)
        ctx.open()
        frame = av.VideoFrame(256, 256, "yuv420p")
        frame.pts = 0
        packets = list(ctx.encode(frame)) + list(ctx.encode(None))
        return None if packets else "encoder produced no output"
    except Exception as exc:  # any failure means "not usable here"; the reason goes in the message
        return reason(exc)


def resolve_codec(codec: str, device: str) -> str:
    """Pick the H.264 encoder: "auto" -> h264_nvenc on a CUDA device where it works, else libx264."""
    if codec == "libx264":
        return codec
    if codec == "h264_nvenc":
        problem = _nvenc_works()
        if problem is not None:
            raise RenderError(f"video codec h264_nvenc: cannot open the NVIDIA encoder ({problem}); use codec libx264 or auto")
        return codec
    if codec == "auto":
        if device.startswith("cuda") and _nvenc_works() is None:
            return "h264_nvenc"
        return "libx264"
    raise RenderError(f"video codec {codec!r}: unknown (use auto, libx264 or h264_nvenc)")


def video_rate(fps: float) -> Fraction:
    """The exact frame rate the writer uses for `fps`.

    29.97 / 59.94 / 23.976 snap to the NTSC rates 30000/1001 etc. (what players and editors
    expect; `Fraction(29.97).limit_denominator(1001)` would give 2997/100). Anything else is
    Fraction(fps).limit_denominator(1001). Use this to convert frame index <-> time.
    """
    for base in (24, 25, 30, 48, 50, 60, 120):
        ntsc = Fraction(base * 1000, 1001)
        if abs(fps - float(ntsc)) < 0.0015:
            return ntsc
    return Fraction(fps).limit_denominator(1001)


def _default_threads() -> int:
    """x264 threads: 1 on small machines so it does not starve torch (the generator dominates)."""
    cpus = os.cpu_count() or 1
    return 1 if cpus <= 4 else min(8, cpus // 4)


class AudioFeed(Protocol):
    """Where a writer takes its audio track from, in exact sample counts at `rate`, as video frames are written."""

    rate: int
    channels: int

    def take(self, n: int) -> np.ndarray: ...  # float32 (channels, n): the next n samples, zero-padded past the end

    def close(self) -> None: ...


class _AudioFeed:
    """Input audio handed out in exact sample counts, zero-padded once the file runs out."""

    def __init__(self, path: str, rate: int, layout: str) -> None:
        self.rate = rate
        self.channels = 1 if layout == "mono" else 2
        self._chunks = iter_audio_chunks(path, rate, layout)
        self._pending: list[np.ndarray] = []  # (C, n) pieces, oldest first
        self._have = 0

    def take(self, n: int) -> np.ndarray:
        """float32 (C, n): the next n samples."""
        while self._have < n:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._pending.append(chunk)
            self._have += chunk.shape[1]
        out = np.zeros((self.channels, n), np.float32)  # (C, n)
        filled = 0
        while filled < n and self._pending:
            head = self._pending[0]
            k = min(n - filled, head.shape[1])
            out[:, filled : filled + k] = head[:, :k]
            filled += k
            if k == head.shape[1]:
                self._pending.pop(0)
            else:
                self._pending[0] = head[:, k:]
        self._have -= filled
        return out

    def close(self) -> None:
        self._chunks.close()  # type: ignore[attr-defined]
        self._pending = []


class Mp4Writer:
    """Fragmented H.264/AAC MP4 writer fed with RGB frames; encodes on a daemon thread.

    put() blocks when `queue_frames` frames are waiting (back-pressure instead of unbounded RAM)
    and re-raises, as RenderError, whatever the encoder thread hit. close() finishes the file
    with the frames written so far; abort() drops queued frames and finishes the same way.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        width: int,
        height: int,
        fps: float,
        total_frames: int,
        audio_path: str | Path | AudioFeed | None,
        codec: str = "libx264",
        crf: int = 20,
        preset: str = "veryfast",
        queue_frames: int = 64,
        threads: int | None = None,
        metadata: dict[str, str] | None = None,
        resume_from: str | Path | None = None,
        resume_frames: int = 0,
        first_put: int | None = None,
    ) -> None:
        self.path = str(path)
        if width <= 0 or height <= 0 or width % 2 or height % 2:
            raise RenderError(f"video: {self.path}: size {width}x{height} must be positive and even for yuv420p")
        if not fps or fps <= 0:
            raise RenderError(f"video: {self.path}: fps must be positive, got {fps}")
        if codec == "auto":
            codec = resolve_codec(codec, "cpu")
        self.width, self.height, self.total_frames = int(width), int(height), int(total_frames)
        self.rate = video_rate(fps)
        self.codec = codec

        self._container = self._open_container()
        self._feed: _AudioFeed | None = None
        # Resuming: frames [0, resume_frames) are copied, still compressed, from the interrupted file.
        self._resume_from = str(resume_from) if resume_from is not None else None
        self._resume_frames = int(resume_frames) if resume_from is not None else 0
        try:
            for key, value in (metadata or {}).items():
                self._container.metadata[key] = value
            self._video = self._add_video(codec, crf, preset, threads)
            self._audio, self._feed = self._add_audio(audio_path) if audio_path is not None else (None, None)
            self._start()
        except BaseException as exc:
            if self._feed is not None:
                self._feed.close()
            try:
                self._container.close()
            except Exception:
                pass  # the original error is the one to report
            raise self._start_failed(exc, codec) from None

        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, int(queue_frames)))
        self._abort = threading.Event()
        self._error: BaseException | None = None
        # Index of the next frame put(). A resumed render may restart generating a little before
        # `resume_frames` (at a keyframe of the old file); frames already copied are then dropped.
        self._frames_put = self._resume_frames if first_put is None else int(first_put)
        self._frames_written = 0
        self._audio_written = 0  # file-timeline samples covered (priming included)
        self._encode_s = 0.0
        self._stats: WriterStats | None = None
        self._thread = threading.Thread(target=self._run, name="mp4-writer", daemon=True)
        self._thread.start()

    # ---- setup -------------------------------------------------------------------------

    # x264's tune: None for files (best quality per bit); live outputs set "zerolatency" (no lookahead, no frame
    # threading delay), so each frame's packet leaves the encoder as soon as the frame goes in.
    x264_tune: str | None = None

    # Input samples dropped under the audio encoder's priming (module docstring); an encoder with another delay
    # (Opus) sets its own.
    audio_priming: int = AAC_PRIMING

    def _start(self) -> None:
        """Open the encoders and write the header now: a bad output path or codec option fails here, in the
        caller's thread, not at the first frame."""
        self._container.start_encoding()

    def _open_container(self) -> av.container.OutputContainer:
        """The output container; subclasses open other targets (live streams) the same way."""
        try:
            return av.open(self.path, "w", format="mp4", options=dict(FRAGMENTED_MP4))
        except (av.error.FFmpegError, OSError) as exc:
            raise InputError(f"output: {self.path}: cannot create the file ({reason(exc)})") from None

    def _start_failed(self, exc: BaseException, codec: str) -> BaseException:
        """The error to raise when opening the output or its encoders failed (the header is written at start)."""
        if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return InputError(f"output: {self.path}: cannot write ({reason(exc)})")
        if isinstance(exc, av.error.FFmpegError):
            return RenderError(f"video: {self.path}: cannot start the {codec} encoder ({reason(exc)})")
        return exc

    def _add_video(self, codec: str, crf: int, preset: str, threads: int | None) -> av.VideoStream:
        gop = max(1, round(float(self.rate)))  # a keyframe (and a fragment) every second
        try:
            stream = self._container.add_stream(codec, rate=self.rate)
        except (av.error.FFmpegError, ValueError) as exc:
            raise RenderError(f"video: {self.path}: cannot use codec {codec} ({reason(exc)})") from None
        stream.width, stream.height, stream.pix_fmt = self.width, self.height, "yuv420p"
        ctx = stream.codec_context
        ctx.color_primaries = ctx.color_trc = ctx.colorspace = _BT709
        ctx.color_range = 1  # limited ("TV") range, what every player assumes
        if codec == "libx264":
            # bf=0 keeps both streams at t=0 (no edit list in fragmented MP4); scenecut off so
            # keyframes, and thus fragments, fall exactly every `gop` frames.
            stream.options = {"crf": str(crf), "preset": preset, "g": str(gop), "keyint_min": str(gop),
                              "sc_threshold": "0", "bf": "0", **({"tune": self.x264_tune} if self.x264_tune else {})}
            ctx.thread_count = _default_threads() if threads is None else int(threads)
        else:  # h264_nvenc: constant-quality VBR, the closest thing to crf
            stream.options = {"preset": "p4", "rc": "vbr", "cq": str(crf), "g": str(gop), "bf": "0"}
        return stream

    def _add_audio(self, audio_path: str | Path | AudioFeed) -> tuple[av.AudioStream, AudioFeed]:
        if not isinstance(audio_path, (str, Path)):  # samples handed over as they arrive (a live source)
            feed = audio_path
            layout = "mono" if feed.channels == 1 else "stereo"
            return self._audio_stream(feed.rate, layout), feed
        try:
            with av.open(str(audio_path)) as probe:
                src = probe.streams.audio[0]
                native_rate, channels = src.rate, src.channels
        except (av.error.FFmpegError, OSError, IndexError) as exc:
            detail = "no audio stream" if isinstance(exc, IndexError) else reason(exc)
            raise InputError(f"audio: {audio_path}: cannot open ({detail})") from None
        rate = native_rate if native_rate in AAC_RATES else 48000
        layout = "mono" if channels == 1 else "stereo"  # >2 channels: FFmpeg's stereo downmix
        return self._audio_stream(rate, layout), _AudioFeed(str(audio_path), rate, layout)

    def _audio_stream(self, rate: int, layout: str) -> av.AudioStream:
        stream = self._container.add_stream("aac", rate=rate, layout=layout)
        # 64 kb/s per channel is transparent for speech; AAC allows at most 6 bits/sample/channel.
        stream.bit_rate = (1 if layout == "mono" else 2) * min(64000, 6 * rate)
        stream.time_base = Fraction(1, rate)
        return stream

    # ---- producer side -----------------------------------------------------------------

    @property
    def frames_written(self) -> int:
        """Frames handed to the encoder so far (queued frames not included)."""
        return self._frames_written

    def put(self, frames: np.ndarray) -> None:
        """Queue uint8 RGB frames, (T, H, W, 3) or (H, W, 3). Blocks while the queue is full."""
        self._raise_if_failed()
        if self._stats is not None or self._abort.is_set():
            raise RenderError(f"video: {self.path}: writer already closed")
        arr = np.asarray(frames)
        if arr.ndim == 3:
            arr = arr[None]  # (1, H, W, 3)
        if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[1:] != (self.height, self.width, 3):
            raise ValueError(f"put() wants uint8 (T, {self.height}, {self.width}, 3), got {arr.dtype} {arr.shape}")
        if self._frames_put + arr.shape[0] > self.total_frames:
            raise ValueError(f"put() past total_frames={self.total_frames} (already {self._frames_put})")
        for frame in arr:
            if self._frames_put < self._resume_frames:
                self._frames_put += 1  # already in the file, copied from the interrupted render
                continue
            # A copy: callers reuse their buffers, and the encoder reads this one later.
            item = np.array(frame, copy=True)  # (H, W, 3)
            while True:
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    self._raise_if_failed()
            self._frames_put += 1

    def close(self) -> WriterStats:
        """Encode everything queued, finish audio and container; return the stats."""
        if self._stats is None:
            self._finish()
        self._raise_if_failed()
        assert self._stats is not None
        return self._stats

    def abort(self) -> WriterStats:
        """Drop queued frames, stop the thread, and close the file cleanly with what was encoded."""
        self._abort.set()
        if self._stats is None:
            self._finish()
        assert self._stats is not None
        return self._stats

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _finish(self) -> None:
        while True:  # the thread may be dead with a full queue; never block on it
            try:
                self._queue.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    break
        self._thread.join()
        size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        self._stats = WriterStats(frames=self._frames_written, bytes=size, encode_s=self._encode_s)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, RenderError):
                raise err
            if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise RenderError(f"disk full while writing {self.path} ({reason(err)})") from err
            raise RenderError(f"video: {self.path}: encoding failed ({type(err).__name__}: {reason(err)})") from err

    # ---- writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._resume_frames:
                self._copy_frames(self._resume_from, self._resume_frames)
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                if self._abort.is_set():
                    continue  # drain without encoding
                t0 = time.perf_counter()
                self._encode_frame(item)  # type: ignore[arg-type]
                self._encode_s += time.perf_counter() - t0
        except BaseException as exc:  # stored, re-raised in the producer's thread
            self._error = exc
            self._drain()
        finally:
            t0 = time.perf_counter()
            try:
                self._finalize()
            except BaseException as exc:
                if self._error is None:
                    self._error = exc
            self._encode_s += time.perf_counter() - t0

    def _copy_frames(self, source: str, frames: int) -> None:
        """Remux the first `frames` video packets of an earlier file (no re-encode: bit-exact), writing the
        audio alongside from the input file as usual. The encoder then starts fresh, with a keyframe."""
        step = int(Fraction(1) / self.rate / self._video.time_base)
        with av.open(source) as src:
            stream = src.streams.video[0]
            for packet in src.demux(stream):
                if packet.pts is None or packet.size == 0:
                    continue
                index = round(packet.pts * packet.time_base * self.rate)
                if index >= frames:
                    break
                # MP4 stores H.264 length-prefixed (AVCC); our stream's muxer expects the encoder's Annex B
                # and converts it, so hand it Annex B or it would mangle the copied frames.
                copy = av.Packet(_avcc_to_annexb(bytes(packet)))
                copy.stream = self._video
                copy.time_base = self._video.time_base
                copy.pts = copy.dts = index * step
                copy.duration = step
                copy.is_keyframe = packet.is_keyframe
                self._container.mux(copy)
                self._frames_written = index + 1
                self._write_audio_until(self._frames_written)
        if self._frames_written != frames:
            raise RenderError(f"video: {source}: holds {self._frames_written} frames, {frames} needed to resume")

    def _drain(self) -> None:
        """After a failure: empty the queue so a producer blocked in put() wakes up."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def _encode_frame(self, rgb: np.ndarray) -> None:
        i = self._frames_written
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")  # (H, W, 3)
        frame = frame.reformat(format="yuv420p", dst_colorspace="itu709", dst_color_range="MPEG", threads=1)
        frame.pts = i
        frame.time_base = 1 / self.rate
        for packet in self._video.encode(frame):
            self._container.mux(packet)
        self._frames_written = i + 1
        self._write_audio_until(self._frames_written)

    def _write_audio_until(self, frames: int) -> None:
        """Encode audio so the track covers [0, frames / fps) on the file timeline."""
        if self._audio is None or self._feed is None:
            return
        target = round(frames * self._audio.rate / self.rate)  # samples on the file timeline
        if target <= self._audio_written:
            return
        if self._audio_written == 0:
            self._feed.take(self.audio_priming)  # these input samples sit under the priming
            self._audio_written = self.audio_priming
            if target <= self.audio_priming:
                return
        n = target - self._audio_written
        samples = self._feed.take(n)  # (C, n)
        layout = "mono" if samples.shape[0] == 1 else "stereo"
        af = av.AudioFrame.from_ndarray(samples, format="fltp", layout=layout)
        af.sample_rate = self._audio.rate
        af.time_base = Fraction(1, self._audio.rate)
        af.pts = self._audio_written  # = input sample index (see module docstring)
        for packet in self._audio.encode(af):
            if packet.pts is not None and packet.pts < 0:
                raise RenderError(f"video: {self.path}: {self._audio.codec_context.name} encoder priming is not "
                                  f"{self.audio_priming} samples; audio would drift")
            self._container.mux(packet)
        self._audio_written = target

    def _finalize(self) -> None:
        """Flush both encoders and close the container; runs after failures and aborts too,
        because a cleanly closed fragmented MP4 is playable up to its last frame."""
        try:
            for packet in self._video.encode(None):
                self._container.mux(packet)
            if self._audio is not None:
                self._write_audio_until(self._frames_written)
                for packet in self._audio.encode(None):
                    self._container.mux(packet)
        except BaseException:
            if self._error is None:
                raise
            # A follow-on failure while salvaging: the first error is the one worth reporting.
        finally:
            if self._feed is not None:
                self._feed.close()
            self._container.close()


def scan_video(path: str | Path) -> tuple[int, list[int]]:
    """(video frames that actually decode from a possibly cut-off file, indices of its keyframes)."""
    n, keys = 0, []
    try:
        with av.open(str(path)) as c:
            c.streams.video[0].thread_type = "AUTO"
            try:
                for frame in c.decode(video=0):
                    if frame.key_frame:
                        keys.append(n)
                    n += 1
            except av.error.FFmpegError:
                pass  # a torn last fragment: what decoded so far counts
    except (av.error.FFmpegError, OSError, IndexError):
        return 0, []
    return n, keys


def count_video_frames(path: str | Path) -> int:
    return scan_video(path)[0]


def _avcc_to_annexb(data: bytes, length_size: int = 4) -> bytes:
    """H.264 NAL units with 4-byte big-endian length prefixes -> with start codes."""
    out, i = bytearray(), 0
    while i + length_size <= len(data):
        n = int.from_bytes(data[i:i + length_size], "big")
        out += b"\x00\x00\x00\x01" + data[i + length_size:i + length_size + n]
        i += length_size + n
    return bytes(out)
