"""Audio of unknown length: a speech track that keeps arriving on stdin, a named pipe or a live URL.

    audio = StreamAudio.open("-", rate=16000)             # WAV, Ogg/Opus, MP3, ADTS AAC, FLAC... on stdin
    audio = StreamAudio.open("-", rate=16000, raw=RawPCM("s16le", 48000, 2))   # headerless PCM: say what it is
    audio = StreamAudio.open("rtmp://0.0.0.0:1935/live/in", rate=16000)       # a publisher pushes to us

A thread decodes the input with PyAV (the FFmpeg in its wheel: any format FFmpeg reads from a pipe), resamples it to
mono float32 at `rate`, and appends it to a timeline the renderer reads by sample index, as it reads a file:
`read(start, end)` returns what has arrived (zeros past it), `wait_for(n, timeout)` waits until the timeline holds n
samples or the input has ended, and `release(before)` frees what will not be read again.

A stalled source does not stall the session: `pad_to(n)` appends silence up to sample n, and audio that arrives
later continues after it, so the timeline is the input with those silences inserted, and everything downstream (the
audio features, the output's audio track) reads the same timeline and stays in sync. `resume_at(position)` places
the next audio to arrive no earlier than `position()` (silence filling up to it), so a source that resumes after a
stall goes where the session's clock is, not behind it.

Memory is bounded: the thread stops reading (the pipe's writer then blocks, as with any pipe) while more than
`max_buffer_s` of unreleased audio is held.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

import av
import numpy as np

from avatar_cli.errors import InputError, RenderError
from avatar_cli.media._files import reason

__all__ = ["RawPCM", "StreamAudio", "TimelineFeed", "RAW_FORMATS"]

RAW_FORMATS = ("s16le", "s16be", "s32le", "f32le", "f64le", "u8")  # FFmpeg's raw PCM demuxers


@dataclass(frozen=True)
class RawPCM:
    """Headerless PCM: its sample format (one of RAW_FORMATS), rate and channel count."""

    sample_format: str
    rate: int
    channels: int = 1

    def __post_init__(self):
        if self.sample_format not in RAW_FORMATS:
            raise InputError(f"audio: raw sample format {self.sample_format!r}: use one of {', '.join(RAW_FORMATS)}")
        if self.rate <= 0 or not 1 <= self.channels <= 8:
            raise InputError(f"audio: raw PCM at {self.rate} Hz with {self.channels} channels: not a valid stream")


class StreamAudio:
    """Mono float32 samples at `rate` on a timeline that grows as the input arrives (see the module docstring)."""

    def __init__(self, name: str, opener, *, rate: int, max_buffer_s: float = 60.0):
        self.name, self.rate = name, int(rate)
        self._opener = opener  # () -> av.InputContainer, called on the reader thread (it may block on the input)
        self._chunks: list[np.ndarray] = []  # (n,) float32 pieces covering [self._base, self._end)
        self._base = 0  # timeline index of the first sample held
        self._end = 0  # timeline length: samples arrived plus silence inserted
        self._released = 0
        self._readers: dict[str, int] = {"render": 0}  # reader -> samples it released (see release)
        self._arrivals: deque[tuple[int, float]] = deque()  # (timeline end, monotonic time) per piece appended
        self._max = int(max_buffer_s * self.rate)
        self._ended = False
        self._error: BaseException | None = None
        self._started = False  # the first byte was decoded
        self._resume: tuple[Callable[[], int], Callable[[int, int], None]] | None = None  # see resume_at
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="stream-audio", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, audio: str, *, rate: int, raw: RawPCM | None = None, stdin: BinaryIO | None = None,
             timeout_s: float = 30.0, **kw) -> StreamAudio:
        """`audio` is "-" (stdin, or the given binary stream), a named pipe's path or a URL. An rtmp:// URL
        listens for one publisher; FFmpeg's own I/O waits at most `timeout_s` for a URL to answer."""
        fmt, options = (raw.sample_format, {"sample_rate": str(raw.rate), "ch_layout": _layout(raw.channels)}) \
            if raw is not None else (None, {})
        if audio.startswith(("rtmp://", "rtmps://")):
            options.update(listen="1", timeout=str(int(timeout_s)))

        def opener():
            if audio == "-" or "://" not in audio:  # stdin or a named pipe: read here, so a WAV header is ours
                f = (stdin if stdin is not None else os.fdopen(os.dup(0), "rb", buffering=0)) if audio == "-" \
                    else open(audio, "rb", buffering=0)
                reader = _Sniffed(f)
                pcm = raw if raw is not None else reader.wav_pcm()
                if pcm is not None:  # PCM is decoded here, sample by sample as it arrives
                    return _PcmFrames(reader, pcm)
                return av.open(reader, format=fmt, options=options)
            return av.open(audio, format=fmt, options=options, timeout=(timeout_s, timeout_s))

        return cls("stdin" if audio == "-" else audio, opener, rate=rate, **kw)

    # ---- the renderer's side ------------------------------------------------------------------------------

    @property
    def arrived(self) -> int:
        """The timeline's length so far (samples received plus silence inserted)."""
        with self._cond:
            return self._end

    @property
    def held_from(self) -> int:
        """The first timeline sample still held (what every reader released before it is gone)."""
        with self._cond:
            return self._base

    @property
    def ended(self) -> bool:
        with self._cond:
            return self._ended

    @property
    def started(self) -> bool:
        """Whether any audio has been decoded yet."""
        with self._cond:
            return self._started

    def wait_for(self, n: int, timeout: float | None) -> bool:
        """Wait until the timeline holds n samples or the input ended (True), or until the timeout (False).
        Raises what the reader hit (InputError for input it cannot decode)."""
        with self._cond:
            self._cond.wait_for(lambda: self._end >= n or self._ended or self._error is not None, timeout)
            self._raise_if_failed()
            return self._end >= n or self._ended

    def wait_started(self, timeout: float) -> None:
        """Wait for the first audio; a source that sends nothing for `timeout` seconds is a failed render."""
        with self._cond:
            self._cond.wait_for(lambda: self._started or self._ended or self._error is not None, timeout)
            self._raise_if_failed()
            if not self._started and not self._ended:
                raise RenderError(f"audio: {self.name}: no audio arrived in {timeout:g} s")

    def pad_to(self, n: int) -> int:
        """Insert silence so the timeline reaches sample n (nothing if it already does); returns the samples added.
        Audio arriving later is appended after the silence."""
        with self._cond:
            add = max(0, n - self._end)
            if add:
                self._append(np.zeros(add, np.float32))
            return add

    def resume_at(self, position: Callable[[], int] | None,
                  on_fill: Callable[[int, int], None] = lambda at, n: None) -> None:
        """The next audio to arrive goes no earlier than timeline sample `position()`, read as it arrives: silence
        fills the timeline up to there first, and on_fill(at, samples) says so (called on the reader's thread).
        Once: audio after that piece follows it. None disarms."""
        with self._cond:
            self._resume = (position, on_fill) if position is not None else None

    def read(self, start: int, end: int) -> np.ndarray:
        """float32 (end - start,) timeline samples [start, end): zeros where nothing has arrived (or past the end)."""
        out = np.zeros(max(0, end - start), np.float32)  # zeros before 0 too, as a file's reader gives
        with self._cond:
            if max(start, 0) < min(end, self._base):
                raise IndexError(f"audio: samples before {self._base} were released (asked for {start})")
            pos = self._base
            for c in self._chunks:
                a, b = max(start, pos), min(end, pos + c.size)
                if a < b:
                    out[a - start:b - start] = c[a - pos:b - pos]
                pos += c.size
                if pos >= end:
                    break
        return out

    def release(self, before: int, reader: str = "render") -> None:
        """`reader` will not read samples before this index again; those no reader needs are freed (and the input
        is read on). Each reader (the renderer's features, the output's audio track) releases on its own."""
        with self._cond:
            self._readers[reader] = max(self._readers.get(reader, 0), before)
            self._released = min(self._readers.values())
            while self._chunks and self._base + self._chunks[0].size <= self._released:
                self._base += self._chunks.pop(0).size
            self._cond.notify_all()

    def feed(self, reader: str = "output") -> TimelineFeed:
        """The timeline as a writer's audio track (an AudioFeed): the input with the inserted silences, read by
        a reader of its own name (one per writer)."""
        with self._cond:
            self._readers[reader] = self._base
        return TimelineFeed(self, reader)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    # ---- the reader thread --------------------------------------------------------------------------------

    def _append(self, x: np.ndarray) -> None:  # under the lock
        if x.size:
            self._chunks.append(x)
            self._end += x.size
            self._arrivals.append((self._end, time.monotonic()))
            while len(self._arrivals) > 1 and self._arrivals[1][0] <= self._released:
                self._arrivals.popleft()  # what every reader released needs no arrival time
            self._cond.notify_all()

    def arrival(self, sample: int) -> float | None:
        """time.monotonic() when timeline sample `sample` arrived (or was inserted as silence); None: not yet."""
        with self._cond:
            for end, t in self._arrivals:
                if sample < end:
                    return t
            return None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, (InputError, RenderError)):
                raise err
            raise RenderError(f"audio: {self.name}: reading failed ({reason(err)})")

    def _run(self) -> None:
        container = None
        try:
            try:
                container = self._opener()
                frames = container.frames() if isinstance(container, _PcmFrames) \
                    else container.decode(container.streams.audio[0])
            except (av.error.FFmpegError, OSError, ValueError, IndexError) as exc:
                what = "no audio stream" if isinstance(exc, IndexError) else f"not audio FFmpeg can read ({reason(exc)})"
                raise InputError(f"audio: {self.name}: {what}") from None
            resampler = av.AudioResampler(format="flt", layout="mono", rate=self.rate)
            try:
                for frame in frames:
                    self._take(resampler.resample(frame))
                    if self._stop.is_set():
                        return
                self._take(resampler.resample(None))
            except (av.error.FFmpegError, ValueError) as exc:
                if not self.started:
                    raise InputError(f"audio: {self.name}: not audio FFmpeg can read ({reason(exc)})") from None
                # A live input cut mid-packet (a publisher's disconnect, a killed writer): what arrived stands.
            except OSError:
                pass  # EIO at a publisher's disconnect ends the input as EOF does
        except BaseException as exc:
            with self._cond:
                self._error = exc
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()
            if container is not None:
                container.close()

    def _take(self, frames) -> None:
        for f in frames:
            x = f.to_ndarray().reshape(-1).astype(np.float32, copy=False)  # (n,) packed mono
            filled = None
            with self._cond:
                self._started = True
                if self._resume is not None and x.size:
                    position, on_fill = self._resume
                    self._resume = None
                    at = self._end
                    if self.pad_to(position()):
                        filled = (on_fill, at, self._end - at)
                self._append(x)
            if filled is not None:
                filled[0](filled[1], filled[2])
            with self._cond:
                # Back-pressure: hold the reader while too much unreleased audio is buffered.
                self._cond.wait_for(lambda: self._end - self._released <= self._max or self._stop.is_set())


class TimelineFeed:
    """A writer's AudioFeed over a StreamAudio timeline: samples in order, zeros where nothing has arrived yet."""

    channels = 1

    def __init__(self, audio: StreamAudio, reader: str = "output"):
        self.audio, self.reader, self.rate, self.pos = audio, reader, audio.rate, 0

    def take(self, n: int) -> np.ndarray:
        x = self.audio.read(self.pos, self.pos + n)  # (n,)
        self.pos += n
        self.audio.release(self.pos, reader=self.reader)
        return x[None]  # (1, n)

    def close(self) -> None:
        self.audio.release(2**62, reader=self.reader)


class _PcmFrames:
    """Headerless PCM (or a WAV's data) read from a pipe as it arrives: every whole sample read so far becomes an
    AudioFrame at once. FFmpeg's raw demuxers hand over 1024 samples at a time, holding back up to 64 ms of 16-kHz
    speech that has arrived; here nothing waits but a partial sample."""

    DTYPES = {"s16le": ("<i2", 2**15), "s16be": (">i2", 2**15), "s32le": ("<i4", 2**31), "f32le": ("<f4", 1),
              "f64le": ("<f8", 1), "u8": ("u1", 128)}
    READ = 1 << 13  # bytes per read; a pipe returns what it holds, up to this

    def __init__(self, reader: _Sniffed, pcm: RawPCM):
        self.reader, self.pcm = reader, pcm

    def close(self) -> None:
        pass

    def frames(self):
        dtype, scale = self.DTYPES[self.pcm.sample_format]
        channels = self.pcm.channels
        block = channels * np.dtype(dtype).itemsize
        pending, pts = b"", 0
        while True:
            data = self.reader.read(self.READ)
            if not data:
                return
            data = pending + data
            n = len(data) // block * block
            pending = data[n:]
            if not n:
                continue
            x = np.frombuffer(data[:n], dtype).reshape(-1, channels).T.astype(np.float32)  # (C, t)
            if self.pcm.sample_format == "u8":
                x -= 128
            if scale != 1:
                x /= scale  # FFmpeg's integer -> float conversion: exact powers of two
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x), format="fltp", layout=_layout(channels))
            frame.sample_rate, frame.pts = self.pcm.rate, pts
            pts += x.shape[1]
            yield frame


class _Sniffed:
    """A pipe read through Python, whose first bytes can be looked at before FFmpeg reads them.

    WAV is read here rather than by FFmpeg's demuxer: that one reads 64 KB of a stream's data before it hands over
    any (a check for S/PDIF payloads), two seconds of 16-kHz speech on a live pipe. A WAV header that FFmpeg's raw
    PCM demuxers can take over is parsed here, and the rest of the stream goes to the raw demuxer."""

    def __init__(self, f: BinaryIO):
        self.f, self.head = f, b""

    def _fill(self, n: int) -> bool:
        while len(self.head) < n:
            more = self.f.read(n - len(self.head))
            if not more:
                return False
            self.head += more
        return True

    def wav_pcm(self) -> RawPCM | None:
        """The PCM format of a RIFF/WAVE header at the stream's start, consuming the header; None otherwise (the
        bytes looked at are then handed to FFmpeg as they came)."""
        if not self._fill(12) or self.head[:4] != b"RIFF" or self.head[8:12] != b"WAVE":
            return None
        pos, fmt = 12, None
        while self._fill(pos + 8):
            tag, size = self.head[pos:pos + 4], int.from_bytes(self.head[pos + 4:pos + 8], "little")
            if tag == b"data":
                if fmt is None:
                    return None
                self.head = self.head[pos + 8:]
                return fmt
            if tag == b"fmt " and self._fill(pos + 8 + 16):
                code, channels, rate = struct.unpack_from("<HHI", self.head, pos + 8)
                bits = struct.unpack_from("<H", self.head, pos + 22)[0]
                if code == 0xFFFE and size >= 40 and self._fill(pos + 8 + 26):  # WAVE_FORMAT_EXTENSIBLE
                    code = struct.unpack_from("<H", self.head, pos + 32)[0]
                name = {(1, 16): "s16le", (1, 32): "s32le", (1, 8): "u8", (3, 32): "f32le", (3, 64): "f64le"}.get(
                    (code, bits))
                if name is None or channels < 1:
                    return None  # another codec in WAV (ADPCM, A-law...): FFmpeg's own demuxer reads it
                fmt = RawPCM(name, rate, channels)
            if size > 1 << 20 or not self._fill(pos + 8 + size + (size & 1)):
                return None
            pos += 8 + size + (size & 1)
        return None

    def read(self, n: int) -> bytes:
        if self.head:
            out, self.head = self.head[:n], self.head[n:]
            return out
        return self.f.read(n)


def _layout(channels: int) -> str:
    return {1: "mono", 2: "stereo"}.get(channels, f"{channels}c")
