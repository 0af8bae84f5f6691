"""WHIP out: the live stream as WebRTC, pushed to an ingest server (`-o http://host:8889/stream/whip`, also https).

WHIP (RFC 9725) is one HTTP exchange: the client POSTs an SDP offer (`application/sdp`), the server answers
201 Created with its SDP answer and a `Location` header naming the session's resource, ICE and DTLS connect, and
SRTP carries H.264 and Opus. At the end the client sends DELETE to the resource.

The live writer's encoders make the packets (x264 with the live settings, in the baseline profile browsers take;
libopus), and aiortc's peer connection (the `whip` extra) sends them as they come: ICE as a full agent (it answers
the endpoint's consent checks and makes its own, RFC 7675), DTLS on a P-256 certificate, SRTP, RTP packetization and
retransmission on NACK. FFmpeg's `whip` muxer, inside PyAV's wheel, does all of that in one piece, but once connected
it answers no consent check, so a peer that enforces consent (aiortc; a browser taking the stream directly) drops the
session after about 30 s; and it holds the GIL while it connects and closes, so nothing can bound either. Here the
peer runs on an asyncio loop in a thread of its own, and every wait on it has a timeout.

- When it connects. The endpoint is asked once, with a plain HTTP OPTIONS request under a timeout, when the output
  opens, before any model loads (a server that does not answer is exit 2 then); the offer goes at the first frame,
  once the models are loaded: a peer left idle while they load would drop the session.
- Opus in WebRTC is 48 kHz stereo: the session's audio (16-kHz mono speech) is resampled and doubled.
- Errors in words: an offer refused (4xx), or an endpoint that does not answer the offer or never connects, is
  exit 2 naming the URL; an endpoint that goes away mid-session is exit 1: its connection fails (consent lapsed,
  or it closed it), or, once it has sent RTCP receiver reports, none has come for GONE_S.
- The end: the last packets get DRAIN_S to leave, the connection closes, the DELETE goes; the whole close is bounded
  by CLOSE_TIMEOUT_S, so an endpoint that stops answering cannot hold the session.
"""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from avatar_cli.errors import InputError, RenderError
from avatar_cli.media._files import reason
from avatar_cli.media.live import LiveTarget, LiveWriter
from avatar_cli.media.writer import AudioFeed

__all__ = ["WhipWriter", "live_writer", "read_bearer_token", "check_available", "is_whip_output", "OPUS_RATE"]

OPUS_RATE = 48000  # Opus in WebRTC: 48 kHz stereo
OPUS_PRIMING = 312  # libopus's encoder delay at 48 kHz (its initial_padding), dropped as AAC's priming is
OPUS_BIT_RATE = 64000  # bits/s: transparent for speech
WHIP_SCHEMES = ("http://", "https://")


def is_whip_output(output: str) -> bool:
    return output.lower().startswith(WHIP_SCHEMES)


def check_available(url: str) -> None:
    """WHIP needs aiortc (the `whip` extra): without it, exit 2 before any model loads."""
    try:
        import aiortc  # noqa: F401, PLC0415 (only a WHIP output needs it)
    except ImportError:
        raise InputError(f"output: {url}: a WHIP output needs the aiortc package "
                         "(pip install 'avatar-cli[whip]')") from None


def read_bearer_token(path: Path) -> str:
    """The token in `path` (live.bearer_token_file), surrounding whitespace stripped; a missing or empty file is
    bad input."""
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"live.bearer_token_file: {path}: cannot read ({reason(exc)})") from None
    if not token:
        raise InputError(f"live.bearer_token_file: {path}: is empty (it holds the endpoint's bearer token)")
    if any(c in token for c in "\r\n"):
        raise InputError(f"live.bearer_token_file: {path}: holds more than one line (one token is expected)")
    return token


class _Opus48k:
    """An AudioFeed at 48 kHz stereo over one at another rate (16-kHz mono speech): what Opus in WebRTC carries.

    It takes from the feed below only the samples the output so far covers (a live feed hands out zeros for what
    has not arrived), and the resampler's delay becomes a few leading zeros."""

    rate, channels = OPUS_RATE, 2

    def __init__(self, feed: AudioFeed):
        self.feed = feed
        layout = "mono" if feed.channels == 1 else "stereo"
        self._layout = layout
        self._resampler = av.AudioResampler(format="fltp", layout=layout, rate=OPUS_RATE)
        self._given = 0  # samples handed out, at 48 kHz
        self._taken = 0  # samples taken from the feed, at its rate
        self._pending = np.zeros((feed.channels, 0), np.float32)  # (C, k) resampled, not handed out yet

    def take(self, n: int) -> np.ndarray:
        """float32 (2, n)."""
        self._given += n
        want = self._given * self.feed.rate // OPUS_RATE
        if want > self._taken:
            x = np.ascontiguousarray(self.feed.take(want - self._taken), np.float32)  # (C, k)
            frame = av.AudioFrame.from_ndarray(x, format="fltp", layout=self._layout)
            frame.sample_rate, frame.pts = self.feed.rate, self._taken
            self._taken = want
            parts = [self._pending, *(f.to_ndarray() for f in self._resampler.resample(frame))]
            self._pending = np.concatenate(parts, axis=1)  # (C, k)
        if self._pending.shape[1] < n:  # the resampler's delay: zeros ahead of what it has given
            lead = np.zeros((self._pending.shape[0], n - self._pending.shape[1]), np.float32)
            self._pending = np.concatenate([lead, self._pending], axis=1)
        out, self._pending = self._pending[:, :n], self._pending[:, n:]  # (C, n)
        return np.repeat(out, 2, axis=0) if out.shape[0] == 1 else out  # (2, n)

    def close(self) -> None:
        self.feed.close()


class _PeerOutput:
    """What the writer muxes into for WHIP: PyAV's `null` muxer gives the encoders their streams (no bytes are
    written: x264 then keeps SPS and PPS in band, before each keyframe, as RTP wants them), and each packet muxed
    goes to the peer session, which is made when the first frame connects it."""

    def __init__(self, url: str, token: str | None):
        self.url, self.token = url, token
        self.null = av.open(os.devnull, "w", format="null")
        self.session = None  # whip_peer.PeerSession, once connected

    def add_stream(self, *args, **kw):
        return self.null.add_stream(*args, **kw)

    @property
    def metadata(self) -> dict:
        return self.null.metadata

    def start_encoding(self) -> None:
        """POST the offer, follow the answer, connect."""
        from avatar_cli.media.whip_peer import PeerSession  # noqa: PLC0415 (aiortc: the whip extra)

        self.session = PeerSession(self.url, self.token)
        self.session.connect()

    def mux(self, packet: av.Packet) -> None:
        if self.session is not None and packet.size:  # (before the connection nothing is encoded)
            self.session.send(packet.stream.type, packet)

    def close(self) -> None:
        try:
            if self.session is not None:
                self.session.close()
        finally:
            self.null.close()


class WhipWriter(LiveWriter):
    """The live writer, its packets sent to a WHIP endpoint by aiortc (module docstring). The target is
    `live_target`'s for an http(s) URL; the encoder's settings are the live writer's, in the baseline profile,
    with Opus audio."""

    audio_priming = OPUS_PRIMING
    _container: _PeerOutput

    def __init__(self, target: LiveTarget, **kw) -> None:
        check_available(target.url)
        from avatar_cli.media.whip_peer import check_answers  # noqa: PLC0415 (aiortc: the whip extra)

        check_answers(target.url)
        self._connected = False
        super().__init__(target, **kw)

    def _open_container(self) -> _PeerOutput:
        return _PeerOutput(self.target.url, self.target.options.get("authorization"))

    def _start(self) -> None:
        """Open the encoders (a bad codec setting fails here); the offer waits for the first frame."""
        self._video.codec_context.open()
        if self._audio is not None:
            self._audio.codec_context.open()

    def _connect(self) -> None:
        try:
            self._container.start_encoding()
        except InputError:
            raise
        except BaseException as exc:
            raise self._start_failed(exc, self._video.codec_context.name) from None
        self._connected = True

    def _start_failed(self, exc: BaseException, codec: str) -> BaseException:
        if isinstance(exc, OSError):
            return InputError(f"output: {self.target.url}: the WHIP endpoint does not answer ({reason(exc)})")
        return super()._start_failed(exc, codec)

    def _add_video(self, codec: str, crf: int, preset: str, threads: int | None) -> av.VideoStream:
        stream = super()._add_video(codec, crf, preset, threads)
        stream.options = {**stream.options, "profile": "baseline"}
        return stream

    def _add_audio(self, audio_path) -> tuple[av.AudioStream, AudioFeed]:
        stream, feed = super()._add_audio(audio_path)
        return stream, _Opus48k(feed)

    def _audio_stream(self, rate: int, layout: str) -> av.AudioStream:
        stream = self._container.add_stream("libopus", rate=OPUS_RATE, layout="stereo")
        stream.bit_rate = OPUS_BIT_RATE
        stream.time_base = Fraction(1, OPUS_RATE)
        return stream

    def _encode_frame(self, rgb) -> None:
        if not self._connected:
            if self.realtime:  # the frame clock starts with the first frame, not after the handshake: else the
                self.pacer.wait(self._frames_written)  # handshake's time would stay in every frame's latency
            self._connect()
        super()._encode_frame(rgb)

    def _raise_if_failed(self) -> None:
        err = self._error
        if isinstance(err, InputError):  # the offer, refused at the first frame
            raise err
        if isinstance(err, ConnectionError) and self._connected:  # whip_peer.EndpointGone
            raise RenderError(f"output: {self.target.url}: the WHIP endpoint went away ({err})") from err
        super()._raise_if_failed()

    def _finalize(self) -> None:
        if self._connected and self._error is None:
            super()._finalize()  # the last packets go out, then the connection closes and the DELETE goes
            return
        # Never connected (nothing to flush, nothing to delete), or the endpoint failed: close what there is.
        if self._feed is not None:
            self._feed.close()
        self._container.close()


def live_writer(target: LiveTarget, **kw) -> LiveWriter:
    """The writer for a live `target`: a WHIP endpoint's (WhipWriter, which builds on LiveWriter), or LiveWriter
    itself for every other target. Here, not in media/live.py, so that imports run one way (whip -> live)."""
    return WhipWriter(target, **kw) if target.format == "whip" else LiveWriter(target, **kw)
