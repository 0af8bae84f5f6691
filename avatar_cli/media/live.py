"""Live outputs: the render's H.264/AAC stream, muxed by PyAV while it is generated, to somewhere other than a file.

    -o -                    MPEG-TS on stdout, for `| ffplay -` or `| ffmpeg ...`
    -o rtmp://host/app/key  FLV to an RTMP server (also rtmps://)
    -o out/live.m3u8        HLS: 1-s segments (live.hls_segment_s) beside the playlist, which is rewritten as each
                            segment completes and ends with EXT-X-ENDLIST when the session ends
    -o udp://host:port      MPEG-TS over UDP (also tcp://)
    -o http://host/whip     WebRTC to a WHIP endpoint (also https://): H.264 and Opus, media/whip.py

Everything goes through the FFmpeg inside PyAV's wheel (its muxers and protocols), but WHIP, whose packets aiortc
sends: no ffmpeg binary at run time.

The encoder is the file writer's (`Mp4Writer`: same colour settings, same AAC priming rule, same back-pressure),
with the settings a live stream needs: a keyframe every second, or every HLS segment (where HLS cuts segments and
where a viewer who joins can start), no B-frames, x264's zerolatency tune (no lookahead: a frame's packet leaves as the frame goes in) and a
constant frame rate. With `realtime`, frames are muxed on the stream's frame clock (media/pacing.py: frame k at the
first frame's time + k / fps, as `ffmpeg -re`), so a server gets a stream rather than a burst; a renderer that runs
ahead blocks on the writer's queue instead of piling frames up.
"""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

import av

from avatar_cli.errors import InputError
from avatar_cli.media._files import reason
from avatar_cli.media.pacing import FramePacer
from avatar_cli.media.writer import Mp4Writer

__all__ = ["LiveTarget", "live_target", "LiveWriter", "HLS_SEGMENT_S", "HLS_LIST_SIZE"]

HLS_SEGMENT_S = 1.0  # seconds per segment (live.hls_segment_s): a keyframe as often lets the muxer cut exactly there
HLS_LIST_SIZE = 6  # segments a rolling playlist names (players start ~3 segments from its live edge)
HLS_MIN_FREE = 1 << 20  # bytes a segment folder must have free before a segment starts
# URL schemes that FFmpeg opens for writing and the muxer each one takes.
_UNREACHABLE = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT,
                errno.EIO, errno.EPIPE, errno.ENOENT, errno.EACCES}
STREAM_SCHEMES = {"rtmp": "flv", "rtmps": "flv", "udp": "mpegts", "tcp": "mpegts"}
# What keeps a stream's muxer from holding packets back. flush_packets: each packet's bytes leave as it is muxed.
# max_interleave_delta (microseconds): by default the interleaver holds a video packet until the audio has a later
# one, and the AAC encoder's packets trail the frames by two AAC frames (2048 samples), so a chunk's last frames
# would wait for the next chunk; at 1 a packet waits at most for the next packet muxed. pes_payload_size 0 (MPEG-TS): each AAC packet is a
# PES of its own, not gathered for up to half of max_delay (0.35 s).
LOW_DELAY = {"flush_packets": "1", "max_interleave_delta": "1"}
MPEGTS_LOW_DELAY = {**LOW_DELAY, "pes_payload_size": "0"}


@dataclass(frozen=True)
class LiveTarget:
    """Where a live stream goes: `url` as FFmpeg opens it ("-" is stdout), its muxer and the muxer's options."""

    url: str
    format: str
    options: dict[str, str] = field(default_factory=dict, repr=False)  # repr=False: WHIP's hold its bearer token
    keyframe_s: float = 1.0  # seconds between keyframes (HLS: its segment length, which the muxer cuts on)

    def keyframe_frames(self, fps: float) -> int:
        """Frames between keyframes: `keyframe_s` rounded up to whole frames (HLS cuts a segment at the first
        keyframe at least `hls_time` after its start, so the interval must not fall short of it)."""
        return max(1, math.ceil(self.keyframe_s * fps - 1e-6))

    @property
    def kind(self) -> str:
        if self.url == "-":
            return "stdout"
        return self.format if self.format in ("hls", "whip") else urlsplit(self.url).scheme


def live_target(output: str, *, keep_segments: bool = False, bearer_token: str | None = None,
                hls_segment_s: float = HLS_SEGMENT_S) -> LiveTarget | None:
    """The live target `output` names, or None when it names a file (an MP4 render).

    HLS cuts a segment every `hls_segment_s` seconds (rounded up to whole frames), on a keyframe put there: a
    shorter segment is listed sooner, and costs the bits of the extra keyframes. HLS keeps the newest HLS_LIST_SIZE segments on disk and in the playlist, deleting older ones, so a session of
    any length holds bounded disk; `keep_segments` keeps every segment and lists them all (an "event" playlist a
    late viewer can seek back in, which grows with the session). An http(s) URL is a WHIP endpoint;
    `bearer_token` goes in its `Authorization` header."""
    if output == "-":
        return LiveTarget("-", "mpegts", dict(MPEGTS_LOW_DELAY))
    scheme = urlsplit(output).scheme.lower()
    if scheme in ("http", "https"):
        return LiveTarget(output, "whip", {"authorization": bearer_token} if bearer_token else {})
    if scheme in STREAM_SCHEMES:
        fmt = STREAM_SCHEMES[scheme]
        options = dict(MPEGTS_LOW_DELAY if fmt == "mpegts" else LOW_DELAY)
        if fmt == "flv":
            options["flvflags"] = "no_duration_filesize"  # a live FLV has no length to write back at the end
        if scheme == "udp":
            options["pkt_size"] = "1316"  # 7 TS packets: one UDP datagram under a 1500-byte MTU
        return LiveTarget(output, fmt, options)
    if "://" in output:
        raise InputError(f"output: {output}: not a live target this build can write "
                         f"(use -, rtmp://, rtmps://, udp://, tcp://, http(s):// for WHIP, a .m3u8 path, or an .mp4 file)")
    if output.lower().endswith(".m3u8"):
        folder = Path(output).parent
        options = {"hls_time": f"{hls_segment_s:g}", "hls_segment_type": "mpegts",
                   "hls_segment_filename": str(folder / (Path(output).stem + "_%05d.ts"))}
        if keep_segments:
            options.update(hls_list_size="0", hls_playlist_type="event")
        else:
            options.update(hls_list_size=str(HLS_LIST_SIZE), hls_flags="delete_segments")
        return LiveTarget(output, "hls", options, keyframe_s=hls_segment_s)
    return None


class LiveWriter(Mp4Writer):
    """The file writer's encoder and queue, muxing to a live target instead of a fragmented MP4.

    `audio_path` is usually an AudioFeed the session fills as audio arrives (silence where it stalled); a file path
    works too. `stdout` is the binary stream `-` writes to (sys.stdout.buffer unless given). `total_frames` bounds
    nothing for a live session of unknown length: leave it at its default. `pacer` is the frame clock `realtime`
    paces on (a FramePacer at the stream's fps unless given).
    """

    x264_tune = "zerolatency"

    def __init__(self, target: LiveTarget, *, realtime: bool = False, stdout: BinaryIO | None = None,
                 total_frames: int = 2**62, preset: str = "veryfast", pacer: FramePacer | None = None,
                 **kw) -> None:
        self.target = target
        self.realtime = realtime
        self._stdout = stdout
        self.pacer = pacer if pacer is not None else FramePacer(kw["fps"])
        super().__init__(target.url, total_frames=total_frames, preset=preset, **kw)

    def _add_video(self, codec: str, crf: int, preset: str, threads: int | None) -> av.VideoStream:
        stream = super()._add_video(codec, crf, preset, threads)
        gop = str(self.target.keyframe_frames(float(self.rate)))  # the file writer's is a second
        stream.options = {**stream.options, "g": gop, **({"keyint_min": gop} if "keyint_min" in stream.options else {})}
        return stream

    def _open_container(self) -> av.container.OutputContainer:
        t = self.target
        try:
            if t.url == "-":
                out = self._stdout if self._stdout is not None else os.fdopen(os.dup(1), "wb", buffering=0)
                return av.open(out, "w", format=t.format, options=dict(t.options))
            if t.format == "hls":
                Path(t.url).parent.mkdir(parents=True, exist_ok=True)
            return av.open(t.url, "w", format=t.format, options=dict(t.options), timeout=(10.0, 30.0))
        except (av.error.FFmpegError, OSError) as exc:
            raise InputError(f"output: {t.url}: cannot open the {t.kind} output ({reason(exc)})") from None

    def _start_failed(self, exc: BaseException, codec: str) -> BaseException:
        # Network targets connect when the header is written: a refused or unreachable URL is a bad output, not a
        # failed encoder.
        if isinstance(exc, OSError) and exc.errno in _UNREACHABLE and self.target.kind not in ("stdout", "hls"):
            return InputError(f"output: {self.target.url}: cannot open the {self.target.kind} output ({reason(exc)})")
        return super()._start_failed(exc, codec)

    def _check_space(self) -> None:
        """FFmpeg's HLS muxer does not report a segment it could not write: a full disk would leave a playlist of
        empty segments and a session that says it succeeded. So each second, before the next segment starts, the
        folder must have room for one (its writes then fail as the disk's do)."""
        folder = Path(self.target.url).parent
        st = os.statvfs(folder)
        if st.f_bavail * st.f_frsize < HLS_MIN_FREE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))

    def abort(self):
        """Stop: the frames already handed over still go out, unpaced, so the stream ends where a recording of it
        ends; what cannot be sent any more (the server went away) is dropped."""
        self.realtime = False
        try:
            return self.close()
        except Exception:  # the output failed: the first error was reported already
            return super().abort()

    def _encode_frame(self, rgb) -> None:
        if self.target.format == "hls" and self._frames_written % max(1, round(float(self.rate))) == 0:
            self._check_space()
        if self.realtime:
            self.pacer.wait(self._frames_written)
        super()._encode_frame(rgb)

