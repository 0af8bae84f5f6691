"""EXIF orientation for JPEG references.

Phone cameras store portrait photos sideways plus an EXIF "Orientation" tag. FFmpeg decodes
the stored pixels and only exports the tag as frame side data, and PyAV 18 cannot read that
side data (FFmpeg 8's EXIF entry is not in its enum; `frame.side_data` raises, and
`frame.rotation` reports mirrored orientations as rotations). So we read the tag ourselves.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

# Orientation -> how to turn the stored pixels into what a viewer shows (PIL's exif_transpose).
_FIX = {
    2: lambda a: a[:, ::-1],  # mirrored left-right
    3: lambda a: a[::-1, ::-1],  # upside down
    4: lambda a: a[::-1],  # mirrored top-bottom
    5: lambda a: a.transpose(1, 0, 2),  # transpose
    6: lambda a: np.rot90(a, k=-1),  # stored 90 deg counter-clockwise: turn clockwise
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),  # transverse
    8: lambda a: np.rot90(a, k=1),  # stored 90 deg clockwise: turn counter-clockwise
}


def jpeg_orientation(path: str | Path) -> int:
    """The EXIF Orientation (1..8) of a JPEG file; 1 when absent, unreadable, or not a JPEG."""
    try:
        with open(path, "rb") as f:
            if f.read(2) != b"\xff\xd8":
                return 1
            while True:
                marker = f.read(2)
                if len(marker) < 2 or marker[0] != 0xFF or marker[1] in (0xDA, 0xD9):
                    return 1  # start of scan / end of image: the APP segments are over
                size = struct.unpack(">H", f.read(2))[0]
                body = f.read(size - 2)
                if marker[1] == 0xE1 and body[:6] == b"Exif\x00\x00":
                    return _tiff_orientation(body[6:])
    except (OSError, struct.error, IndexError):
        return 1


def _tiff_orientation(tiff: bytes) -> int:
    endian = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if endian is None:
        return 1
    (ifd,) = struct.unpack(endian + "I", tiff[4:8])
    (count,) = struct.unpack(endian + "H", tiff[ifd : ifd + 2])
    for i in range(count):
        entry = tiff[ifd + 2 + 12 * i : ifd + 14 + 12 * i]
        tag, kind = struct.unpack(endian + "HH", entry[:4])
        if tag == 0x0112 and kind == 3:  # Orientation, SHORT
            (value,) = struct.unpack(endian + "H", entry[8:10])
            return value if 1 <= value <= 8 else 1
    return 1


def apply_orientation(img: np.ndarray, orientation: int) -> np.ndarray:
    """Turn stored pixels (H, W, C) upright; contiguous copy when anything changed."""
    fix = _FIX.get(orientation)
    return img if fix is None else np.ascontiguousarray(fix(img))
