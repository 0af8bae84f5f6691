"""Speech-track input: exact probing, streamed resampling, and a bounded sliding-window reader.

Nothing here ever holds a whole decoded file: renders may be hours long.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from avatar_cli.media import _headers
from avatar_cli.media._files import check_readable, input_error, reason

__all__ = ["AudioInfo", "probe_audio", "AudioWindowReader", "iter_audio_chunks"]

# Container names (PyAV `format.name`) whose duration header is written from real sample
# tables, so "decoded much less than the header" means the file lost data.
_TABLE_FORMATS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm")
# Decoders may emit up to this many samples past the header (AAC end padding: < 1024 + 1024).
_CODEC_PADDING = 2048


@dataclass(frozen=True)
class AudioInfo:
    """Exact facts about an audio file; `samples` counts frames at the native rate."""

    path: str
    sample_rate: int
    channels: int
    samples: int

    @property
    def duration_s(self) -> float:
        return self.samples / self.sample_rate


def _open(path: str | Path, what: str) -> av.container.InputContainer:
    check_readable(path, what)
    try:
        return av.open(str(path))
    except PermissionError:
        raise input_error(what, path, "permission denied") from None
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise input_error(what, path, f"cannot decode ({reason(exc)})") from None


def _audio_stream(container: av.container.InputContainer, path: str | Path, what: str) -> av.AudioStream:
    if not container.streams.audio:
        kinds = sorted({s.type for s in container.streams}) or ["nothing"]
        raise input_error(what, path, f"no audio stream (file holds: {', '.join(kinds)})")
    return container.streams.audio[0]


def _header_length(container: av.container.InputContainer, stream: av.AudioStream, path: str | Path) -> _headers.HeaderLength | None:
    """The length the file's header promises, only where that promise is trustworthy."""
    fmt = container.format.name
    if fmt == "wav":
        return _headers.wav_declared(path)
    if fmt == "flac":
        return _headers.flac_declared(path)
    trusted = fmt in _TABLE_FORMATS or (fmt == "mp3" and _headers.mp3_has_frame_count(path))
    if not trusted or not stream.rate:
        return None
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / av.time_base
    else:
        return None
    return _headers.HeaderLength(round(seconds * stream.rate), stream.rate, exact=False)


def probe_audio(path: str | Path, what: str = "audio") -> AudioInfo:
    """Decode the first audio stream once (streaming, counting only) and return exact facts.

    Raises InputError for missing/unreadable/non-audio files, decoder errors, empty audio,
    and files that decode clearly shorter than their header says (truncated copies).
    """
    with _open(path, what) as container:
        stream = _audio_stream(container, path, what)
        fmt = container.format.name
        if fmt == "ogg":
            damage = _headers.ogg_damage(path)
            if damage:
                raise input_error(what, path, damage)
        rate = channels = 0
        samples = 0.0  # float: a mid-stream rate change (chained ogg) is counted at the first rate
        try:
            for frame in container.decode(stream):
                if not rate:
                    rate, channels = frame.sample_rate, frame.layout.nb_channels
                samples += frame.samples * rate / frame.sample_rate
        except (av.error.FFmpegError, ValueError) as exc:
            at = samples / rate if rate else 0.0
            header = _header_length(container, stream, path)
            of = f" of {header.samples / header.sample_rate:.2f} s" if header else ""
            raise input_error(what, path, f"corrupt or truncated audio: decoding failed at {at:.2f} s{of} ({reason(exc)})") from None
        decoded = round(samples)
        if decoded == 0:
            raise input_error(what, path, "the audio is empty (0 samples decoded)")
        header = _header_length(container, stream, path)

    if header is not None and header.sample_rate == rate:
        missing_s = (header.samples - decoded) / rate
        # Sample-exact headers (PCM, FLAC) may lose nothing beyond one codec frame;
        # lossy ones carry priming/padding slack, so use the coarser max(0.1 s, 2%).
        tol_s = 0.05 if header.exact else max(0.1, 0.02 * header.samples / rate)
        if missing_s > tol_s:
            raise input_error(
                what, path,
                f"truncated or corrupt: decodes to {decoded / rate:.2f} s but its header says {header.samples / rate:.2f} s",
            )
        if 0 < decoded - header.samples <= _CODEC_PADDING:
            decoded = header.samples  # AAC end padding: the header's count is the real audio
    return AudioInfo(path=str(path), sample_rate=rate, channels=channels, samples=decoded)


def iter_audio_chunks(
    path: str | Path, sample_rate: int, layout: str = "mono", *, what: str = "audio"
) -> Iterator[np.ndarray]:
    """Stream the first audio track as float32 planar chunks (C, n) at `sample_rate`.

    `layout` is "mono" or "stereo". Stereo -> mono is the channel mean (what torchaudio /
    librosa users expect; FFmpeg's own mono downmix scales L+R by 1/sqrt(2), i.e. +3 dB);
    more channels go through FFmpeg's standard stereo downmix first. Input timestamps are
    ignored (samples are taken back to back), which keeps the output deterministic and the
    sample count equal to round(native_samples * sample_rate / native_rate).
    Decoder failures raise InputError; the container closes when the generator is closed.
    """
    if layout not in ("mono", "stereo"):
        raise ValueError(f"layout must be 'mono' or 'stereo', not {layout!r}")
    with _open(path, what) as container:
        stream = _audio_stream(container, path, what)
        mix_to_mono = False
        resampler: av.AudioResampler | None = None
        done = 0.0
        try:
            for frame in container.decode(stream):
                if resampler is None:
                    mix_to_mono = layout == "mono" and frame.layout.nb_channels > 1
                    out_layout = "stereo" if mix_to_mono else layout
                    resampler = av.AudioResampler(format="fltp", layout=out_layout, rate=sample_rate)
                done += frame.samples / frame.sample_rate
                frame.pts = None  # back to back; the resampler must not try to fill gaps
                for out in resampler.resample(frame):
                    yield _planar(out, mix_to_mono)
            if resampler is not None:
                for out in resampler.resample(None):
                    yield _planar(out, mix_to_mono)
        except (av.error.FFmpegError, ValueError) as exc:
            raise input_error(what, path, f"corrupt audio: decoding failed at {done:.2f} s ({reason(exc)})") from None


def _planar(frame: av.AudioFrame, mix_to_mono: bool) -> np.ndarray:
    x = frame.to_ndarray().astype(np.float32, copy=False)  # (C, n) for fltp
    if mix_to_mono:
        x = x.mean(axis=0, keepdims=True, dtype=np.float32)  # (1, n)
    return x


class AudioWindowReader:
    """Random-ish access to mono float32 audio at `sample_rate`, decoded lazily and forgotten.

    Index i is target-rate sample i of the file. `read(start, end)` zero-pads outside
    [0, total), so context windows may hang off both ends. Reads may overlap and step back,
    but never before `release(before)`; as a safety net, samples more than `history_s`
    before the latest read start are released automatically, so the buffer stays bounded
    (about history_s + one window) even if the caller never calls release().

    `total` is round(native_samples * sample_rate / native_rate) from probe_audio. The
    resampler's output length matched it exactly on every file tried; should it ever come out
    shorter, read() pads with zeros, and anything past `total` (e.g. AAC end padding) is cut,
    so read() is always consistent with `total`.
    """

    def __init__(self, path: str | Path, sample_rate: int = 16000, *, info: AudioInfo | None = None,
                 history_s: float = 60.0, what: str = "audio") -> None:
        self.path = str(path)
        self.sample_rate = int(sample_rate)
        self.info = info if info is not None else probe_audio(path, what)
        self._total = round(self.info.samples * self.sample_rate / self.info.sample_rate)
        self._history = max(0, round(history_s * self.sample_rate))
        self._chunks: Iterator[np.ndarray] | None = iter_audio_chunks(path, self.sample_rate, "mono", what=what)
        self._buf = np.zeros(0, np.float32)  # (n,) holds samples [_buf_start, _buf_start + n)
        self._buf_start = 0
        self._released = 0
        self._skip = 0  # samples still to discard from the decoder (released before decoded)
        self._eof = False

    @property
    def total(self) -> int:
        """Number of target-rate samples in the file."""
        return self._total

    @property
    def buffered_samples(self) -> int:
        """Decoded samples currently held (for memory checks)."""
        return int(self._buf.size)

    def _fill(self, upto: int) -> None:
        """Decode until samples [.., upto) are buffered or the file ends."""
        new: list[np.ndarray] = []
        have = self._buf_start + self._buf.size
        while have < upto and not self._eof:
            if self._chunks is None:
                raise ValueError("AudioWindowReader is closed")
            chunk = next(self._chunks, None)
            if chunk is None:
                self._eof = True
                break
            x = chunk[0]  # (n,)
            if self._skip:
                cut = min(self._skip, x.size)
                x, self._skip = x[cut:], self._skip - cut
            new.append(x)
            have += x.size
        if new:
            self._buf = np.concatenate([self._buf, *new])  # (n,)
        over = self._buf_start + self._buf.size - self._total
        if over > 0:  # decoder padding past the probed length (AAC): never part of the audio
            self._buf = self._buf[: max(0, self._buf.size - over)]
            self._eof = True

    def read(self, start: int, end: int) -> np.ndarray:
        """float32 (end - start,) of mono audio; zeros outside [0, total)."""
        start, end = int(start), int(end)
        if end < start:
            raise ValueError(f"read({start}, {end}): end before start")
        out = np.zeros(end - start, np.float32)  # (end-start,)
        lo, hi = max(start, 0), min(end, self._total)
        if lo < hi:
            if lo < self._released:
                raise ValueError(f"read({start}, {end}) reaches sample {lo}, already released (< {self._released})")
            if self._history and lo - self._history > self._released:
                self.release(lo - self._history)  # before decoding: a jump ahead must not fill RAM
            self._fill(hi)
            a, b = lo - self._buf_start, min(hi, self._buf_start + self._buf.size) - self._buf_start
            if b > a:
                out[lo - start : lo - start + (b - a)] = self._buf[a:b]
        return out

    def release(self, before: int) -> None:
        """Declare samples < before no longer needed; they are dropped from memory."""
        before = int(before)
        if before <= self._released:
            return
        self._released = before
        drop = before - self._buf_start
        if drop >= self._buf.size:
            self._skip += drop - self._buf.size  # not decoded yet: discard when it arrives
            self._buf = np.zeros(0, np.float32)
        elif drop > 0:
            self._buf = self._buf[drop:].copy()  # copy so the old, larger block can be freed
        self._buf_start = max(self._buf_start, before)

    def stream(self) -> Iterator[np.ndarray]:
        """The whole audio again, (n,) float32 chunks from a decoder of its own (this reader's position and
        buffer are untouched), cut at `total` as read() is: for statistics over the whole track in one pass."""
        left = self._total
        for chunk in iter_audio_chunks(self.path, self.sample_rate, "mono"):
            x = chunk[0][:left]  # (n,)
            left -= x.size
            if x.size:
                yield x
            if left <= 0:
                break

    def close(self) -> None:
        if self._chunks is not None:
            self._chunks.close()  # type: ignore[attr-defined]  # generator: closes the container
            self._chunks = None
        self._buf = np.zeros(0, np.float32)

    def __enter__(self) -> AudioWindowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
