"""WHIP out: the live stream as WebRTC, pushed to an ingest server (`-o http://host:8889/stream/whip`, also https).

WHIP (RFC 9725) is one HTTP exchange: the client POSTs an SDP offer (`application/sdp`), the server answers
201 Created with its SDP answer and a `Location` header naming the session's resource, ICE and DTLS connect, and
SRTP carries H.264 and Opus. At the end the client sends DELETE to the resource. All of it is FFmpeg's `whip` muxer,
inside PyAV's wheel: it POSTs (with `Authorization: Bearer <token>` from `live.bearer_token_file`), shakes hands,
packetizes, answers NACKs with retransmissions, checks ICE consent, and sends the DELETE (to the `Location`
resolved against the POST URL) when the container closes. What this module adds around the muxer:

- A DTLS certificate on P-256, made per session with `cryptography` (the `whip` extra). The muxer's own is on
  P-224, which OpenSSL-based peers (aiortc, pion and so MediaMTX) refuse at the handshake.
- `whip_flags=dtls_active`: avatar opens the DTLS handshake instead of waiting for the server to, which saves a
  round of ICE retries.
- Opus in WebRTC is 48 kHz stereo: the session's audio (16-kHz mono speech) is resampled and doubled.
- H.264 in the baseline profile, as browsers and aiortc take it (profile-level-id 42e0xx).
- When it connects. The muxer connects when its header is written, and PyAV writes a header holding the GIL, with
  no timeout it can interrupt. So the endpoint is asked once, with a plain HTTP OPTIONS request under a timeout,
  when the output opens, before any model loads (a server that does not answer is exit 2 then); the offer goes
  at the first frame, once the models are loaded: a peer left idle while they load would drop the session (ICE
  consent lapses after 30 s of silence, RFC 7675).
- Errors in words: an offer refused (4xx), or an endpoint that does not answer, is exit 2 naming the URL; an
  endpoint that goes away mid-session (the muxer sees its socket refused, or ICE consent lapse) is exit 1.
"""

from __future__ import annotations

import datetime
import ssl
import tempfile
import urllib.error
import urllib.request
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from avatar_cli.errors import InputError, RenderError
from avatar_cli.media._files import reason
from avatar_cli.media.live import LiveTarget, LiveWriter
from avatar_cli.media.writer import AudioFeed

__all__ = ["WhipWriter", "live_writer", "read_bearer_token", "check_available", "is_whip_output", "OPUS_RATE"]

OPUS_RATE = 48000  # the muxer's Opus: 48 kHz stereo only
OPUS_PRIMING = 312  # libopus's encoder delay at 48 kHz (its initial_padding), dropped as AAC's priming is
OPUS_BIT_RATE = 64000  # bits/s: transparent for speech
ANSWER_TIMEOUT_S = 10.0  # the endpoint must answer the reachability check within this
WHIP_SCHEMES = ("http://", "https://")


def is_whip_output(output: str) -> bool:
    return output.lower().startswith(WHIP_SCHEMES)


def check_available(url: str) -> None:
    """WHIP needs `cryptography` for its DTLS certificate: without it, exit 2 before any model loads."""
    try:
        import cryptography  # noqa: F401, PLC0415 (only a WHIP output needs it)
    except ImportError:
        raise InputError(f"output: {url}: a WHIP output needs the cryptography package "
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


def _dtls_certificate(folder: Path) -> tuple[str, str]:
    """A self-signed P-256 certificate and its key, PEM files in `folder` (DTLS peers check the fingerprint that
    the SDP carries, not a chain)."""
    from cryptography import x509  # noqa: PLC0415 (the whip extra)
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "avatar")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30)).sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "dtls.crt", folder / "dtls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def check_answers(url: str, timeout_s: float | None = None) -> None:
    """The endpoint answers HTTP: any response counts (many answer OPTIONS with 405 or 404; the offer says whether
    it takes the stream). The certificate of an https endpoint is not checked, as FFmpeg's TLS does not check it."""
    request = urllib.request.Request(url, method="OPTIONS")
    try:
        urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT_S if timeout_s is None else timeout_s,
                               context=ssl._create_unverified_context()).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise InputError(f"output: {url}: the WHIP endpoint does not answer ({reason(why)})") from None


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


class WhipWriter(LiveWriter):
    """The live writer, muxing to a WHIP endpoint (module docstring). The target is `live_target`'s for an
    http(s) URL; the encoder's settings are the live writer's, in the baseline profile, with Opus audio."""

    audio_priming = OPUS_PRIMING

    def __init__(self, target: LiveTarget, **kw) -> None:
        check_available(target.url)
        check_answers(target.url)
        self._certs = tempfile.TemporaryDirectory(prefix="avatar-whip-")
        self._connected = False
        super().__init__(target, **kw)

    def _open_container(self) -> av.container.OutputContainer:
        cert_file, key_file = _dtls_certificate(Path(self._certs.name))
        options = {**self.target.options, "cert_file": cert_file, "key_file": key_file}
        try:
            return av.open(self.target.url, "w", format="whip", options=options)
        except (av.error.FFmpegError, OSError) as exc:
            raise InputError(f"output: {self.target.url}: cannot open the WHIP output ({reason(exc)})") from None

    def _start(self) -> None:
        """Open the encoders (a bad codec setting fails here); the offer waits for the first frame."""
        self._video.codec_context.open()
        if self._audio is not None:
            self._audio.codec_context.open()

    def _connect(self) -> None:
        """POST the offer, follow the answer, shake hands: the muxer does it all as the header is written."""
        try:
            self._container.start_encoding()
        except BaseException as exc:
            raise self._start_failed(exc, self._video.codec_context.name) from None
        finally:
            self._certs.cleanup()  # read by the handshake; a key has no business staying on disk
        self._connected = True

    def _start_failed(self, exc: BaseException, codec: str) -> BaseException:
        url = self.target.url
        if isinstance(exc, av.error.HTTPClientError):
            return InputError(f"output: {url}: the WHIP endpoint refused the offer ({reason(exc)})")
        if isinstance(exc, (av.error.HTTPError, av.error.HTTPServerError)):
            return InputError(f"output: {url}: the WHIP endpoint failed to answer the offer ({reason(exc)})")
        if isinstance(exc, OSError):  # refused, unreachable, or ICE / DTLS that never completed
            return InputError(f"output: {url}: the WHIP endpoint does not answer ({reason(exc)})")
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
            self._connect()
        super()._encode_frame(rgb)

    def _raise_if_failed(self) -> None:
        err = self._error
        if isinstance(err, InputError):  # the offer, refused at the first frame
            raise err
        if isinstance(err, OSError) and self._connected:
            raise RenderError(f"output: {self.target.url}: the WHIP endpoint went away ({reason(err)})") from err
        super()._raise_if_failed()

    def _finalize(self) -> None:
        if self._connected and self._error is None:
            super()._finalize()  # closing the container sends the DELETE
            return
        # Never connected (nothing to flush, nothing to delete), or the muxer failed: it can block on a packet
        # muxed after its failure, so none is.
        if self._feed is not None:
            self._feed.close()
        try:
            self._container.close()
        finally:
            self._certs.cleanup()


def live_writer(target: LiveTarget, **kw) -> LiveWriter:
    """The writer for a live `target`: a WHIP endpoint's (WhipWriter, which builds on LiveWriter), or LiveWriter
    itself for every other target. Here, not in media/live.py, so that imports run one way (whip -> live)."""
    return WhipWriter(target, **kw) if target.format == "whip" else LiveWriter(target, **kw)
