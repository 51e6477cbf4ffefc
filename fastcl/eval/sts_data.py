"""STS12–16, STS-B and SICK-R sentence pairs with gold scores.

From the staged data directory (``FASTCL_DATA_DIR``, layout and quirks in its SOURCES.md)::

    task = load_sts("sts12")                    # SentEval text, 5 subsets, 3,108 pairs
    task = load_sts("stsb", split="dev")        # model selection
    task = load_sts("sickr", variant="original", split="all")   # MTEB's SICK-R, 9,927 pairs

or, when online, from the Hugging Face hub copies MTEB evaluates on (``load_sts_hf``).

Text variants: ``senteval`` is SentEval's Moses-tokenised (and, except SICK, lowercased)
text, what SimCSE-style papers report; ``original`` is the release text. Sentences are
returned verbatim; ``normalize_space=True`` re-joins whitespace-split tokens with single
spaces, as SentEval does before calling an encoder (only whitespace-sensitive tokenisers,
e.g. BPE, can tell the difference).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fastcl._paths import require_data_dir
from fastcl.eval._io import read_lines

STS_TASKS = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")
VARIANTS = ("senteval", "original")

# SentEval's subset order; the file names in both variants use these names
STS_SUBSETS = {
    "sts12": ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"),
    "sts13": ("FNWN", "headlines", "OnWN"),  # the LDC-licensed SMT subset is not distributed
    "sts14": ("deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"),
    "sts15": ("answers-forums", "answers-students", "belief", "headlines", "images"),
    "sts16": ("answer-answer", "headlines", "plagiarism", "postediting", "question-question"),
}
STSB_SPLITS = ("train", "dev", "test")
SICK_SPLITS = ("train", "trial", "dev", "test", "all")  # dev = trial; all = MTEB's SICK-R
_SICK_FILES = {"train": "SICK_train", "trial": "SICK_trial", "dev": "SICK_trial", "test": "SICK_test_annotated"}

# Hugging Face copies used by MTEB, pinned to the revisions its published results name.
HF_DATASETS = {
    "sts12": ("mteb/sts12-sts", "a0d554a64d88156834ff5ae9920b964011b16384"),
    "sts13": ("mteb/sts13-sts", "7e90230a92c190f1bf69ae9002b8cea547a64cca"),
    "sts14": ("mteb/sts14-sts", "6031580fec1f6af667f0bd2da0a551cf4f0b2375"),
    "sts15": ("mteb/sts15-sts", "ae752c7c21bf194d8b67fd573edf7ae58183cbe3"),
    "sts16": ("mteb/sts16-sts", "4d8694f8f0e0100860b497b999b3dbed754a0513"),
    "stsb": ("mteb/stsbenchmark-sts", "b0fddb56ed78048fa8b90373c8a3cfc37b684831"),
    "sickr": ("mteb/sickr-sts", "20a6d6f312dd54037fe07a32d58e5e168867909d"),
}
_HF_SPLITS = {"dev": "validation"}


@dataclass(frozen=True)
class STSSubset:
    """Line-aligned pairs: ``sentences1[i]``, ``sentences2[i]``, gold ``scores[i]`` (float64)."""

    name: str
    sentences1: list[str]
    sentences2: list[str]
    scores: np.ndarray

    def __post_init__(self):
        if not (len(self.sentences1) == len(self.sentences2) == len(self.scores)):
            raise ValueError(
                f"subset {self.name}: {len(self.sentences1)} / {len(self.sentences2)} sentences "
                f"but {len(self.scores)} scores"
            )

    def __len__(self) -> int:
        return len(self.scores)


@dataclass(frozen=True)
class STSTask:
    """One STS benchmark: its subsets in SentEval's order (a single ``all`` for STS-B/SICK-R)."""

    name: str
    split: str
    source: str
    subsets: dict[str, STSSubset] = field(default_factory=dict)

    @property
    def n_pairs(self) -> int:
        return sum(len(s) for s in self.subsets.values())

    def sentences(self) -> list[str]:
        """Every sentence of every pair (with repeats), for one encoding pass."""
        out: list[str] = []
        for s in self.subsets.values():
            out += s.sentences1 + s.sentences2
        return out


def _space(text: str, normalize_space: bool) -> str:
    return " ".join(text.split()) if normalize_space else text


def _check(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {tuple(choices)}")


def _sts_year_subset(folder: Path, year: str, subset: str, original: bool, normalize_space: bool) -> STSSubset:
    prefix = "STS2016" if (original and year == "16") else "STS"
    inputs = read_lines(folder / f"{prefix}.input.{subset}.txt")
    gold = read_lines(folder / f"{prefix}.gs.{subset}.txt")
    if len(inputs) != len(gold):
        raise ValueError(f"{folder.name}/{subset}: {len(inputs)} input lines but {len(gold)} gold lines")
    s1, s2, scores = [], [], []
    for lineno, (line, g) in enumerate(zip(inputs, gold), 1):
        if not g.strip():  # STS15/16 leave unscored pairs empty; SentEval skips them
            continue
        fields = line.split("\t")  # STS16 originals carry 2 extra source fields
        if len(fields) < 2:
            raise ValueError(f"{folder.name}/{subset} line {lineno}: expected 2 tab-separated sentences")
        s1.append(_space(fields[0], normalize_space))
        s2.append(_space(fields[1], normalize_space))
        scores.append(float(g))
    return STSSubset(subset, s1, s2, np.asarray(scores, dtype=np.float64))


def _stsb(root: Path, variant: str, split: str, normalize_space: bool) -> STSSubset:
    s1, s2, scores = [], [], []
    path = root / "stsb" / variant / f"sts-{split}.csv"
    for lineno, line in enumerate(read_lines(path), 1):
        fields = line.split("\t")  # 7 fields; the original text has 9 in some rows (licence info)
        if len(fields) < 7:
            raise ValueError(f"{path.name} line {lineno}: expected >= 7 tab-separated fields, got {len(fields)}")
        scores.append(float(fields[4]))
        s1.append(_space(fields[5], normalize_space))
        s2.append(_space(fields[6], normalize_space))
    return STSSubset("all", s1, s2, np.asarray(scores, dtype=np.float64))


def _sick(root: Path, variant: str, split: str, normalize_space: bool) -> STSSubset:
    names = ("train", "trial", "test") if split == "all" else (split,)
    s1, s2, scores = [], [], []
    for name in names:
        path = root / "sick" / variant / f"{_SICK_FILES[name]}.txt"
        header, *rows = read_lines(path)
        cols = header.split("\t")
        try:
            ia, ib, ir = (cols.index(c) for c in ("sentence_A", "sentence_B", "relatedness_score"))
        except ValueError:
            raise ValueError(f"{path.name}: unexpected header {cols}") from None
        for row in rows:
            fields = row.split("\t")
            s1.append(_space(fields[ia], normalize_space))
            s2.append(_space(fields[ib], normalize_space))
            scores.append(float(fields[ir]))
    return STSSubset("all", s1, s2, np.asarray(scores, dtype=np.float64))


def load_sts(
    task: str,
    data_dir: str | os.PathLike | None = None,
    variant: str = "senteval",
    split: str = "test",
    normalize_space: bool = False,
) -> STSTask:
    """Load one STS task from the staged data directory.

    Args:
        task: one of :data:`STS_TASKS`.
        data_dir: the data directory; None = ``fastcl._paths.data_dir()``.
        variant: ``senteval`` (tokenised text, SimCSE/SentEval numbers) or ``original``.
        split: STS12–16: ``test`` only. STS-B: ``train``/``dev``/``test``. SICK-R:
            ``train``/``trial`` (= ``dev``)/``test``/``all`` (the 9,927 pairs MTEB scores).
        normalize_space: re-join whitespace-split tokens with one space (SentEval does).
    """
    _check("task", task, STS_TASKS)
    _check("variant", variant, VARIANTS)
    root = require_data_dir(data_dir)
    if task in STS_SUBSETS:
        _check(f"split (for {task})", split, ("test",))
        year = task[-2:]
        folder = root / "sts12-16" / variant / f"STS{year}-en-test"
        subsets = {
            name: _sts_year_subset(folder, year, name, variant == "original", normalize_space)
            for name in STS_SUBSETS[task]
        }
    elif task == "stsb":
        _check("split (for stsb)", split, STSB_SPLITS)
        subsets = {"all": _stsb(root, variant, split, normalize_space)}
    else:
        _check("split (for sickr)", split, SICK_SPLITS)
        subsets = {"all": _sick(root, variant, split, normalize_space)}
    return STSTask(task, split, f"{root}:{variant}", subsets)


def load_sts_hf(task: str, split: str = "test", revision: str | None = None) -> STSTask:
    """Load ``task`` from the Hugging Face hub copy MTEB uses (needs network or a warm cache).

    The hub copies have no subsets (one ``all``); SICK-R there is all 9,927 pairs (``test``);
    STS-B has ``train``/``dev``/``test``. Raises ``RuntimeError`` with the reason when the
    hub cannot be reached (offline machines: use :func:`load_sts` with the staged data).
    """
    _check("task", task, STS_TASKS)
    valid = {"stsb": STSB_SPLITS}.get(task, ("test",))
    _check(f"split (for {task} on the hub)", split, valid)
    repo, pinned = HF_DATASETS[task]
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is in the hf extra
        raise RuntimeError("loading from the hub needs the `datasets` package (pip install fastcl[hf])") from e
    try:
        ds = datasets.load_dataset(repo, split=_HF_SPLITS.get(split, split), revision=revision or pinned)
    except Exception as e:  # network, offline mode, missing cache: all mean "not available here"
        raise RuntimeError(
            f"could not load {repo} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "offline, use the staged data instead: load_sts(task, data_dir=...)"
        ) from e
    scores = np.asarray(ds["score"], dtype=np.float64)
    subset = STSSubset("all", list(ds["sentence1"]), list(ds["sentence2"]), scores)
    return STSTask(task, split, f"hf:{repo}@{revision or pinned}", {"all": subset})
