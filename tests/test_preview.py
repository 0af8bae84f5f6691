"""The preview page (avatar_cli/media/preview/): a real headless Chromium plays the live HLS output while it is being
written, then to its end. (A test about processes: the browser runs as its own.)"""

import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from avatar_cli.media.live import LiveWriter, live_target
from avatar_cli.media.preview import Preview

FPS, SIZE = 25, 128
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Silence:
    rate, channels = 16000, 1

    def take(self, n: int) -> np.ndarray:
        return np.zeros((1, n), np.float32)

    def close(self) -> None:
        pass


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_page_plays_the_live_stream_then_to_its_end(tmp_path: Path):
    assert CHROMIUM, "chromium is not installed (.ci/run installs it)"
    playlist = tmp_path / "live" / "live.m3u8"
    writer = LiveWriter(live_target(str(playlist), keep_segments=True), width=SIZE, height=SIZE, fps=FPS,
                        audio_path=Silence(), realtime=True, queue_frames=2)
    preview = Preview(playlist)
    frames = np.zeros((FPS, SIZE, SIZE, 3), np.uint8)
    browser = None
    try:
        for second in range(3):  # the first segments exist before the page loads
            frames[..., 1] = 60 * second
            writer.put(frames)
        browser = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--mute-audio", "--no-first-run",
             "--autoplay-policy=no-user-gesture-required", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-quic", f"--user-data-dir={tmp_path / 'b'}",
             preview.url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds = 3
        while "time" not in preview.playback or preview.playback["time"][0] <= 0.5:
            assert seconds < 40, f"the page did not play while the render ran: {preview.playback}"
            frames[..., 1] = (60 * seconds) % 256
            writer.put(frames)  # realtime: one second of stream a second
            seconds += 1
        assert "#EXT-X-ENDLIST" not in playlist.read_text()  # it played while the stream was still live
        writer.close()
        assert wait_until(lambda: "ended" in preview.playback, 60), preview.playback
        assert preview.playback["ended"][0] == pytest.approx(seconds, abs=0.5)  # to its end
    finally:
        if browser is not None:
            browser.kill()
            browser.wait()
        writer.abort()
        preview.close()
