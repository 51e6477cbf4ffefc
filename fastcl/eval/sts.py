"""STS evaluation: Spearman x 100 of cosine similarity against gold scores, no regressor.

    enc = Encoder.from_pretrained(path, pooling="mean")
    results = evaluate_sts(enc, ["sts12", "stsb"])          # {task: STSResult}
    results["sts12"].score                                   # "all" aggregation

Protocols pick the text and splits a published number was computed on:

``senteval`` (default)  SimCSE / SupMPN / SentEval: SentEval's tokenised text for every task,
                        STS-B test (1,379) and SICK-R test (4,927), whitespace re-joined.
``mteb``                MTEB's STS tasks: the same STS12–16 text (the ``mteb/sts1x-sts`` hub
                        sets are SentEval's files), STS-B test in the original release text,
                        and SICK-R = all 9,927 SICK pairs (train + trial + test) in the
                        original text, verbatim.

Aggregation over STS12–16 subsets: ``all`` (pool every pair, one Spearman; SimCSE's
default), ``wmean`` (subset scores weighted by size) or ``mean``; STS-B and SICK-R have one
subset, so the three agree.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from fastcl.eval.metrics import AGGREGATIONS, aggregate, paired_cosine, pearson, spearman
from fastcl.eval.sts_data import STS_TASKS, STSTask, load_sts, load_sts_hf

PROTOCOLS = ("senteval", "mteb")
SOURCES = ("local", "hf")


@dataclass
class STSResult:
    """Scores of one task (all x 100). ``score`` is the chosen aggregation of Spearman."""

    task: str
    split: str
    source: str
    aggregation: str
    score: float
    n_pairs: int
    all: float
    mean: float
    wmean: float
    pearson_all: float
    subsets: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def protocol_data(task: str, protocol: str, split: str = "test") -> dict:
    """Keyword arguments of :func:`load_sts` that reproduce ``protocol`` for ``task``."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r}; expected one of {PROTOCOLS}")
    if protocol == "senteval":
        return {"variant": "senteval", "split": split, "normalize_space": True}
    variant = "original" if task in ("stsb", "sickr") else "senteval"
    if task == "sickr" and split == "test":
        split = "all"  # MTEB's SICK-R "test" split holds the whole dataset
    return {"variant": variant, "split": split, "normalize_space": False}


def score_task(task: STSTask, embeddings1, embeddings2, aggregation: str = "all") -> STSResult:
    """Score precomputed embeddings: ``embeddings{1,2}`` map subset name -> ``(n, H)`` tensor."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {AGGREGATIONS}")
    sims, golds, subsets = [], [], {}
    for name, sub in task.subsets.items():
        sim = paired_cosine(embeddings1[name], embeddings2[name])
        sims.append(sim)
        golds.append(sub.scores)
        subsets[name] = {
            "n": len(sub),
            "spearman": 100 * spearman(sim, sub.scores),
            "pearson": 100 * pearson(sim, sub.scores),
        }
    all_sim, all_gold = np.concatenate(sims), np.concatenate(golds)
    per = {n: s["spearman"] for n, s in subsets.items()}
    sizes = {n: s["n"] for n, s in subsets.items()}
    pooled = 100 * spearman(all_sim, all_gold)
    values = {how: aggregate(per, sizes, pooled, how) for how in AGGREGATIONS}
    return STSResult(
        task=task.name,
        split=task.split,
        source=task.source,
        aggregation=aggregation,
        score=values[aggregation],
        n_pairs=task.n_pairs,
        all=values["all"],
        mean=values["mean"],
        wmean=values["wmean"],
        pearson_all=100 * pearson(all_sim, all_gold),
        subsets=subsets,
    )


def evaluate_task(encoder, task: STSTask, aggregation: str = "all") -> STSResult:
    """Encode every sentence of ``task`` once with ``encoder`` and score it."""
    sentences = task.sentences()
    emb = encoder.encode(sentences, desc=task.name)
    e1, e2, offset = {}, {}, 0
    for name, sub in task.subsets.items():
        n = len(sub)
        e1[name] = emb[offset : offset + n]
        e2[name] = emb[offset + n : offset + 2 * n]
        offset += 2 * n
    return score_task(task, e1, e2, aggregation)


def evaluate_sts(
    encoder,
    tasks: Sequence[str] = STS_TASKS,
    data_dir: str | os.PathLike | None = None,
    protocol: str = "senteval",
    split: str = "test",
    aggregation: str = "all",
    source: str = "local",
) -> dict[str, STSResult]:
    """Evaluate ``encoder`` (anything with ``encode(sentences, desc=...) -> (N, H)``) on
    ``tasks``. ``split="dev"`` is for model selection (STS-B and SICK-R only).
    ``source="hf"`` reads MTEB's hub copies instead of ``data_dir`` (needs network)."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r}; expected one of {SOURCES}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {AGGREGATIONS}")
    unknown = [t for t in tasks if t not in STS_TASKS]
    if unknown:
        raise ValueError(f"unknown STS task(s) {unknown}; expected some of {STS_TASKS}")
    loaded = []
    for name in tasks:  # load (and validate) everything before the slow encoding
        if source == "hf":
            loaded.append(load_sts_hf(name, split=split))
        else:
            loaded.append(load_sts(name, data_dir, **protocol_data(name, protocol, split)))
    return {t.name: evaluate_task(encoder, t, aggregation) for t in loaded}
