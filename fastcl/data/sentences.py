"""Plain-sentence corpora (one sentence per line), e.g. SimCSE's wiki1m."""

from __future__ import annotations

import gzip
import os
from pathlib import Path


def read_sentences(path: str | os.PathLike, drop_unterminated_last: bool = True, dedupe: bool = False) -> list[str]:
    """Sentences of a text file (``.gz`` ok), stripped, empty lines dropped.

    ``drop_unterminated_last``: drop a final line that has no newline -- the staged
    ``wiki1m_for_simcse.partial.txt.gz`` is a byte prefix whose last line is cut mid-sentence.
    ``dedupe``: keep the first occurrence of each sentence (wiki1m has duplicates).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sentence file {path} not found")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        text = f.read()
    lines = text.split("\n")
    if lines and lines[-1] != "" and drop_unterminated_last:
        lines = lines[:-1]
    sentences = [s.strip() for s in lines if s.strip()]
    if dedupe:
        sentences = list(dict.fromkeys(sentences))
    if not sentences:
        raise ValueError(f"{path}: no sentences")
    return sentences
