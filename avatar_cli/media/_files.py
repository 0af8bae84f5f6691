"""Shared input checks so every media error reads `"{what}: {path}: problem"` on one line."""

from __future__ import annotations

import os
from pathlib import Path

from avatar_cli.errors import InputError


def input_error(what: str, path: str | Path, problem: str) -> InputError:
    """The one-line error for an unusable input file."""
    return InputError(f"{what}: {path}: {problem}")


def reason(exc: BaseException) -> str:
    """A short, single-line reason from a PyAV/OS error (strerror without the errno noise)."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())


def check_readable(path: str | Path, what: str) -> None:
    """Fail early with a clear message for the file-system problems PyAV reports as bare errnos."""
    p = Path(path)
    if not p.exists():
        raise input_error(what, path, "no such file")
    if p.is_dir():
        raise input_error(what, path, "is a directory, not a file")
    if not os.access(p, os.R_OK):
        raise input_error(what, path, "permission denied")
    if p.stat().st_size == 0:
        raise input_error(what, path, "file is empty (0 bytes)")
