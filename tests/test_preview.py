"""The preview page (`avatar render ... -o NAME.m3u8 --preview`): a real headless Chromium plays the live HLS output
while the session renders it, then to its end. (A test about processes: the session and the browser run as their
own.)"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import write_wav

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_page_plays_the_live_stream_then_to_its_end(job_dir: Path, tmp_path: Path):
    assert CHROMIUM, "chromium is not installed (.ci/run installs it)"
    write_wav(job_dir / "speech.wav", 8.0)  # long enough for the page to join while it renders
    playlist = tmp_path / "hls" / "live.m3u8"
    session = subprocess.Popen([sys.executable, "-m", "avatar_cli", "render", str(job_dir / "job.yaml"), "-o",
                                str(playlist), "--preview", "--json"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    browser = None
    seen = []
    try:
        for line in session.stdout:
            event = json.loads(line)
            seen.append(event)
            if event["event"] == "preview":
                browser = subprocess.Popen(
                    [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--mute-audio", "--no-first-run",
                     "--autoplay-policy=no-user-gesture-required", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync", "--disable-quic",
                     f"--user-data-dir={tmp_path / 'browser'}", event["url"]],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert session.wait(timeout=120) == 0, session.stderr.read()
    finally:
        session.kill()
        if browser is not None:
            browser.kill()
            browser.wait()
    kinds = [(e["event"], e.get("playback")) for e in seen]
    assert ("preview", None) in kinds
    # The page played while the session still rendered (before its done event), then played to the end.
    assert kinds.index(("viewer", "playing")) < kinds.index(("done", None))
    assert ("viewer", "ended") in kinds
    ended = [e for e in seen if e.get("playback") == "ended"][0]
    done = [e for e in seen if e["event"] == "done"][0]
    assert abs(ended["t"] - done["duration_s"]) < 0.5
