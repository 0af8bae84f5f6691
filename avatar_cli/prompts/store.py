"""The text cache's folder of entries (`runtime.text_cache`): `<folder>/<key>.safetensors`.

Where: auto ($XDG_CACHE_HOME/avatar/text, else ~/.cache/avatar/text), off, or a folder (e.g. on a shared file
system; relative to the job file's folder).
Writers on several hosts are safe: each writes a temp file of its own (host, pid, random) in the same folder,
fsyncs it and renames it over the entry (atomic on POSIX file systems, NFS included); the last one wins, and
every one of them wrote the same encoding.
"""

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from avatar_cli.errors import InputError
from avatar_cli.files import atomic_write
from avatar_cli.prompts.entry import EntryKey, entry_bytes, verify

AUTO, OFF = "auto", "off"


def default_folder() -> Path:
    """$XDG_CACHE_HOME/avatar/text, else ~/.cache/avatar/text (a relative XDG_CACHE_HOME is ignored, as the
    XDG spec says)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".cache"
    return root / "avatar" / "text"


def cache_folder(setting: str, base_dir: Path) -> Path | None:
    """The job's `runtime.text_cache` -> its folder, or None when off. A relative folder is relative to the job
    file's folder, as the job's other paths are."""
    if not setting.strip():
        raise InputError("runtime.text_cache is empty: give auto, off or a folder")
    # YAML reads an unquoted off/no/false as a boolean, and the spec's string field then holds "False" (and
    # "True" for on/yes/true): both mean what the user wrote.
    if setting in (OFF, "False"):
        return None
    if setting in (AUTO, "True"):
        return default_folder()
    return base_dir / Path(setting).expanduser()


class TextCache:
    """The folder of entries. Reads verify, writes are atomic; neither ever raises on a bad entry."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def path(self, key: EntryKey) -> Path:
        return self.folder / f"{key.digest}.safetensors"

    def read(self, key: EntryKey) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """(tensors, None) for a valid entry; (None, None) when there is none; (None, why) when the entry there
        cannot be used (it is then encoded again and rewritten)."""
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None, None
        except OSError as e:
            return None, f"cannot read it ({e.strerror})"
        return verify(blob, key)

    def write(self, key: EntryKey, tensors: Mapping[str, torch.Tensor], device: str) -> Path:
        """Write the entry atomically; OSError if the folder cannot take it."""
        blob = entry_bytes(key, tensors, device)
        self.folder.mkdir(parents=True, exist_ok=True)
        return atomic_write(self.path(key), blob, unique=True, sync_folder=True)
