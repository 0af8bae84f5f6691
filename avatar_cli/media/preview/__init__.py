"""A page to watch a live HLS render: a small HTTP server on loopback serving the playlist, its segments and a player.

    preview = Preview(Path("out/live.m3u8"))   # serves out/ and the page
    print(preview.url)                          # http://127.0.0.1:PORT/
    ...
    preview.close()

The player is hls.js (hls.light.min.js, vendored here from the npm package, Apache-2.0; see hls.js.LICENSE): browsers
other than Safari have no HLS of their own, and hls.js plays a live playlist through Media Source Extensions. The
server is the standard library's threading HTTP server: it serves static files, which is all a preview needs, with
`no-store` on the playlist so players always read the newest one. The page reports where playback is (POST
/playback); `Preview.playback` keeps the latest report of each kind, so a session or a test can tell that a viewer
is watching and how far behind the live edge it plays.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
import time
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

__all__ = ["Preview"]

HERE = Path(__file__).resolve().parent
ASSETS = {"/": "index.html", "/index.html": "index.html", "/hls.light.min.js": "hls.light.min.js"}


class _Handler(SimpleHTTPRequestHandler):
    preview: Preview

    def do_GET(self):  # noqa: N802 (the standard library's name)
        path = urlsplit(self.path).path
        if path in ASSETS:
            body = (HERE / ASSETS[path]).read_bytes()
            if path != "/hls.light.min.js":
                body = body.replace(b"PLAYLIST", self.preview.playlist.name.encode())
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/html; charset=utf-8" if path != "/hls.light.min.js"
                             else "text/javascript")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)
            return
        if path.endswith(".m3u8") and not (self.preview.playlist.parent / path.lstrip("/")).exists():
            # Not written yet (the first segment is still being made): players retry a 503, not a 404.
            self.send_response(HTTPStatus.SERVICE_UNAVAILABLE)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()

    def do_POST(self):  # noqa: N802
        url = urlsplit(self.path)
        if url.path != "/playback":
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        try:
            self.preview._report(q.get("event", "time"), float(q.get("t", "nan")))
        except ValueError:
            self.send_error(HTTPStatus.BAD_REQUEST)
            return
        self.send_response(HTTPStatus.NO_CONTENT)
        self.end_headers()

    def end_headers(self):
        if self.path.endswith(".m3u8"):
            self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def guess_type(self, path):
        if str(path).endswith(".m3u8"):
            return "application/vnd.apple.mpegurl"
        if str(path).endswith(".ts"):
            return "video/mp2t"
        return super().guess_type(path)

    def log_message(self, *args):  # the session reports its own progress; no access log on stderr
        pass


class Preview:
    """Serves `playlist`'s folder and the player page on host:port (port 0: any free one) until close()."""

    def __init__(self, playlist: Path, host: str = "127.0.0.1", port: int = 0,
                 on_first: Callable[[str, float], None] = lambda event, t: None):
        """on_first(event, player time): called once per kind of report (playing, time, ended), from the server's
        thread, so a session can say that a viewer is watching."""
        self.playlist = Path(playlist)
        self.on_first = on_first
        self.playback: dict[str, tuple[float, float]] = {}  # event -> (player time s, wall time of the report)
        handler = type("Handler", (_Handler,), {"preview": self})
        self._server = ThreadingHTTPServer((host, port), functools.partial(handler, directory=str(self.playlist.parent)))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="preview", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    def _report(self, event: str, t: float) -> None:
        first = event not in self.playback
        self.playback[event] = (t, time.time())
        if first:
            self.on_first(event, t)

    def linger(self, timeout: float) -> None:
        """After the stream ended: keep serving while a page that is playing it reaches its end (at most `timeout`
        seconds; at once when no page ever played)."""
        deadline = time.time() + timeout
        while "time" in self.playback and "ended" not in self.playback and time.time() < deadline:
            time.sleep(0.1)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
