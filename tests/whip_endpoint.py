"""A WHIP endpoint on loopback for the tests: aiortc's WebRTC peer behind the standard library's HTTP server, in a
process of its own (`WhipPeer` starts it): PyAV holds the GIL while its muxer posts the offer and shakes hands, so an
endpoint in the muxer's process would never get to answer.

aiortc's ICE checks consent (RFC 7675) as a strict peer does: a binding request every CONSENT_INTERVAL seconds, and
the session dropped after CONSENT_FAILURES unanswered in a row (about 30 s by default). `consent_s` shortens that
expiry to about that many seconds, in the endpoint's process.

POST an SDP offer to `url`: the endpoint answers as an ingest server does (201 Created, the answer, a `Location`
header naming the session's resource, relative as servers usually give it) and receives the tracks: every decoded
video frame and audio frame is counted, with its timestamp, so a test can check counts and gaps. DELETE to the
resource ends the session. `refuse` answers every offer with that status instead; `WhipPeer.gone()` kills the
endpoint's process mid-session, as a server that crashes.

aiortc leaves 127.0.0.1 out of its host candidates and asks a public STUN server by default: on loopback, with no
network, the endpoint offers its loopback address and no ICE servers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aioice.ice
import aioice.stun
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

CONSENT_RTO = 0.1  # seconds a consent check waits for its answer, with consent_s (aioice's default: 0.5)
RECEIVE_BUFFER = 8 << 20  # bytes: a burst of RTP at the kernel's default buffer loses packets on a busy machine

_host_addresses = aioice.ice.get_host_addresses


def _with_loopback(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    return ["127.0.0.1"] + (_host_addresses(False, use_ipv6) if use_ipv6 else [])


@dataclass
class Received:
    """What the endpoint received: per decoded frame its timestamp in seconds; audio as sample counts."""

    video_times: list[float] = field(default_factory=list)
    video_arrivals: list[float] = field(default_factory=list)  # time.monotonic() as each frame was decoded
    audio_times: list[float] = field(default_factory=list)
    audio_samples: int = 0
    audio_rate: int = 0
    audio_peak: float = 0.0  # the largest sample seen: speech, not silence
    kinds: list[str] = field(default_factory=list)
    states: list[str] = field(default_factory=list)  # the peer connection's states, in order


class WhipEndpoint:
    """The endpoint, serving on a thread until close(); see the module docstring."""

    def __init__(self, refuse: int | None = None, path: str = "/live/whip"):
        self.refuse = refuse
        self.offers: list[str] = []
        self.authorization: list[str | None] = []  # the Authorization header of each POST
        self.deletes: list[str] = []  # the paths DELETE reached
        self.received = Received()
        self.connected = threading.Event()
        self._gone = False
        self._pcs: list[RTCPeerConnection] = []
        self._tasks: list[asyncio.Task] = []
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="whip-peer", daemon=True)
        self._loop_thread.start()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="whip-http", daemon=True)
        self._http_thread.start()
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}{path}"

    def _handler(self):
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                endpoint.offers.append(body)
                endpoint.authorization.append(self.headers.get("Authorization"))
                if endpoint.refuse is not None:
                    self.send_response(endpoint.refuse)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.headers.get("Content-Type") != "application/sdp":
                    self.send_response(415)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                answer = asyncio.run_coroutine_threadsafe(endpoint._answer(body), endpoint._loop).result(30)
                data = answer.encode()
                self.send_response(201)
                self.send_header("Content-Type", "application/sdp")
                self.send_header("Location", f"../resource/{len(endpoint.offers)}")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_DELETE(self) -> None:
                endpoint.deletes.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler

    async def _answer(self, offer: str) -> str:
        aioice.ice.get_host_addresses = _with_loopback
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self._pcs.append(pc)

        @pc.on("track")
        def on_track(track) -> None:
            self.received.kinds.append(track.kind)
            self._tasks.append(asyncio.ensure_future(self._consume(track)))

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            self.received.states.append(pc.connectionState)
            if pc.connectionState == "connected":
                self._widen_buffers(pc)
                self.connected.set()

        await pc.setRemoteDescription(RTCSessionDescription(offer, "offer"))
        await pc.setLocalDescription(await pc.createAnswer())
        return pc.localDescription.sdp

    @staticmethod
    def _widen_buffers(pc: RTCPeerConnection) -> None:
        for transceiver in pc.getTransceivers():
            ice = transceiver.receiver.transport.transport
            for protocol in ice._connection._protocols:
                sock = protocol.transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)

    async def _consume(self, track) -> None:
        r = self.received
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if track.kind == "video":
                r.video_times.append(float(frame.time))
                r.video_arrivals.append(time.monotonic())
            else:
                r.audio_times.append(float(frame.time))
                r.audio_samples += frame.samples
                r.audio_rate = frame.sample_rate
                r.audio_peak = max(r.audio_peak, float(abs(frame.to_ndarray()).max()) / 32768)

    def _stop(self) -> None:
        if self._gone:
            return
        self._gone = True
        self._http.shutdown()
        self._http.server_close()
        asyncio.run_coroutine_threadsafe(self._close_peers(), self._loop).result(30)

    async def _close_peers(self) -> None:
        for pc in self._pcs:
            await pc.close()
        for task in self._tasks:
            task.cancel()

    def close(self) -> None:
        try:
            self._stop()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(10)
            aioice.ice.get_host_addresses = _host_addresses

    def report(self) -> dict:
        r = self.received
        return dict(url=self.url, offers=len(self.offers), authorization=self.authorization, deletes=self.deletes,
                    connected=self.connected.is_set(), kinds=r.kinds, video_times=r.video_times,
                    video_arrivals=r.video_arrivals,
                    audio_times=r.audio_times, audio_samples=r.audio_samples, audio_rate=r.audio_rate,
                    audio_peak=r.audio_peak, states=r.states)


def serve(refuse: int | None, consent_s: float | None) -> None:
    """The endpoint's process: prints its URL, then answers `report` on stdin with a JSON line of what it
    received; at the end of stdin it closes. `consent_s`: the peer's consent expires after this long unanswered."""
    if consent_s is not None:  # each check waits one STUN timeout for its answer: short on loopback
        aioice.stun.RETRY_RTO = CONSENT_RTO
        aioice.ice.CONSENT_INTERVAL = consent_s / aioice.ice.CONSENT_FAILURES - CONSENT_RTO
    endpoint = WhipEndpoint(refuse)
    print(endpoint.url, flush=True)
    for line in sys.stdin:
        if line.strip() == "report":
            print(json.dumps(endpoint.report()), flush=True)
        elif line.strip() == "hang up":  # close the peer connections (DTLS close_notify), keep serving HTTP
            asyncio.run_coroutine_threadsafe(endpoint._close_peers(), endpoint._loop).result(30)
            print(json.dumps({}), flush=True)
    endpoint.close()


class WhipPeer:
    """The endpoint in a process of its own: `url`, `report()` (what it received so far), `hang_up()`, `gone()`,
    `close()`."""

    def __init__(self, refuse: int | None = None, consent_s: float | None = None):
        args = [str(refuse), str(consent_s)]
        self.proc = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.url = self.proc.stdout.readline().strip()
        assert self.url.startswith("http://"), "the WHIP endpoint did not start"

    def _ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def report(self) -> dict:
        return self._ask("report")

    def hang_up(self) -> None:
        """The endpoint closes the session gracefully, as a server whose operator ends the stream."""
        self._ask("hang up")

    def gone(self) -> None:
        """The endpoint's process dies, as a server that crashes: every socket it held closes."""
        self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        finally:
            self.proc.kill()

    def __enter__(self) -> WhipPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    serve(None if sys.argv[1] == "None" else int(sys.argv[1]), None if sys.argv[2] == "None" else float(sys.argv[2]))
