"""Reference-image I/O: decode with PyAV, write PNG by hand, fit to the model's frame.

Pillow is used in one place, `fit_image_pil`: the Wan reference path, whose official code resizes with PIL and
rounds to 8 bits, which no float resize reproduces exactly."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F

from avatar_cli.errors import InputError
from avatar_cli.media._exif import apply_orientation, jpeg_orientation
from avatar_cli.media._files import check_readable, input_error, reason

__all__ = ["load_image", "save_png", "fit_square", "fit_image", "fit_image_pil", "small_image_warning"]

# FFmpeg's JPEG decoder hands back a frame for a cut-off file (the missing rows flat green) with no error,
# and a cut PNG fails as generic "invalid data" or not at all (IEND lost), so completeness is checked on
# the file's own structure instead.
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# In entropy-coded JPEG data 0xFF is followed by 0x00 (stuffing), a restart marker D0-D7 or more 0xFF
# fill; anything else is the next marker.
_JPEG_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def _jpeg_problem(data: bytes) -> str | None:
    """Walk the JPEG's segments to its end-of-image marker (FFD9); what is wrong, or None when complete.

    Walking (rather than looking for FFD9 near the end) skips an EXIF thumbnail's own FFD9 inside APP1,
    and tolerates data appended after the image (some phones add a trailer).
    """
    pos, n = 2, len(data)
    while pos < n:
        if data[pos] != 0xFF:  # stray bytes between segments (libjpeg skips them too): go to the next marker
            m = _JPEG_NEXT_MARKER.search(data, pos)
            if m is None:
                break
            pos = m.start()
            continue
        if pos + 1 >= n:
            break
        marker = data[pos + 1]
        if marker == 0xD9:
            return None
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if 0xD0 <= marker <= 0xD7 or marker in (0x01, 0xD8):  # standalone markers, no length
            pos += 2
            continue
        if pos + 4 > n:
            break
        end = pos + 2 + struct.unpack(">H", data[pos + 2 : pos + 4])[0]
        if end > n:
            break
        pos = end
        if marker == 0xDA:  # start of scan: entropy-coded data runs to the next real marker
            m = _JPEG_NEXT_MARKER.search(data, pos)
            if m is None:
                break
            pos = m.start()
    return f"the JPEG data ends before its end-of-image marker (file is {n} bytes)"


def _png_problem(data: bytes) -> str | None:
    """Walk the PNG's chunks to IEND; what is wrong, or None when complete."""
    pos, n = len(_PNG_SIGNATURE), len(data)
    while pos + 8 <= n:
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        end = pos + 12 + length  # length, type, data, CRC
        if end > n:
            name = kind.decode("latin-1")
            return f"the PNG data ends inside its {name} chunk, {end - n} bytes short (file is {n} bytes)"
        if kind == b"IEND":
            return None
        pos = end
    return f"the PNG data ends before its IEND chunk (file is {n} bytes)"


def _webp_problem(data: bytes) -> str | None:
    """A WebP is one RIFF chunk whose header gives its size."""
    need = 8 + struct.unpack("<I", data[4:8])[0]
    return None if len(data) >= need else f"the WebP header says {need} bytes, the file has {len(data)}"


def _truncation(path: str | Path) -> str | None:
    """Why a JPEG/PNG/WebP file is cut short or broken, or None; other formats are left to the decoder."""
    with open(path, "rb") as f:
        head = f.read(12)
        check = (_jpeg_problem if head[:3] == b"\xff\xd8\xff" else _png_problem if head[:8] == _PNG_SIGNATURE
                 else _webp_problem if len(head) == 12 and head[:4] == b"RIFF" and head[8:12] == b"WEBP" else None)
        # Only a file that says it is one of these is read whole (a video given by mistake is not).
        return None if check is None else check(head + f.read())


def _to_rgb(frame: av.VideoFrame) -> np.ndarray:
    """Frame -> uint8 (H, W, 3) RGB; formats with alpha are composited on white.

    Compositing (instead of dropping alpha) matters for cut-out portraits: the RGB under a
    transparent area is often black or garbage, and white is what viewers saw in an editor.
    """
    fmt = frame.format
    # 2 components = gray+alpha, 4 = colour+alpha; palettes may carry alpha (PNG tRNS).
    if len(fmt.components) in (2, 4) or fmt.has_palette:
        rgba = frame.to_ndarray(format="rgba").astype(np.float32)  # (H, W, 4)
        alpha = rgba[..., 3:4] / 255.0  # (H, W, 1)
        rgb = rgba[..., :3] * alpha + 255.0 * (1.0 - alpha)  # (H, W, 3)
        return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(frame.to_ndarray(format="rgb24"))  # (H, W, 3)


def load_image(path: str | Path, what: str = "reference") -> np.ndarray:
    """Decode the first video frame of `path` (png, jpg, webp, ...) as uint8 (H, W, 3) RGB.

    Alpha is composited on white; JPEG EXIF orientation is applied.

    Raises InputError with one line `"{what}: {path}: problem"` for anything unusable.
    """
    check_readable(path, what)
    try:
        problem = _truncation(path)
    except PermissionError:
        raise input_error(what, path, "permission denied") from None
    except OSError as exc:
        raise input_error(what, path, f"cannot read ({reason(exc)})") from None
    if problem is not None:
        raise input_error(what, path, f"truncated or corrupt: {problem}")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise input_error(what, path, "not an image (no picture found in the file)")
            stream = container.streams.video[0]
            frame = next(container.decode(stream), None)
            if frame is None:
                raise input_error(what, path, "not an image (no picture could be decoded)")
            if frame.width <= 0 or frame.height <= 0:
                raise input_error(what, path, f"image has zero size ({frame.width}x{frame.height})")
            rgb = _to_rgb(frame)  # (H, W, 3) as stored
            is_jpeg = stream.codec_context.name == "mjpeg"
    except InputError:
        raise
    except PermissionError:
        raise input_error(what, path, "permission denied") from None
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise input_error(what, path, f"cannot decode as an image ({reason(exc)})") from None
    # Phone photos: upright as the user saw them, not as the sensor stored them.
    return apply_orientation(rgb, jpeg_orientation(path)) if is_jpeg else rgb


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data, CRC over type+data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def save_png(path: str | Path, img: np.ndarray) -> None:
    """Write uint8 (H, W, 3) RGB as an 8-bit RGB PNG.

    Hand-rolled (zlib + struct) so the bytes depend only on the pixels and zlib's level:
    no encoder version or metadata ends up in the file, which keeps outputs comparable.
    """
    arr = np.asarray(img)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"save_png wants uint8 (H, W, 3), got {arr.dtype} {arr.shape}")
    h, w, _ = arr.shape
    if h == 0 or w == 0:
        raise ValueError(f"save_png: image has zero size ({w}x{h})")
    rows = np.ascontiguousarray(arr).reshape(h, w * 3)  # (H, W*3)
    # Filter type 0 (None) on every row: a leading zero byte per scanline.
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rows], axis=1)  # (H, 1 + W*3)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit, colour type 2 (RGB)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
        + _png_chunk(b"IEND", b"")
    )
    Path(path).write_bytes(data)


def fit_square(img: np.ndarray, size: int) -> torch.Tensor:
    """Center-crop the longer side to a square, then antialiased-resize to float32 (3, size, size) in [-1, 1]."""
    arr = np.asarray(img)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"fit_square wants (H, W, 3), got {arr.shape}")
    h, w, _ = arr.shape
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    crop = arr[top : top + side, left : left + side]  # (S, S, 3)
    x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1)[None].float()  # (1, 3, S, S)
    if side != size:
        # antialias=True matters when shrinking a photo: plain bilinear aliases fine texture (hair).
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    x = (x / 127.5 - 1.0).clamp_(-1.0, 1.0)  # (1, 3, size, size)
    return x[0].contiguous()


def fit_image(img: np.ndarray, width: int, height: int) -> torch.Tensor:
    """Center-crop to the target's aspect ratio, then antialiased-resize to float32 (3, height, width) in [-1, 1].
    A square target is exactly fit_square (the official Wan code instead resizes the shorter side and
    center-crops, which pads with black when its 64-pixel rounding widens the frame; this never pads)."""
    if width == height:
        return fit_square(img, width)
    arr = np.asarray(img)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"fit_image wants (H, W, 3), got {arr.shape}")
    h, w, _ = arr.shape
    ch, cw = (h, round(h * width / height)) if w * height > h * width else (round(w * height / width), w)
    ch, cw = max(1, min(h, ch)), max(1, min(w, cw))
    top, left = (h - ch) // 2, (w - cw) // 2
    crop = arr[top:top + ch, left:left + cw]  # (ch, cw, 3)
    x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1)[None].float()  # (1, 3, ch, cw)
    if (ch, cw) != (height, width):
        x = F.interpolate(x, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    x = (x / 127.5 - 1.0).clamp_(-1.0, 1.0)  # (1, 3, height, width)
    return x[0].contiguous()


def _resized_size(h: int, w: int, short_side: int) -> tuple[int, int]:
    """torchvision's Resize(short_side) output size (its _compute_resized_output_size): the shorter side to
    short_side, the longer one scaled and truncated. -> (height, width)"""
    if w <= h:
        return int(short_side * h / w), short_side
    return short_side, int(short_side * w / h)


def fit_image_pil(img: np.ndarray, width: int, height: int) -> torch.Tensor:
    """The official Wan reference preprocessing, to the bit: torchvision `Resize(min(height, width))` and
    `CenterCrop((height, width))` on a PIL image, then `ToTensor() * 2 - 1` (wan/speech2video.py). The shorter side
    is scaled with PIL's antialiased bilinear filter, rounded to 8 bits, then the centre cropped ->
    float32 (3, height, width) in [-1, 1].

    One departure: where the official crop is larger than the resized image (its 64-pixel size rounding can make the
    frame's aspect wider than the picture's), it pads with black; here the shorter side is scaled up just enough to
    cover the frame instead, so nothing is padded. Whenever the official code does not pad, the result is its own."""
    from PIL import Image  # start-up: only the wan-s2v reference crop uses PIL

    arr = np.ascontiguousarray(np.asarray(img))
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
        raise ValueError(f"fit_image_pil wants uint8 (H, W, 3), got {arr.dtype} {arr.shape}")
    h, w, _ = arr.shape
    side = min(height, width)
    nh, nw = _resized_size(h, w, side)
    while nh < height or nw < width:  # only where the official crop would pad
        side += 1
        nh, nw = _resized_size(h, w, side)
    pic = Image.fromarray(arr)
    if (nh, nw) != (h, w):
        pic = pic.resize((nw, nh), Image.BILINEAR)
    top, left = int(round((nh - height) / 2.0)), int(round((nw - width) / 2.0))
    pic = pic.crop((left, top, left + width, top + height))
    x = torch.from_numpy(np.array(pic, dtype=np.uint8)).permute(2, 0, 1).contiguous()  # (3, height, width) uint8
    return (x.float().div(255) * 2 - 1.0).contiguous()  # ToTensor, then the official * 2 - 1


def small_image_warning(img: np.ndarray, path: str | Path, native: int, what: str = "reference") -> str | None:
    """A one-line warning when the image's shorter side is under a quarter of the model's native size.

    fit_square upscales the reference to native x native; beyond 4x (under 64 px for the 256 px model)
    an eye or the mouth is a few pixels wide and the face renders as a blur. Smaller images still
    render, so this is a warning for the caller to report, not an error.
    """
    h, w = np.asarray(img).shape[:2]
    least = max(1, native // 4)
    if min(h, w) >= least:
        return None
    return (f"warning: {what}: {path}: only {w}x{h} px; the model works at {native}x{native}, so the face is "
            f"upscaled {native / min(h, w):.3g}x and will look blurred (use at least {least} px on the shorter side)")
