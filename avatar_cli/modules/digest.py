"""Cheap content digests of weights files and folders (the text cache's key names the encoder by them).

`file_digest` reads a few hundred KB however big the file: its size, its header (safetensors: every tensor's
name, dtype, shape and offsets), its last 64 KiB (a torch .pth is a zip whose central directory there holds each
tensor's CRC-32) and 16 slices of 4 KiB spread over the file. A weights change that leaves all of those bytes
alone would go unseen; retraining or fine-tuning changes them. Copies of a model on several hosts digest alike.
"""

import hashlib
from pathlib import Path

from avatar_cli.modules.tensor_files import header_length

SAMPLES, SAMPLE_BYTES, TAIL_BYTES = 16, 4096, 64 << 10
MAX_HEADER = 1 << 24  # as pipeline/fingerprint.py: a safetensors header is at most this much of the digest

_file_digests: dict[tuple, str] = {}


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_digest(path: Path) -> str:
    """A cheap content digest of a weights file (see the module docstring). Remembered per (path, size, mtime)
    for the life of the process."""
    st = path.stat()
    memo = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if memo in _file_digests:
        return _file_digests[memo]
    h = hashlib.sha256(f"{st.st_size}".encode())
    with open(path, "rb") as f:
        head = f.read(8)
        h.update(head)
        if path.suffix == ".safetensors" and len(head) == 8:
            h.update(f.read(min(header_length(head), MAX_HEADER)))
        else:
            h.update(f.read(TAIL_BYTES))
        for i in range(SAMPLES):
            f.seek(st.st_size * i // SAMPLES)
            h.update(f.read(SAMPLE_BYTES))
        f.seek(max(0, st.st_size - TAIL_BYTES))
        h.update(f.read(TAIL_BYTES))
    _file_digests[memo] = h.hexdigest()
    return _file_digests[memo]


def folder_digest(folder: Path) -> str:
    """Every file under `folder`, whole (tokenizers are a few MB): names and contents."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()
