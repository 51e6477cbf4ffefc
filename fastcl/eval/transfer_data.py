"""SentEval transfer tasks read from ``senteval-transfer/`` in the data directory.

Each loader mirrors SentEval's own reader: whitespace tokens re-joined with single spaces,
rows sorted by (token count, label) as SentEval sorts them before encoding (its k-fold
splits are taken in that order), the same label ids and the same file encodings (TREC is
Latin-1, MRPC UTF-8 with a BOM, the rest UTF-8/ASCII).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from fastcl._paths import require_data_dir
from fastcl.eval._io import read_lines

TRANSFER_TASKS = ("mr", "cr", "subj", "mpqa", "sst2", "trec", "mrpc")
TREC_CLASSES = ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM")  # SentEval's tgt2idx order

_BINARY_FILES = {  # task -> folder, (positive file, negative file); label 1 = first file
    "mr": ("MR", ("rt-polarity.pos", "rt-polarity.neg")),
    "cr": ("CR", ("custrev.pos", "custrev.neg")),
    "subj": ("SUBJ", ("subj.objective", "subj.subjective")),
    "mpqa": ("MPQA", ("mpqa.pos", "mpqa.neg")),
}


@dataclass
class Split:
    """Sentences (or sentence pairs: ``second`` is set) with integer labels."""

    sentences: list[str]
    labels: np.ndarray
    second: list[str] | None = None

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class TransferData:
    name: str
    nclasses: int
    splits: dict[str, Split] = field(default_factory=dict)


def _tokens(text: str) -> str:
    return " ".join(text.split())


def _sorted_split(sentences, labels, second=None) -> Split:
    """SentEval's order: by token count (of each sentence for pairs), then label."""
    if second is None:
        keys = [(len(s.split()), int(y)) for s, y in zip(sentences, labels)]
    else:
        keys = [(len(a.split()), len(b.split()), int(y)) for a, b, y in zip(sentences, second, labels)]
    order = sorted(range(len(labels)), key=keys.__getitem__)  # stable, like Python's sorted
    return Split(
        [sentences[i] for i in order],
        np.asarray([labels[i] for i in order], dtype=np.int64),
        None if second is None else [second[i] for i in order],
    )


def _binary(root, task) -> TransferData:
    folder, (pos, neg) = _BINARY_FILES[task]
    pos_lines = [_tokens(s) for s in read_lines(root / folder / pos)]
    neg_lines = [_tokens(s) for s in read_lines(root / folder / neg)]
    labels = [1] * len(pos_lines) + [0] * len(neg_lines)
    return TransferData(task, 2, {"all": _sorted_split(pos_lines + neg_lines, labels)})


def _sst2(root) -> TransferData:
    splits = {}
    for name in ("train", "dev", "test"):
        sentences, labels = [], []
        for line in read_lines(root / "SST" / "binary" / f"sentiment-{name}"):
            text, label = line.strip().split("\t")
            sentences.append(_tokens(text))
            labels.append(int(label))
        splits[name] = _sorted_split(sentences, labels)
    return TransferData("sst2", 2, splits)


def _trec(root) -> TransferData:
    splits = {}
    for name, fname in (("train", "train_5500.label"), ("test", "TREC_10.label")):
        sentences, labels = [], []
        for lineno, line in enumerate(read_lines(root / "TREC" / fname, encoding="latin-1"), 1):
            target, rest = line.strip().split(":", 1)
            if target not in TREC_CLASSES:
                raise ValueError(f"{fname} line {lineno}: unknown class {target!r}")
            sentences.append(_tokens(rest.split(" ", 1)[1]))  # drop the fine label
            labels.append(TREC_CLASSES.index(target))
        splits[name] = _sorted_split(sentences, labels)
    return TransferData("trec", len(TREC_CLASSES), splits)


def _mrpc(root) -> TransferData:
    splits = {}
    for name in ("train", "test"):
        header, *rows = read_lines(root / "MRPC" / f"msr_paraphrase_{name}.txt", encoding="utf-8-sig")
        if not header.startswith("Quality"):
            raise ValueError(f"msr_paraphrase_{name}.txt: unexpected header {header[:40]!r}")
        first, second, labels = [], [], []
        for row in rows:
            fields = row.strip().split("\t")
            labels.append(int(fields[0]))
            first.append(_tokens(fields[3]))
            second.append(_tokens(fields[4]))
        splits[name] = _sorted_split(first, labels, second)
    return TransferData("mrpc", 2, splits)


def load_transfer(task: str, data_dir: str | os.PathLike | None = None) -> TransferData:
    """Load one of :data:`TRANSFER_TASKS` (MR/CR/SUBJ/MPQA have one ``all`` split; SST-2
    ``train``/``dev``/``test``; TREC and MRPC ``train``/``test``)."""
    if task not in TRANSFER_TASKS:
        raise ValueError(f"task={task!r}; expected one of {TRANSFER_TASKS}")
    root = require_data_dir(data_dir) / "senteval-transfer"
    if task in _BINARY_FILES:
        return _binary(root, task)
    return {"sst2": _sst2, "trec": _trec, "mrpc": _mrpc}[task](root)
