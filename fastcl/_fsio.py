"""Crash-safe file writes and up-front output-path checks, shared by the CLIs and trainers.

A write is *atomic*: the bytes go to a temporary file in the destination's folder, are
flushed and fsync'ed, the file replaces the destination with ``os.replace`` (atomic on
POSIX within one file system) and the folder is fsync'ed so that the rename itself
survives a power loss. A reader therefore sees the old file or the whole new one, never
a prefix.

The path checks run before any compute, so that a typo costs a one-line error rather than
an hour of training or evaluation.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = [
    "atomic_write",
    "atomic_write_text",
    "check_output_dir",
    "check_output_file",
    "file_digest",
    "check_model_path",
    "fsync_dir",
    "looks_like_path",
]


def fsync_dir(folder: Path) -> None:
    """Make a rename or unlink in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file object that hashes and counts the bytes on their way to ``f``."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> dict:
    """Write ``path`` atomically with ``write(file)``; returns ``{"size", "sha256"}`` of it.

    ``write`` gets a binary, write-only, non-seekable file object (``torch.save`` accepts it).
    On any error the destination is untouched and the temporary file is removed.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            hashing = _HashingWriter(f)
            write(hashing)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return {"size": hashing.size, "sha256": hashing.sha256.hexdigest()}


def atomic_write_text(path: Path, text: str) -> dict:
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def file_digest(path: Path) -> dict:
    """``{"size", "sha256"}`` of a file on disk (what :func:`atomic_write` returns for it)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


# --------------------------------------------------------------------------- path checks


def _nearest_existing(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(".")


def check_output_dir(path, flag: str) -> Path:
    """Raise ``ValueError`` unless ``path`` is, or can be created as, a writable folder."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise ValueError(f"{flag} {path}: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {base} is not writable")
    return p


def check_output_file(path, flag: str) -> Path:
    """Raise ``ValueError`` unless a file can be written at ``path`` (its folder may not exist yet)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, expected a file path")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{flag} {path}: exists and is not writable")
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise ValueError(f"{flag} {path}: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {base} is not writable")
    return p


# Hugging Face hub ids: "name" or "namespace/name", word characters, "-" and "." only.
_HUB_ID = re.compile(r"^(?:[\w\-.]+/)?[\w\-.]+$")


def looks_like_path(name: str) -> bool:
    """Is a ``--model`` argument meant as a local path rather than a hub id?

    Yes when it starts with ``/``, ``.`` or ``~`` (no hub id does), or contains a path
    separator yet is no valid hub id (``runs/exp 1/final``, ``a/b/c``, ``C:\\models``).
    ``org/model`` stays a hub id (unless it exists locally, which the callers check first).
    """
    s = str(name)
    if s.startswith(("/", ".", "~")):
        return True
    has_sep = os.sep in s or (os.altsep is not None and os.altsep in s)
    return has_sep and not _HUB_ID.match(s)


def check_model_path(name, flag: str = "--model") -> None:
    """Raise ``FileNotFoundError`` for a local-looking model path that does not exist, or a
    folder without ``config.json``; hub ids pass (they are resolved by transformers)."""
    p = Path(str(name)).expanduser()
    if p.exists():
        if not p.is_dir():
            raise FileNotFoundError(f"{flag} {name}: is a file, expected a model folder")
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{flag} {name}: not a Hugging Face model folder (config.json missing)")
        return
    if looks_like_path(str(name)):
        raise FileNotFoundError(f"{flag} {name}: model path not found")
