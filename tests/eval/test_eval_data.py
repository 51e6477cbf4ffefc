"""Loaders against the staged files: exact pair counts, format quirks, MTEB text identity."""

from __future__ import annotations

import numpy as np
import pytest

from fastcl.eval.sts import protocol_data
from fastcl.eval.sts_data import STS_SUBSETS, load_sts, load_sts_hf
from fastcl.eval.transfer_data import TRANSFER_TASKS, load_transfer

pytestmark = pytest.mark.data

# SentEval / SimCSE evaluation sizes (data SOURCES.md; SentEval's STS readers)
PAIRS = {"sts12": 3108, "sts13": 1500, "sts14": 3750, "sts15": 3000, "sts16": 1186, "stsb": 1379, "sickr": 4927}
SUBSETS = {
    "sts12": [750, 750, 459, 750, 399],
    "sts13": [189, 750, 561],
    "sts14": [450, 300, 750, 750, 750, 750],
    "sts15": [375, 750, 375, 750, 750],
    "sts16": [254, 249, 230, 244, 209],
}


@pytest.mark.parametrize("variant", ["senteval", "original"])
@pytest.mark.parametrize("task", list(PAIRS))
def test_sts_pair_counts(data_dir, task, variant):
    t = load_sts(task, data_dir, variant=variant)
    assert t.n_pairs == PAIRS[task]
    if task in SUBSETS:
        assert list(t.subsets) == list(STS_SUBSETS[task])
        assert [len(s) for s in t.subsets.values()] == SUBSETS[task]
    for s in t.subsets.values():
        assert len(s.sentences1) == len(s.sentences2) == len(s.scores)
        assert all(isinstance(x, str) and x and "\t" not in x and "\r" not in x for x in s.sentences1 + s.sentences2)
        assert s.scores.dtype == np.float64 and s.scores.min() >= 0 and s.scores.max() <= 5


def test_other_splits(data_dir):
    assert load_sts("stsb", data_dir, split="dev").n_pairs == 1500
    assert load_sts("stsb", data_dir, split="train").n_pairs == 5749
    assert load_sts("sickr", data_dir, split="dev").n_pairs == 500
    assert load_sts("sickr", data_dir, split="train").n_pairs == 4500
    assert load_sts("sickr", data_dir, split="all", variant="original").n_pairs == 9927
    with pytest.raises(ValueError, match="split"):
        load_sts("sts12", data_dir, split="dev")
    with pytest.raises(ValueError, match="variant"):
        load_sts("sts12", data_dir, variant="tokenised")
    with pytest.raises(ValueError, match="task"):
        load_sts("sts17", data_dir)


def test_format_quirks(data_dir):
    # STS16 originals carry 2 trailing source fields; only the sentences are kept
    s16 = load_sts("sts16", data_dir, variant="original").subsets["headlines"]
    assert s16.sentences1[0] == "Driver backs into stroller with child, drives off"  # line 1 is unscored
    assert not any("Europe Media Monitor" in s for s in s16.sentences1 + s16.sentences2)
    # STS16 postediting: 3,287 input lines, 244 scored
    assert len(load_sts("sts16", data_dir).subsets["postediting"]) == 244
    # SICK test is CRLF: the last column parses, nothing keeps a \r
    sick = load_sts("sickr", data_dir).subsets["all"]
    assert set(np.unique(np.round(sick.scores))) <= {1.0, 2.0, 3.0, 4.0, 5.0}
    # STS-B original rows with 9 fields are read by their first 7
    stsb = load_sts("stsb", data_dir, variant="original").subsets["all"]
    assert all("http" not in s for s in stsb.sentences2)
    # the two text variants agree on gold scores row by row
    senteval = load_sts("stsb", data_dir).subsets["all"]
    np.testing.assert_array_equal(senteval.scores, stsb.scores)
    # SentEval re-joins tokens with one space; raw text keeps the file's spacing
    raw = load_sts("stsb", data_dir, variant="original").sentences()
    joined = load_sts("stsb", data_dir, variant="original", normalize_space=True).sentences()
    assert sum(a != b for a, b in zip(raw, joined)) == 16


# MTEB's descriptive statistics for its STS test sets (embeddings-benchmark/mteb,
# mteb/descriptive_stats/STS/*.json): pairs and total characters of sentence1 + sentence2.
MTEB_STATS = {
    "sts12": (3108, 402118),
    "sts13": (1500, 161949),
    "sts14": (3750, 407185),
    "sts15": (3000, 346442),
    "sts16": (1186, 154802),
    "stsb": (1379, 147886),
    "sickr": (9927, 915617),
}


@pytest.mark.parametrize("task", list(MTEB_STATS))
def test_mteb_protocol_reads_the_text_mteb_scores(data_dir, task):
    """The MTEB protocol's text is character-for-character the size of MTEB's hub sets:
    SentEval's STS12-16 files, STS-B's original test text, SICK's 9,927 original pairs."""
    t = load_sts(task, data_dir, **protocol_data(task, "mteb"))
    chars = sum(len(s) for s in t.sentences())
    assert (t.n_pairs, chars) == MTEB_STATS[task]


def test_hub_loader_reports_offline_clearly(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="mteb/sts12-sts.*staged data"):
        load_sts_hf("sts12")
    with pytest.raises(ValueError, match="split"):
        load_sts_hf("sts12", split="dev")


def test_hub_loader_parses_a_dataset(monkeypatch):
    datasets = pytest.importorskip("datasets")
    seen = {}

    def fake(repo, split, revision):
        seen.update(repo=repo, split=split, revision=revision)
        return datasets.Dataset.from_dict({"sentence1": ["a", "b"], "sentence2": ["c", "d"], "score": [1.0, 4.5]})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    t = load_sts_hf("stsb", split="dev")
    assert seen == {
        "repo": "mteb/stsbenchmark-sts",
        "split": "validation",
        "revision": "b0fddb56ed78048fa8b90373c8a3cfc37b684831",
    }
    assert t.n_pairs == 2 and t.subsets["all"].scores.tolist() == [1.0, 4.5]


TRANSFER_SIZES = {
    "mr": {"all": 10662},
    "cr": {"all": 3775},
    "subj": {"all": 10000},
    "mpqa": {"all": 10606},
    "sst2": {"train": 67349, "dev": 872, "test": 1821},
    "trec": {"train": 5452, "test": 500},
    "mrpc": {"train": 4076, "test": 1725},
}


@pytest.mark.parametrize("task", TRANSFER_TASKS)
def test_transfer_sizes_and_labels(data_dir, task):
    data = load_transfer(task, data_dir)
    assert {k: len(v) for k, v in data.splits.items()} == TRANSFER_SIZES[task]
    for sp in data.splits.values():
        assert sp.labels.min() >= 0 and sp.labels.max() == data.nclasses - 1
        lengths = [len(s.split()) for s in sp.sentences]
        assert lengths == sorted(lengths) or sp.second is not None  # SentEval's order
    if task == "trec":
        assert np.bincount(data.splits["train"].labels).tolist() == [86, 1162, 1250, 1223, 835, 896]
    if task == "mrpc":
        assert int(data.splits["test"].labels.sum()) == 1147  # paraphrases in the test set
    if task == "cr":
        assert int(data.splits["all"].labels.sum()) == 2407
