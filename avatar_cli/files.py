"""Files replaced whole or not at all: write beside the target, then rename over it.

A rename within one folder is atomic on POSIX file systems (NFS included): a reader sees the old file or the new
one, never a torn one, and a crash or Ctrl-C mid-write leaves the old file as it was. Imports nothing of the project.
"""

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_beside(path: Path, unique: bool = False) -> Path:
    """Where to write `path`'s next version: `<name>.tmp` beside it; unique: a name of this host, process and a
    random part, for folders several writers share (each writes its own temp file; the last rename wins)."""
    if unique:
        return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    return path.with_name(path.name + ".tmp")


@contextmanager
def atomic_path(path: Path, unique: bool = False) -> Iterator[Path]:
    """A temp path beside `path` for a writer that takes a path; renamed over `path` when the block ends, removed
    when it raises."""
    path = Path(path)
    tmp = temp_beside(path, unique)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: Path, data: bytes, unique: bool = False, sync_folder: bool = False) -> Path:
    """Write `data` to `path` atomically, synced to disk before the rename. sync_folder: sync the folder too, so
    the rename itself survives a crash (where the file system allows it)."""
    path = Path(path)
    with atomic_path(path, unique) as tmp:
        with open(tmp, "xb" if unique else "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    if sync_folder:
        try:
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass  # some file systems refuse to fsync a folder; the file is written either way
    return path
