"""The WHIP exchange and the WebRTC peer that sends a WhipWriter's packets (media/whip.py): aiortc, the `whip`
extra, imported only for a WHIP output.

`PeerSession` runs aiortc's RTCPeerConnection on an asyncio loop in a thread of its own, so the writer's thread
never waits on it without a timeout: it makes the offer (a send-only H.264 track and an Opus track, each fed with
encoded packets, which aiortc packetizes as they are), POSTs it, follows the answer, waits for ICE and DTLS, and
sends each packet as it is handed over. aiortc's ICE is a full agent: it answers the endpoint's consent checks and
makes its own (RFC 7675), and a connection whose consent lapses fails.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import TimeoutError as FutureTimeout
from urllib.parse import urljoin

import av
from aiortc import (MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCRtpSender,
                    RTCSessionDescription)
from aiortc.mediastreams import MediaStreamError

from avatar_cli.errors import InputError
from avatar_cli.media._files import reason

__all__ = ["PeerSession", "EndpointGone", "check_answers"]

ANSWER_TIMEOUT_S = 10.0  # the endpoint must answer the reachability check, and the offer, within this
CONNECT_TIMEOUT_S = 10.0  # ICE and DTLS must complete within this of the answer
GONE_S = 10.0  # an endpoint that sent RTCP receiver reports and then none for this long went away
DRAIN_S = 2.0  # at the end, the packets still queued get this long to leave
CLOSE_TIMEOUT_S = 10.0  # the whole close (drain, connection, DELETE) is given up after this
# What the offer proposes: H.264 in packetization mode 1 (FU-A, what WebRTC peers take), its retransmission stream,
# and Opus. aiortc would offer VP8 first; the packets are H.264.
OFFER_CODECS = {"video": ("video/h264", "video/rtx"), "audio": ("audio/opus",)}


class EndpointGone(ConnectionError):
    """The endpoint went away mid-session: its connection failed or closed, or its receiver reports stopped."""


def unreachable(url: str, exc: BaseException) -> InputError:
    why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return InputError(f"output: {url}: the WHIP endpoint does not answer ({reason(why)})")


def check_answers(url: str, timeout_s: float | None = None) -> None:
    """The endpoint answers HTTP: any response counts (many answer OPTIONS with 405 or 404; the offer says whether
    it takes the stream). An https endpoint's certificate is checked as any HTTPS client checks it."""
    request = urllib.request.Request(url, method="OPTIONS")
    try:
        urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT_S if timeout_s is None else timeout_s).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise unreachable(url, exc) from None


def post_offer(url: str, offer: str, token: str | None) -> tuple[str, str | None]:
    """POST the offer: (the answer, the session's resource from `Location`, resolved against `url`)."""
    headers = {"Content-Type": "application/sdp", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=offer.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT_S) as response:
            answer, location = response.read().decode(errors="replace"), response.headers.get("Location")
    except urllib.error.HTTPError as exc:
        what = "refused" if 400 <= exc.code < 500 else "failed to answer"
        raise InputError(f"output: {url}: the WHIP endpoint {what} the offer (HTTP {exc.code} {exc.reason})") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise unreachable(url, exc) from None
    return answer, urljoin(url, location) if location else None


def delete(resource: str, token: str | None) -> None:
    """End the session at the endpoint (RFC 9725); one that is gone by now is no error."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        urllib.request.urlopen(urllib.request.Request(resource, headers=headers, method="DELETE"),
                               timeout=ANSWER_TIMEOUT_S).close()
    except (urllib.error.URLError, OSError, ValueError):
        pass


class PacketTrack(MediaStreamTrack):
    """A track of encoded packets, queued by the writer's thread through the loop; None ends it."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.queue: asyncio.Queue[av.Packet | None] = asyncio.Queue()

    async def recv(self) -> av.Packet:
        packet = await self.queue.get()
        if packet is None:
            self.stop()
            raise MediaStreamError
        return packet


class PeerSession:
    """One WHIP session (module docstring). `connect()` and `close()` block the caller, each bounded in time;
    `send()` never blocks, and raises EndpointGone once the endpoint is gone."""

    def __init__(self, url: str, token: str | None):
        self.url, self.token = url, token
        self.resource: str | None = None
        self.gone: str | None = None  # why the endpoint is gone
        self._closing = False
        self._pc: RTCPeerConnection | None = None
        self._tracks: dict[str, PacketTrack] = {}
        self._watch: asyncio.Task | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="whip-peer", daemon=True)
        self._thread.start()

    def _call(self, coro, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def connect(self) -> None:
        limit = ANSWER_TIMEOUT_S + CONNECT_TIMEOUT_S + 5.0  # the offer's gathering, POST, ICE and DTLS
        try:
            self._call(self._connect(), limit)
        except FutureTimeout:
            raise InputError(f"output: {self.url}: the WHIP endpoint does not answer (not connected within "
                             f"{limit:g} s)") from None

    async def _connect(self) -> None:
        pc = self._pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # an ingest server needs no STUN
        for kind, mimes in OFFER_CODECS.items():
            track = self._tracks[kind] = PacketTrack(kind)
            codecs = [c for c in RTCRtpSender.getCapabilities(kind).codecs if c.mimeType.lower() in mimes
                      and c.parameters.get("packetization-mode", "1") == "1"]
            pc.addTransceiver(track, direction="sendonly").setCodecPreferences(codecs)
        settled = asyncio.Event()

        @pc.on("connectionstatechange")
        def on_state() -> None:
            if pc.connectionState in ("failed", "closed") and not self._closing and self.gone is None:
                self.gone = f"its connection {pc.connectionState}"
            if pc.connectionState in ("connected", "failed", "closed"):
                settled.set()

        await pc.setLocalDescription(await pc.createOffer())  # gathers the host candidates first
        answer, self.resource = await self._loop.run_in_executor(None, post_offer, self.url,
                                                                 pc.localDescription.sdp, self.token)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
        except ValueError as exc:
            raise InputError(f"output: {self.url}: the WHIP endpoint's answer is not usable ({reason(exc)})") from None
        try:
            await asyncio.wait_for(settled.wait(), CONNECT_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        if pc.connectionState != "connected":
            self.gone = None
            raise InputError(f"output: {self.url}: the WHIP endpoint does not answer (ICE and DTLS did not "
                             f"connect within {CONNECT_TIMEOUT_S:g} s)")
        self._watch = asyncio.ensure_future(self._watch_reports())

    async def _watch_reports(self) -> None:
        """A live peer sends RTCP receiver reports every second or so. Once some came, none for GONE_S means the
        endpoint went away (a process that died says nothing over UDP; its consent would lapse only in 30 s)."""
        senders = self._pc.getSenders()
        while not self._closing and self.gone is None:
            await asyncio.sleep(min(0.5, GONE_S / 4))
            latest = [stats.timestamp for sender in senders for stats in (await sender.getStats()).values()
                      if stats.type == "remote-inbound-rtp"]
            if latest:
                silent = (datetime.datetime.now(datetime.timezone.utc) - max(latest)).total_seconds()
                if silent > GONE_S and self.gone is None:
                    self.gone = f"no RTCP receiver report for {GONE_S:g} s"

    def send(self, kind: str, packet: av.Packet) -> None:
        if self.gone is not None:
            raise EndpointGone(self.gone)
        self._loop.call_soon_threadsafe(self._tracks[kind].queue.put_nowait, packet)

    def close(self) -> None:
        """Let what is queued leave (DRAIN_S), close the connection, send the DELETE: at most CLOSE_TIMEOUT_S
        whatever the endpoint does (given up, the endpoint expires the session on its own)."""
        self._closing = True
        try:
            if self._pc is not None:
                self._call(self._close(), CLOSE_TIMEOUT_S)
        except (FutureTimeout, OSError):
            pass
        finally:
            self._loop.call_soon_threadsafe(self._stop_loop)
            self._thread.join(CLOSE_TIMEOUT_S)

    def _stop_loop(self) -> None:
        """Cancel what still runs (a close given up on), let the cancellations land, stop."""
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        self._loop.call_soon(self._loop.stop)

    async def _close(self) -> None:
        deadline = time.monotonic() + DRAIN_S
        while self.gone is None and time.monotonic() < deadline and any(t.queue.qsize()
                                                                         for t in self._tracks.values()):
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # the last packets' way through the sender
        for track in self._tracks.values():
            track.queue.put_nowait(None)
        if self._watch is not None:
            self._watch.cancel()
        await self._pc.close()
        if self.resource is not None:
            await self._loop.run_in_executor(None, delete, self.resource, self.token)
