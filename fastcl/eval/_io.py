"""Reading the staged text files: gzip or plain, explicit encodings, exact line splitting.

Lines are split on ``\\n`` only and a trailing ``\\r`` is dropped (SICK's test file is
CRLF). ``str.splitlines`` is avoided on purpose: it also breaks on characters such as
``\\x85`` or ``\\u2028`` that may occur inside a sentence and would shift the alignment of
line-paired files.
"""

from __future__ import annotations

import gzip
from pathlib import Path


def resolve(path: Path) -> Path:
    """``path`` or ``path.gz``, whichever exists (the staged data is gzip-compressed)."""
    if path.is_file():
        return path
    gz = path.with_name(path.name + ".gz")
    if gz.is_file():
        return gz
    raise FileNotFoundError(f"{path} (or {gz.name}) not found; see the data directory's SOURCES.md")


def read_text(path: Path, encoding: str = "utf-8") -> str:
    """The whole file decoded with ``encoding`` (``utf-8-sig`` drops a BOM)."""
    path = resolve(path)
    raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid {encoding}: {e}") from None


def read_lines(path: Path, encoding: str = "utf-8") -> list[str]:
    """Lines without their ``\\n`` / ``\\r\\n``; a final newline adds no empty line."""
    text = read_text(path, encoding)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]
