"""Media layer: image/audio input and the live MP4 writer. All media is generated here, with PyAV."""

from __future__ import annotations

import os
import shutil
import struct
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from avatar_cli.errors import InputError, RenderError
from avatar_cli.media import writer as writer_mod
from avatar_cli.media.audio import AudioInfo, AudioWindowReader, iter_audio_chunks, probe_audio
from avatar_cli.media.image import fit_image_pil, fit_square, load_image, save_png, small_image_warning
from avatar_cli.media.writer import AAC_PRIMING, Mp4Writer, resolve_codec

# ---------------------------------------------------------------- media generators


def write_image(path: Path, arr: np.ndarray, codec: str, pix_fmt: str) -> Path:
    """Encode one frame with PyAV's image2 muxer (png / mjpeg / libwebp)."""
    in_fmt = {1: "gray", 3: "rgb24", 4: "rgba"}[arr.shape[2]]
    with av.open(str(path), "w", format="image2") as c:
        s = c.add_stream(codec, rate=1)
        s.width, s.height, s.pix_fmt = arr.shape[1], arr.shape[0], pix_fmt
        frame = av.VideoFrame.from_ndarray(arr[..., 0] if arr.shape[2] == 1 else arr, format=in_fmt)
        for p in [*s.encode(frame), *s.encode(None)]:
            c.mux(p)
    return path


def gradient(h: int, w: int) -> np.ndarray:
    """Smooth content, so lossy codecs stay close to it."""
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), np.full_like(xx, 128)], -1).astype(np.uint8)


def tone(n: int, rate: int, channels: int, freq: float = 440.0, amp: float = 0.3) -> np.ndarray:
    """float32 (C, n) sine; channel c gets amplitude amp / (c + 1) so channels differ."""
    t = np.arange(n) / rate
    base = np.sin(2 * np.pi * freq * t)
    return np.stack([amp / (c + 1) * base for c in range(channels)]).astype(np.float32)


def write_audio(path: Path, fmt: str, codec: str, rate: int, signal: np.ndarray) -> Path:
    """Encode float32 (C, n) with PyAV (container `fmt`, `codec`)."""
    channels = signal.shape[0]
    layout = {1: "mono", 2: "stereo", 6: "5.1"}[channels]
    with av.open(str(path), "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate, layout=layout)
        res = av.AudioResampler(format=s.format.name, layout=layout, rate=rate)
        for pos in range(0, max(signal.shape[1], 1), 4096):
            chunk = np.ascontiguousarray(signal[:, pos : pos + 4096])
            if chunk.shape[1] == 0:
                break
            f = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
            f.sample_rate, f.pts, f.time_base = rate, pos, Fraction(1, rate)
            for rf in res.resample(f):
                for p in s.encode(rf):
                    c.mux(p)
        for rf in res.resample(None):
            for p in s.encode(rf):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return path


def write_wav_fast(path: Path, signal: np.ndarray, rate: int) -> Path:
    """16-bit PCM wav by hand: cheap enough for a 10-minute file."""
    pcm = np.clip(np.rint(signal.T * 32767), -32768, 32767).astype("<i2")  # (n, C)
    data = pcm.tobytes()
    ch = signal.shape[0]
    hdr = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE"
    hdr += b"fmt " + struct.pack("<IHHIIHH", 16, 1, ch, rate, rate * ch * 2, ch * 2, 16)
    hdr += b"data" + struct.pack("<I", len(data))
    path.write_bytes(hdr + data)
    return path


def cut(src: Path, dst: Path, frac: float) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: int(len(data) * frac)])
    return dst


def decode_mono_direct(path: Path, rate: int) -> np.ndarray:
    """Independent reference: decode everything, resample in one go."""
    res = av.AudioResampler(format="flt", layout="mono", rate=rate)
    out = []
    with av.open(str(path)) as c:
        for fr in c.decode(audio=0):
            fr.pts = None
            out += [o.to_ndarray()[0] for o in res.resample(fr)]
    out += [o.to_ndarray()[0] for o in res.resample(None)]
    return np.concatenate(out)


# ---------------------------------------------------------------- images


@pytest.mark.parametrize(
    "name,codec,pix_fmt,max_err",
    [("a.png", "png", "rgb24", 0.0), ("a.jpg", "mjpeg", "yuvj444p", 4.0), ("a.webp", "libwebp", "yuv420p", 6.0)],
)
def test_load_image_formats(tmp_path, name, codec, pix_fmt, max_err):
    src = gradient(30, 50)  # odd aspect, not a multiple of 16
    img = load_image(write_image(tmp_path / name, src, codec, pix_fmt))
    assert img.dtype == np.uint8 and img.shape == (30, 50, 3)
    assert np.abs(img.astype(int) - src).mean() <= max_err


def test_load_image_rgba_is_composited_on_white(tmp_path):
    rgba = np.zeros((8, 10, 4), np.uint8)
    rgba[:, :5] = (10, 20, 30, 255)  # opaque left half
    rgba[:, 5:] = (0, 0, 0, 0)  # transparent black right half
    img = load_image(write_image(tmp_path / "rgba.png", rgba, "png", "rgba"))
    assert img.shape == (8, 10, 3)
    assert (img[:, :5] == (10, 20, 30)).all()
    assert (img[:, 5:] == 255).all()


def test_load_image_grayscale(tmp_path):
    g = np.arange(48, dtype=np.uint8).reshape(6, 8, 1) * 5
    img = load_image(write_image(tmp_path / "g.png", g, "png", "gray"))
    assert img.shape == (6, 8, 3)
    assert (img == g).all()  # broadcast: each channel equals the gray value


def with_exif_orientation(jpg: Path, orientation: int, dst: Path) -> Path:
    """Insert an APP1 EXIF segment carrying only the Orientation tag (as phone cameras write it)."""
    ifd = struct.pack(">H", 1) + struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    app1 = b"Exif\x00\x00" + b"MM\x00\x2a" + struct.pack(">I", 8) + ifd
    data = jpg.read_bytes()
    dst.write_bytes(data[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + data[2:])
    return dst


@pytest.mark.parametrize("orientation,band_at", [(1, "top"), (3, "bottom"), (6, "right"), (8, "left")])
def test_load_image_applies_exif_orientation(tmp_path, orientation, band_at):
    stored = np.zeros((30, 50, 3), np.uint8)
    stored[:10] = 255  # white band along the stored top edge
    jpg = write_image(tmp_path / "s.jpg", stored, "mjpeg", "yuvj444p")
    img = load_image(with_exif_orientation(jpg, orientation, tmp_path / "o.jpg"))
    assert img.shape == ((30, 50, 3) if orientation in (1, 3) else (50, 30, 3))
    edges = {"top": img[:5], "bottom": img[-5:], "left": img[:, :5], "right": img[:, -5:]}
    assert {k for k, v in edges.items() if v.mean() > 200} == {band_at}


def _bad_images(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    png = write_image(tmp_path / "ok.png", gradient(20, 20), "png", "rgb24")
    text = tmp_path / "notes.png"
    text.write_text("hello, I am not a picture\n")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    wav = write_wav_fast(tmp_path / "a.wav", tone(800, 8000, 1), 8000)
    return {
        "missing": (tmp_path / "nope.png", "no such file"),
        "directory": (tmp_path, "directory"),
        "text": (text, "cannot decode"),
        "empty": (empty, "empty"),
        "wav": (wav, "not an image"),
        "truncated": (cut(png, tmp_path / "cut.png", 0.5), "truncated or corrupt"),
    }


@pytest.mark.parametrize("case", ["missing", "directory", "text", "empty", "wav", "truncated"])
def test_load_image_errors(tmp_path, case):
    path, words = _bad_images(tmp_path)[case]
    with pytest.raises(InputError) as info:
        load_image(path, what="reference")
    msg = str(info.value)
    assert msg.startswith(f"reference: {path}: ") and words in msg and "\n" not in msg
    assert info.value.exit_code == 2


SAMPLE_REFERENCE = Path(__file__).resolve().parent.parent / "sample_inputs" / "reference.png"


def _sample_as(tmp_path: Path, name: str) -> Path:
    """The shipped sample face re-encoded by extension (real photo-like content, not a flat test pattern)."""
    if name.endswith(".png"):
        dst = tmp_path / name
        dst.write_bytes(SAMPLE_REFERENCE.read_bytes())
        return dst
    codec, pix_fmt = {".jpg": ("mjpeg", "yuvj420p"), ".webp": ("libwebp", "yuv420p")}[Path(name).suffix]
    return write_image(tmp_path / name, load_image(SAMPLE_REFERENCE), codec, pix_fmt)


@pytest.mark.parametrize("name", ["ref.jpg", "ref.png", "ref.webp"])
@pytest.mark.parametrize("keep", ["1000", "half", "all_but_2", "all_but_12"])
def test_load_image_rejects_truncated_files(tmp_path, name, keep):
    """A cut-off JPEG used to decode to half a face over a flat green block, with exit 0."""
    whole = _sample_as(tmp_path, name)
    assert load_image(whole).shape == (256, 256, 3)  # complete: still loads
    data = whole.read_bytes()
    n = {"1000": 1000, "half": len(data) // 2, "all_but_2": len(data) - 2, "all_but_12": len(data) - 12}[keep]
    bad = tmp_path / f"cut_{name}"
    bad.write_bytes(data[:n])
    with pytest.raises(InputError) as info:
        load_image(bad, what="reference")
    msg = str(info.value)
    assert msg.startswith(f"reference: {bad}: truncated or corrupt") and "\n" not in msg
    assert info.value.exit_code == 2


def test_load_image_jpeg_walk_skips_a_thumbnails_end_marker_and_allows_a_trailer(tmp_path):
    """FFD9 inside an EXIF thumbnail is not the image's end; bytes after the real end (phone trailers) are fine."""
    jpg = write_image(tmp_path / "s.jpg", gradient(30, 50), "mjpeg", "yuvj444p")
    data = jpg.read_bytes()
    app1 = b"Exif\x00\x00" + b"\xff\xd8 fake thumbnail \xff\xd9"
    with_thumb = data[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + data[2:]
    ok = tmp_path / "trailer.jpg"
    ok.write_bytes(with_thumb + b"SEFH trailer data")
    assert load_image(ok).shape == (30, 50, 3)
    cut_jpg = tmp_path / "cut.jpg"
    cut_jpg.write_bytes(with_thumb[:-2])  # the thumbnail's FFD9 is still there; the image's own is gone
    with pytest.raises(InputError, match="truncated or corrupt"):
        load_image(cut_jpg)


@pytest.mark.parametrize("h,w,warned", [(1, 1, True), (4, 4, True), (63, 400, True), (64, 64, False),
                                        (256, 256, False)])
def test_small_image_warning(h, w, warned):
    """Under a quarter of the model's side (64 px at 256) the upscaled face is a blur: warn, don't refuse."""
    note = small_image_warning(np.zeros((h, w, 3), np.uint8), "ref.png", native=256)
    if not warned:
        assert note is None
        return
    assert note.startswith("warning: reference: ref.png: ") and f"{w}x{h}" in note and "64 px" in note
    assert "\n" not in note


def test_load_image_unreadable(tmp_path, monkeypatch):
    p = write_image(tmp_path / "locked.png", gradient(4, 4), "png", "rgb24")
    p.chmod(0)
    if os.geteuid() == 0:  # root reads anything: make the permission check see what a user would
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **k: False if Path(path) == p else real_access(path, mode, **k))
    with pytest.raises(InputError, match="permission denied"):
        load_image(p)


def test_save_png_roundtrip_and_deterministic(tmp_path):
    img = np.random.default_rng(0).integers(0, 256, (13, 17, 3), dtype=np.uint8)
    save_png(tmp_path / "a.png", img)
    save_png(tmp_path / "b.png", img)
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    assert np.array_equal(load_image(tmp_path / "a.png"), img)


def test_fit_square_crops_center_and_scales():
    img = np.zeros((40, 100, 3), np.uint8)
    img[:, :30] = (255, 0, 0)  # red bands on both sides, outside the centred 40x40 crop
    img[:, 70:] = (255, 0, 0)
    img[:, 30:70] = (0, 0, 255)
    x = fit_square(img, 16)
    assert x.dtype == torch.float32 and x.shape == (3, 16, 16)
    assert torch.allclose(x[0], torch.tensor(-1.0)) and torch.allclose(x[2], torch.tensor(1.0))
    tall = fit_square(np.full((90, 30, 3), 128, np.uint8), 8)  # portrait: crop the height
    assert tall.shape == (3, 8, 8) and torch.allclose(tall, torch.tensor(128 / 127.5 - 1), atol=1e-6)


def test_fit_square_antialiases():
    stripes = np.zeros((64, 64, 3), np.uint8)
    stripes[:, ::2] = 255  # 1-px stripes: plain bilinear at 1/8 would alias to all-black or all-white
    x = fit_square(stripes, 8)
    assert torch.allclose(x, torch.zeros_like(x), atol=0.05)


def test_fit_image_pil_is_the_official_wan_preprocessing():
    """torchvision Resize(min side) + CenterCrop on a PIL image, ToTensor * 2 - 1 (the official Wan reference path;
    tests/test_wan_e2e_golden.py holds a render's reference equal to the official code's, bit for bit)."""
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    # No resize at the picture's own size: 8-bit values as ToTensor gives them, then * 2 - 1.
    assert torch.equal(fit_image_pil(img, 64, 64), torch.from_numpy(img).permute(2, 0, 1).float().div(255) * 2 - 1.0)
    stripes = np.zeros((80, 96, 3), np.uint8)
    stripes[:, ::2] = 255  # PIL's bilinear filter is antialiased: 1-px stripes average out
    x = fit_image_pil(stripes, 32, 32)
    assert x.shape == (3, 32, 32) and float(x.abs().max()) < 0.1  # unfiltered, they would stay at +-1
    # A 128 x 64 frame of a square picture: the official Resize(64) gives 64 x 64 and its crop pads 32 black columns
    # each side; here the picture is scaled to cover the frame instead.
    grey = np.full((50, 50, 3), 200, np.uint8)
    wide = fit_image_pil(grey, 128, 64)
    assert wide.shape == (3, 64, 128) and torch.allclose(wide, torch.full_like(wide, 200 / 255 * 2 - 1))


# ---------------------------------------------------------------- audio probing

PROBE_CASES = [
    ("a.wav", "wav", "pcm_s16le", 44100, 2),
    ("b.wav", "wav", "pcm_s16le", 11025, 6),
    ("a.mp3", "mp3", "libmp3lame", 44100, 2),
    ("b.mp3", "mp3", "libmp3lame", 16000, 1),
    ("a.flac", "flac", "flac", 48000, 1),
    ("a.ogg", "ogg", "libopus", 48000, 2),
    ("a.opus", "opus", "libopus", 48000, 1),
    ("a.m4a", "ipod", "aac", 22050, 1),
]


@pytest.mark.parametrize("name,fmt,codec,rate,channels", PROBE_CASES)
def test_probe_audio_exact(tmp_path, name, fmt, codec, rate, channels):
    n = round(1.3 * rate)
    path = write_audio(tmp_path / name, fmt, codec, rate, tone(n, rate, channels))
    info = probe_audio(path)
    assert info == AudioInfo(path=str(path), sample_rate=rate, channels=channels, samples=n)
    assert info.duration_s == pytest.approx(1.3, abs=1 / rate)


@pytest.fixture(scope="module")
def long_sources(tmp_path_factory):
    """6-second files of each lossy/lossless kind, for cutting."""
    d = tmp_path_factory.mktemp("src")
    sig = tone(6 * 44100, 44100, 2)
    return {
        "wav": write_audio(d / "s.wav", "wav", "pcm_s16le", 44100, sig),
        "mp3": write_audio(d / "s.mp3", "mp3", "libmp3lame", 44100, sig),
        "flac": write_audio(d / "s.flac", "flac", "flac", 44100, sig),
        "ogg": write_audio(d / "s.ogg", "ogg", "libopus", 48000, tone(6 * 48000, 48000, 2)),
    }


@pytest.mark.parametrize("kind", ["wav", "mp3", "flac", "ogg"])
@pytest.mark.parametrize("frac", [0.5, 0.97])
def test_probe_audio_truncated(tmp_path, long_sources, kind, frac):
    src = long_sources[kind]
    assert probe_audio(src).duration_s == pytest.approx(6.0, abs=1e-3)  # the uncut file is fine
    bad = cut(src, tmp_path / f"cut.{kind}", frac)
    with pytest.raises(InputError) as info:
        probe_audio(bad)
    msg = str(info.value)
    assert msg.startswith(f"audio: {bad}: ") and ("truncated" in msg or "corrupt" in msg) and "\n" not in msg


def test_probe_audio_truncated_m4a(tmp_path):
    src = write_audio(tmp_path / "a.m4a", "ipod", "aac", 44100, tone(3 * 44100, 44100, 1))
    bad = cut(src, tmp_path / "cut.m4a", 0.6)  # the moov atom sits at the end: nothing to open
    with pytest.raises(InputError) as info:
        probe_audio(bad)
    assert str(info.value).startswith(f"audio: {bad}: cannot decode")


def test_probe_audio_corrupt_middle(tmp_path, long_sources):
    data = bytearray(long_sources["mp3"].read_bytes())
    mid = len(data) // 2
    data[mid : mid + 2000] = np.random.default_rng(1).integers(0, 256, 2000, dtype=np.uint8).tobytes()
    bad = tmp_path / "bad.mp3"
    bad.write_bytes(bytes(data))
    with pytest.raises(InputError, match="corrupt"):
        probe_audio(bad)


def test_probe_audio_errors(tmp_path):
    text = tmp_path / "speech.wav"
    text.write_text("not audio at all\n" * 20)
    noise = tmp_path / "noise.mp3"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 20000, dtype=np.uint8).tobytes())
    png = write_image(tmp_path / "a.png", gradient(8, 8), "png", "rgb24")
    empty_wav = write_wav_fast(tmp_path / "empty.wav", np.zeros((1, 0), np.float32), 16000)
    cases = [
        (tmp_path / "missing.wav", "no such file"),
        (tmp_path, "directory"),
        (text, "cannot decode"),
        (noise, "cannot decode"),
        (png, "no audio stream"),
        (empty_wav, "empty"),
    ]
    for path, words in cases:
        with pytest.raises(InputError) as info:
            probe_audio(path, what="speech")
        msg = str(info.value)
        assert msg.startswith(f"speech: {path}: ") and words in msg, msg
        assert info.value.exit_code == 2


# ---------------------------------------------------------------- window reader


def test_window_reader_matches_full_decode(tmp_path):
    rate = 22050
    path = write_audio(tmp_path / "a.mp3", "mp3", "libmp3lame", rate, tone(round(1.5 * rate), rate, 1))
    ref = decode_mono_direct(path, 16000)
    with AudioWindowReader(path, 16000) as r:
        assert r.total == round(probe_audio(path).samples * 16000 / rate) == 24000
        head = r.read(-500, 4000)  # hangs off the start
        assert head.dtype == np.float32 and head.shape == (4500,)
        assert not head[:500].any() and np.array_equal(head[500:], ref[:4000])
        assert np.array_equal(r.read(3000, 9000), ref[3000:9000])  # overlaps the previous window
        assert np.array_equal(r.read(12000, 16000), ref[12000:16000])
        assert np.array_equal(r.read(8000, 13000), ref[8000:13000])  # steps back
        tail = r.read(r.total - 1000, r.total + 700)  # hangs off the end
        assert np.array_equal(tail[:1000], ref[r.total - 1000 : r.total]) and not tail[1000:].any()
        assert np.abs(tail[:1000]).max() > 0.1
        assert not r.read(r.total + 5, r.total + 50).any()
        assert r.read(-300, -100).shape == (200,) and not r.read(-300, -100).any()


def test_window_reader_stereo_is_channel_mean(tmp_path):
    rate = 16000
    sig = tone(rate, rate, 2, freq=200.0, amp=0.4)  # L = 0.4 sin, R = 0.2 sin -> mean 0.3 sin
    path = write_wav_fast(tmp_path / "st.wav", sig, rate)
    with AudioWindowReader(path, 16000) as r:
        x = r.read(0, r.total)
    expected = 0.3 * np.sin(2 * np.pi * 200 * np.arange(rate) / rate)
    assert np.abs(x - expected).max() < 2e-3


def test_window_reader_release_and_errors(tmp_path):
    path = write_wav_fast(tmp_path / "a.wav", tone(16000, 16000, 1), 16000)
    with AudioWindowReader(path, 16000) as r:
        r.read(0, 4000)
        r.release(10000)  # beyond what was decoded: the reader must skip ahead correctly
        assert r.buffered_samples == 0
        direct = decode_mono_direct(path, 16000)
        assert np.array_equal(r.read(10000, 12000), direct[10000:12000])
        with pytest.raises(ValueError, match="released"):
            r.read(9000, 11000)
    with pytest.raises(InputError, match="no such file"):
        AudioWindowReader(tmp_path / "missing.wav")


def test_window_reader_memory_stays_bounded_on_long_file(tmp_path):
    rate, minutes = 8000, 10
    n = rate * 60 * minutes
    path = write_wav_fast(tmp_path / "long.wav", tone(n, rate, 1, freq=250.0), rate)
    with AudioWindowReader(path, 16000) as r:
        assert r.total == 2 * n
        window, hop, peak = 16000 * 2, 16000, 0
        for start in range(-16000, r.total, hop):
            x = r.read(start - 8000, start + window)  # overlaps the previous window by 1.5 s
            r.release(start - 8000)
            peak = max(peak, r.buffered_samples)
        assert peak < 16000 * 5  # a few seconds, never the file (9.6 M samples)
        t = np.arange(r.total - 100, r.total - 20) / 16000  # the last few samples carry the filter's edge
        np.testing.assert_allclose(r.read(r.total - 100, r.total - 20), 0.3 * np.sin(2 * np.pi * 250 * t), atol=5e-3)
        assert x.shape == (window + 8000,)
    # Without release() the history limit keeps it bounded too.
    with AudioWindowReader(path, 16000, history_s=3.0) as r:
        for start in range(0, 16000 * 120, 16000):
            r.read(start, start + 16000)
        assert r.buffered_samples <= 16000 * 5


def test_iter_audio_chunks_layouts(tmp_path):
    path = write_wav_fast(tmp_path / "six.wav", tone(8000, 8000, 6), 8000)
    chunks = list(iter_audio_chunks(path, 16000, "stereo"))
    assert all(c.dtype == np.float32 and c.shape[0] == 2 for c in chunks)
    assert sum(c.shape[1] for c in chunks) == 16000


# ---------------------------------------------------------------- writer helpers


def probe_mp4(path: Path) -> dict:
    """Everything the writer tests check, read back with PyAV."""
    out: dict = {}
    with av.open(str(path)) as c:
        v = c.streams.video[0]
        out.update(vcodec=v.codec_context.name, pix_fmt=v.codec_context.pix_fmt, vrate=v.average_rate,
                   vstart=float(v.start_time * v.time_base), vdur=float(v.duration * v.time_base),
                   cdur=c.duration / av.time_base)
        if c.streams.audio:
            a = c.streams.audio[0]
            out.update(acodec=a.codec_context.name, arate=a.rate, achannels=a.channels,
                       astart=float(a.start_time * a.time_base), adur=float(a.duration * a.time_base))
    keys, types, pts = [], set(), []
    with av.open(str(path)) as c:
        for i, fr in enumerate(c.decode(video=0)):
            if fr.key_frame:
                keys.append(i)
            types.add({1: "I", 2: "P", 3: "B"}.get(int(fr.pict_type), str(fr.pict_type)))
            pts.append(fr.pts)
    out.update(frames=len(pts), keyframes=keys, pict_types=types, pts=pts)
    return out


def decode_audio(path: Path) -> tuple[np.ndarray, int]:
    """(C, n) float32 of the first audio track, from t = 0."""
    with av.open(str(path)) as c:
        frames = list(c.decode(audio=0))
    return np.concatenate([f.to_ndarray() for f in frames], axis=1), frames[0].sample_rate


def frames_rgb(n: int, h: int = 64, w: int = 64) -> np.ndarray:
    base = gradient(h, w)
    return np.stack([np.roll(base, 3 * i, axis=1) for i in range(n)])  # (T, H, W, 3)


# ---------------------------------------------------------------- writer


def test_writer_produces_spec_file(tmp_path):
    audio = write_wav_fast(tmp_path / "a.wav", tone(3 * 16000, 16000, 1), 16000)  # longer: trimmed
    out = tmp_path / "o.mp4"
    w = Mp4Writer(out, width=64, height=64, fps=25, total_frames=55, audio_path=str(audio))
    w.put(frames_rgb(30))
    for f in frames_rgb(25):
        w.put(f)  # single (H, W, 3) frames too
    stats = w.close()
    assert stats.frames == 55 == w.frames_written and stats.bytes == out.stat().st_size and stats.encode_s > 0
    p = probe_mp4(out)
    assert p["frames"] == 55 and p["vcodec"] == "h264" and p["pix_fmt"] == "yuv420p"
    assert p["keyframes"] == [0, 25, 50]  # one per second, no scene-cut extras
    assert p["pict_types"] <= {"I", "P"}  # no B-frames
    assert p["pts"] == sorted(p["pts"])  # presentation order = decode order
    assert p["vstart"] == 0 and p["astart"] == 0
    assert p["acodec"] == "aac" and p["arate"] == 16000 and p["achannels"] == 1
    assert abs(p["vdur"] - p["adur"]) <= 1 / 25
    assert p["vdur"] == pytest.approx(2.2, abs=1 / 25) and p["cdur"] == pytest.approx(2.2, abs=1 / 25)


def test_writer_audio_is_in_sync(tmp_path):
    rate = 16000
    sig = np.zeros((1, 2 * rate), np.float32)
    sig[0, rate : rate + 16] = 0.9  # a click at exactly 1.0 s
    audio = write_wav_fast(tmp_path / "click.wav", sig, rate)
    out = tmp_path / "o.mp4"
    w = Mp4Writer(out, width=64, height=64, fps=25, total_frames=75, audio_path=str(audio))  # 3 s > 2 s audio
    w.put(frames_rgb(75))
    w.close()
    x, got_rate = decode_audio(out)
    assert got_rate == rate
    assert abs(np.argmax(np.abs(x[0])) - rate) <= 16  # within 1 ms: the AAC priming is compensated
    p = probe_mp4(out)
    assert abs(p["adur"] - 3.0) <= 1 / 25 and abs(p["vdur"] - p["adur"]) <= 1 / 25  # padded with silence
    assert np.abs(x[0, int(2.2 * rate) :]).max() < 0.01


def test_writer_non_integer_fps_and_stereo(tmp_path):
    audio = write_audio(tmp_path / "a.mp3", "mp3", "libmp3lame", 44100, tone(3 * 44100, 44100, 2))
    out = tmp_path / "o.mp4"
    with Mp4Writer(out, width=48, height=32, fps=29.97, total_frames=66, audio_path=str(audio)) as w:
        w.put(frames_rgb(66, 32, 48))
    p = probe_mp4(out)
    assert p["frames"] == 66 and p["vrate"] == Fraction(30000, 1001)
    assert p["keyframes"] == [0, 30, 60] and p["achannels"] == 2 and p["arate"] == 44100
    assert p["vdur"] == pytest.approx(66 * 1001 / 30000, abs=1e-3)
    assert abs(p["vdur"] - p["adur"]) <= 1 / 29.97


def test_writer_multichannel_and_odd_rate(tmp_path):
    six = write_wav_fast(tmp_path / "six.wav", tone(8000, 8000, 6), 8000)
    odd = write_wav_fast(tmp_path / "odd.wav", tone(7000, 7000, 1), 7000)
    for audio, rate, channels in [(six, 8000, 2), (odd, 48000, 1)]:
        out = tmp_path / f"{audio.stem}.mp4"
        with Mp4Writer(out, width=32, height=32, fps=25, total_frames=20, audio_path=str(audio)) as w:
            w.put(frames_rgb(20, 32, 32))
        p = probe_mp4(out)
        assert (p["arate"], p["achannels"]) == (rate, channels)
        assert abs(p["adur"] - 0.8) <= 1 / 25


def test_writer_video_only_and_colours(tmp_path):
    out = tmp_path / "o.mp4"
    colour = np.empty((10, 64, 64, 3), np.uint8)
    colour[:] = (200, 60, 30)  # saturated: a BT.601/709 mix-up shifts it by ~10 levels
    with Mp4Writer(out, width=64, height=64, fps=25, total_frames=10, audio_path=None) as w:
        w.put(colour)
    with av.open(str(out)) as c:
        assert not c.streams.audio
        frame = next(c.decode(video=0))
        rgb = frame.to_ndarray(format="rgb24")
    assert np.abs(rgb.astype(int) - (200, 60, 30)).max() <= 4


def test_writer_copies_frames_on_put(tmp_path):
    out = tmp_path / "o.mp4"
    buf = np.zeros((64, 64, 3), np.uint8)
    w = Mp4Writer(out, width=64, height=64, fps=25, total_frames=1, audio_path=None)
    w.put(buf)
    buf[:] = 255  # the caller reuses its buffer right away
    w.close()
    with av.open(str(out)) as c:
        assert next(c.decode(video=0)).to_ndarray(format="rgb24").mean() < 20


def test_writer_fewer_frames_than_total(tmp_path):
    audio = write_wav_fast(tmp_path / "a.wav", tone(3 * 16000, 16000, 1), 16000)
    out = tmp_path / "o.mp4"
    w = Mp4Writer(out, width=32, height=32, fps=25, total_frames=75, audio_path=str(audio))
    w.put(frames_rgb(20, 32, 32))
    assert w.close().frames == 20
    p = probe_mp4(out)
    assert p["frames"] == 20 and abs(p["adur"] - 0.8) <= 1 / 25 and abs(p["vdur"] - 0.8) <= 1 / 25


def _wait_written(w: Mp4Writer, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while w.frames_written < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.frames_written >= n


def test_writer_copy_mid_write_decodes(tmp_path):
    audio = write_wav_fast(tmp_path / "a.wav", tone(8 * 16000, 16000, 1), 16000)
    out = tmp_path / "o.mp4"
    w = Mp4Writer(out, width=64, height=64, fps=25, total_frames=200, audio_path=str(audio))
    w.put(frames_rgb(80))
    _wait_written(w, 80)
    time.sleep(0.1)
    copy = shutil.copy(out, tmp_path / "copy.mp4")
    w.put(frames_rgb(20))
    w.close()
    with av.open(str(copy)) as c:
        n = sum(1 for _ in c.decode(video=0))
    assert 0 < n <= 80


def test_writer_abort_leaves_playable_file(tmp_path):
    audio = write_wav_fast(tmp_path / "a.wav", tone(8 * 16000, 16000, 1), 16000)
    out = tmp_path / "o.mp4"
    w = Mp4Writer(out, width=64, height=64, fps=25, total_frames=200, audio_path=str(audio))
    w.put(frames_rgb(40))
    _wait_written(w, 40)
    stats = w.abort()
    assert stats.frames == 40
    p = probe_mp4(out)
    assert p["frames"] == 40 and abs(p["vdur"] - p["adur"]) <= 1 / 25
    with pytest.raises(RenderError, match="closed"):
        w.put(frames_rgb(1))


def test_writer_thread_error_propagates(tmp_path, monkeypatch):
    out = tmp_path / "o.mp4"
    w = Mp4Writer(out, width=32, height=32, fps=25, total_frames=100, audio_path=None, queue_frames=2)

    def boom(rgb):
        raise RuntimeError("encoder exploded")

    monkeypatch.setattr(w, "_encode_frame", boom)
    with pytest.raises(RenderError, match="encoder exploded"):
        for f in frames_rgb(100, 32, 32):
            w.put(f)  # must not hang on the full queue
    with pytest.raises(RenderError, match="encoder exploded"):
        w.close()
    assert not w._thread.is_alive() and out.exists()


def test_writer_rejects_bad_arguments(tmp_path):
    with pytest.raises(RenderError, match="even"):
        Mp4Writer(tmp_path / "o.mp4", width=63, height=64, fps=25, total_frames=1, audio_path=None)
    with pytest.raises(InputError, match="output"):
        Mp4Writer(tmp_path / "no" / "dir" / "o.mp4", width=64, height=64, fps=25, total_frames=1, audio_path=None)
    w = Mp4Writer(tmp_path / "o.mp4", width=64, height=64, fps=25, total_frames=2, audio_path=None)
    with pytest.raises(ValueError):
        w.put(np.zeros((32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="total_frames"):
        w.put(frames_rgb(3))
    w.close()


def test_writer_bad_audio_is_input_error(tmp_path):
    text = tmp_path / "a.wav"
    text.write_text("nope")
    for audio in (tmp_path / "missing.wav", text):
        with pytest.raises(InputError, match=f"audio: {audio}: "):
            Mp4Writer(tmp_path / "o.mp4", width=32, height=32, fps=25, total_frames=1, audio_path=str(audio))


def test_resolve_codec():
    assert resolve_codec("libx264", "cpu") == "libx264"
    assert resolve_codec("auto", "cpu") == "libx264"
    nvenc_problem = writer_mod._nvenc_works()
    assert resolve_codec("auto", "cuda:0") == ("libx264" if nvenc_problem else "h264_nvenc")
    if nvenc_problem:
        with pytest.raises(RenderError, match="h264_nvenc"):
            resolve_codec("h264_nvenc", "cuda")
    with pytest.raises(RenderError, match="unknown"):
        resolve_codec("vp9", "cpu")


def test_aac_priming_constant_matches_encoder():
    """The writer's sync fix assumes FFmpeg's AAC encoder delays by AAC_PRIMING samples."""
    ctx = av.CodecContext.create("aac", "w")
    ctx.sample_rate, ctx.layout, ctx.format = 16000, "mono", "fltp"
    ctx.time_base = Fraction(1, 16000)
    ctx.open()
    f = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
    f.sample_rate, f.pts, f.time_base = 16000, 0, Fraction(1, 16000)
    packets = list(ctx.encode(f)) + list(ctx.encode(None))
    assert packets[0].pts == -AAC_PRIMING


def test_window_reader_jump_ahead_stays_bounded(tmp_path):
    rate = 8000
    path = write_wav_fast(tmp_path / "a.wav", tone(rate * 60, rate, 1, freq=250.0), rate)
    with AudioWindowReader(path, 16000, history_s=2.0) as r:
        r.read(0, 1000)
        x = r.read(16000 * 50, 16000 * 51)  # 50 s ahead, no release in between
        assert r.buffered_samples <= 16000 * 3 + 4096  # history + window + one decoded chunk
        t = np.arange(16000 * 50, 16000 * 51) / 16000
        np.testing.assert_allclose(x, 0.3 * np.sin(2 * np.pi * 250 * t), atol=5e-3)
