"""NLI readers: (premise, hypothesis, label) rows as a Hugging Face ``datasets.Dataset``.

Sources (:func:`load_nli`):

- a SentEval folder with line-aligned ``s1.SPLIT``, ``s2.SPLIT``, ``labels.SPLIT`` files
  (optionally ``.gz``), e.g. the staged ``snli/senteval`` (dev, test);
- a ``.csv`` / ``.tsv`` file (optionally ``.gz``) with a header naming the premise,
  hypothesis and label columns (``premise``/``sentence1``, ``hypothesis``/``sentence2``,
  ``label``/``gold_label``), or the staged ``snli/sample20k`` layout: no header, four
  TAB-separated columns ``label label premise hypothesis`` with 1 = neutral,
  2 = contradiction, 3 = entailment;
- a ``.jsonl`` file (optionally ``.gz``) with the same keys;
- a Hugging Face hub dataset name (e.g. ``stanfordnlp/snli``; needs network), integer labels
  0 = entailment, 1 = neutral, 2 = contradiction, -1 dropped.

Labels are normalised to the strings of :data:`LABELS`; rows without a gold label (``-``,
``-1``, empty) are dropped. Text is kept verbatim (stripped of the line end).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
from pathlib import Path

LABELS = ("entailment", "neutral", "contradiction")
_HF_INT_LABELS = {0: "entailment", 1: "neutral", 2: "contradiction"}
_SAMPLE20K_LABELS = {"1": "neutral", "2": "contradiction", "3": "entailment"}
_NO_GOLD = ("-", "-1", "")
_PREMISE_KEYS = ("premise", "sentence1", "s1", "anchor")
_HYPOTHESIS_KEYS = ("hypothesis", "sentence2", "s2")
_LABEL_KEYS = ("label", "gold_label", "labels")


def _open_text(path: Path):
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _lines(path: Path) -> list[str]:
    with _open_text(path) as f:
        return [line.rstrip("\r\n") for line in f]


def normalize_label(value) -> str | None:
    """``entailment``/``neutral``/``contradiction`` (any case), HF ints 0/1/2, or None for no gold label."""
    if isinstance(value, bool):
        raise ValueError(f"NLI label must be a string or int, got {value!r}")
    if isinstance(value, int):
        if value == -1:
            return None
        if value in _HF_INT_LABELS:
            return _HF_INT_LABELS[value]
        raise ValueError(f"integer NLI label must be 0 (entailment), 1 (neutral), 2 (contradiction) or -1, got {value}")
    text = str(value).strip().lower()
    if text in _NO_GOLD:
        return None
    if text in LABELS:
        return text
    if text.isdigit() and int(text) in _HF_INT_LABELS:
        return _HF_INT_LABELS[int(text)]
    raise ValueError(f"unknown NLI label {value!r}; expected one of {LABELS} or 0/1/2")


def _dataset(premises, hypotheses, labels, source: str):
    import datasets

    rows = {"premise": [], "hypothesis": [], "label": []}
    for p, h, lab in zip(premises, hypotheses, labels):
        lab = normalize_label(lab)
        if lab is None:
            continue
        rows["premise"].append(p)
        rows["hypothesis"].append(h)
        rows["label"].append(lab)
    if not rows["label"]:
        raise ValueError(f"{source}: no NLI rows with a gold label")
    return datasets.Dataset.from_dict(rows)


def _find(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def read_senteval_nli(folder: str | os.PathLike, split: str):
    """SentEval's ``s1.SPLIT`` / ``s2.SPLIT`` / ``labels.SPLIT`` (``.gz`` accepted)."""
    folder = Path(folder)
    paths = [_find(folder, f"{kind}.{split}") for kind in ("s1", "s2", "labels")]
    if any(p is None for p in paths):
        present = sorted({p.name.split(".")[1] for p in folder.glob("s1.*")})
        raise FileNotFoundError(
            f"{folder}: no SentEval NLI split {split!r} (need s1/s2/labels.{split}[.gz]); "
            f"splits present: {present or 'none'}"
        )
    s1, s2, labels = (_lines(p) for p in paths)
    if not len(s1) == len(s2) == len(labels):
        raise ValueError(
            f"{folder}: s1/s2/labels.{split} have {len(s1)}/{len(s2)}/{len(labels)} lines; they must align"
        )
    return _dataset([s.strip() for s in s1], [s.strip() for s in s2], labels, str(folder))


def _pick(keys, header: list[str], what: str, path: Path) -> str:
    lower = {h.lower(): h for h in header}
    for k in keys:
        if k in lower:
            return lower[k]
    raise ValueError(f"{path}: no {what} column; expected one of {keys}, found {header}")


def read_nli_csv(path: str | os.PathLike):
    """A ``.csv``/``.tsv`` file (``.gz`` ok): named columns, or the headerless sample20k layout."""
    path = Path(path)
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    with _open_text(path) as f:
        text = f.read()
    first = text.split("\n", 1)[0]
    delimiter = "\t" if name.endswith(".tsv") or "\t" in first else ","
    rows = list(csv.reader(io.StringIO(text), delimiter=delimiter))
    rows = [r for r in rows if r]
    if not rows:
        raise ValueError(f"{path}: empty file")
    header = [h.strip() for h in rows[0]]
    if any(h.lower() in _PREMISE_KEYS for h in header):
        p, h, lab = (
            header.index(_pick(k, header, w, path))
            for k, w in ((_PREMISE_KEYS, "premise"), (_HYPOTHESIS_KEYS, "hypothesis"), (_LABEL_KEYS, "label"))
        )
        body = rows[1:]
        return _dataset([r[p] for r in body], [r[h] for r in body], [r[lab] for r in body], str(path))
    # headerless: label label premise hypothesis (snli/sample20k)
    if len(rows[0]) != 4 or rows[0][0] not in _SAMPLE20K_LABELS:
        raise ValueError(
            f"{path}: no header with premise/hypothesis/label columns and not the 4-column "
            "'label label premise hypothesis' layout (1 neutral, 2 contradiction, 3 entailment)"
        )
    bad = next((i for i, r in enumerate(rows) if len(r) != 4 or r[0] not in _SAMPLE20K_LABELS), None)
    if bad is not None:
        raise ValueError(f"{path}: line {bad + 1} is not 'label label premise hypothesis': {rows[bad]!r}")
    labels = [_SAMPLE20K_LABELS[r[0]] for r in rows]
    return _dataset([r[2] for r in rows], [r[3] for r in rows], labels, str(path))


def read_nli_jsonl(path: str | os.PathLike):
    """One JSON object per line with premise/hypothesis/label keys (or sentence1/sentence2/gold_label)."""
    path = Path(path)
    records = [json.loads(line) for line in _lines(path) if line.strip()]
    if not records:
        raise ValueError(f"{path}: empty file")
    keys = list(records[0])
    p, h, lab = (
        _pick(k, keys, w, path)
        for k, w in ((_PREMISE_KEYS, "premise"), (_HYPOTHESIS_KEYS, "hypothesis"), (_LABEL_KEYS, "label"))
    )
    return _dataset([r[p] for r in records], [r[h] for r in records], [r[lab] for r in records], str(path))


def load_nli(source: str | os.PathLike, split: str = "train"):
    """Read NLI pairs from a folder, a file or a hub dataset name (see the module docstring).

    Returns a ``datasets.Dataset`` with string columns ``premise``, ``hypothesis``, ``label``.
    ``split`` selects the SentEval files (``s1.{split}``) or the hub split.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return read_senteval_nli(path, split)
    if path.is_file():
        name = path.name[:-3] if path.suffix == ".gz" else path.name
        if name.endswith((".csv", ".tsv", ".txt")):
            return read_nli_csv(path)
        if name.endswith((".jsonl", ".json")):
            return read_nli_jsonl(path)
        raise ValueError(f"{path}: unknown NLI file type; expected .csv, .tsv or .jsonl (optionally .gz)")
    if os.sep in str(source) or str(source).startswith("."):
        raise FileNotFoundError(f"NLI data {source} not found")
    return _load_hub(str(source), split)


def _load_hub(name: str, split: str):
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, unknown name: both mean "not available here"
        raise FileNotFoundError(f"NLI data {name!r} is neither a local path nor a reachable hub dataset ({e})") from e
    cols = ds.column_names
    p, h, lab = (
        _pick(k, cols, w, Path(name))
        for k, w in ((_PREMISE_KEYS, "premise"), (_HYPOTHESIS_KEYS, "hypothesis"), (_LABEL_KEYS, "label"))
    )
    return _dataset(ds[p], ds[h], ds[lab], name)
