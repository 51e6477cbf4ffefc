"""SentEval transfer tasks: logistic regression on frozen sentence embeddings.

    results = evaluate_transfer(encoder, ["mr", "trec"], config="full")
    results["mr"].acc        # test accuracy, %

Protocols per task (see :mod:`fastcl.eval.protocols`): MR, CR, SUBJ, MPQA nested k-fold
cross-validation; SST-2 its train/dev/test split; TREC and MRPC k-fold on train, then the
test set (MRPC features ``[|u - v|, u * v]``, plus F1). ``config``: ``full`` is SimCSE's
``--mode test`` (10-fold, Adam, batch 64, tenacity 5, epoch size 4), ``fast`` its
``--mode dev`` (5-fold, RMSprop, batch 128, tenacity 3, epoch size 2), ``test`` a tiny
budget for smoke tests.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from fastcl.eval import protocols
from fastcl.eval.classifier import ClassifierConfig, classifier_config
from fastcl.eval.transfer_data import TRANSFER_TASKS, TransferData, load_transfer


@dataclass
class TransferResult:
    task: str
    acc: float
    devacc: float
    n: dict[str, int]
    protocol: str
    extra: dict = field(default_factory=dict)

    @property
    def score(self) -> float:
        return self.acc

    def to_dict(self) -> dict:
        return asdict(self)


def _f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    tp = int(((y_pred == 1) & (y_true == 1)).sum())
    fp = int(((y_pred == 1) & (y_true == 0)).sum())
    fn = int(((y_pred == 0) & (y_true == 1)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def score_transfer(
    data: TransferData, embed, cfg: ClassifierConfig, device=None, progress: bool = False
) -> TransferResult:
    """Run ``data``'s SentEval protocol; ``embed(list[str], desc) -> (N, H)`` tensor."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    feats = {}
    for name, sp in data.splits.items():
        a = embed(sp.sentences, f"{data.name}/{name}").to(device, torch.float32)
        if sp.second is not None:
            b = embed(sp.second, f"{data.name}/{name}[2]").to(device, torch.float32)
            a = torch.cat([(a - b).abs(), a * b], dim=1)  # SentEval's MRPC features
        feats[name] = a
    labels = {name: sp.labels for name, sp in data.splits.items()}
    sizes = {name: len(sp) for name, sp in data.splits.items()}
    k = data.nclasses
    desc = f"fit {data.name}" if progress else None
    if data.name in ("mr", "cr", "subj", "mpqa"):
        out = protocols.inner_kfold(feats["all"], labels["all"], k, cfg, desc)
        protocol = f"{cfg.kfold}-fold nested CV"
    elif data.name == "sst2":
        out = protocols.split(
            feats["train"], labels["train"], feats["dev"], labels["dev"], feats["test"], labels["test"], k, cfg, desc
        )
        protocol = "train/dev/test"
    else:
        out = protocols.kfold(feats["train"], labels["train"], feats["test"], labels["test"], k, cfg, desc)
        protocol = f"{cfg.kfold}-fold CV on train, test set"
    extra = {"l2": out["l2"]}
    if data.name == "mrpc":
        extra["f1"] = round(100 * _f1(labels["test"], out["pred"]), 2)
    return TransferResult(data.name, out["acc"], out["devacc"], sizes, protocol, extra)


def evaluate_transfer(
    encoder,
    tasks: Sequence[str] = TRANSFER_TASKS,
    data_dir: str | os.PathLike | None = None,
    config: str | ClassifierConfig = "full",
    device: str | torch.device | None = None,
) -> dict[str, TransferResult]:
    """Evaluate ``encoder`` (anything with ``encode(sentences, desc=...)``) on ``tasks``."""
    unknown = [t for t in tasks if t not in TRANSFER_TASKS]
    if unknown:
        raise ValueError(f"unknown transfer task(s) {unknown}; expected some of {TRANSFER_TASKS}")
    cfg = classifier_config(config)
    loaded = [load_transfer(t, data_dir) for t in tasks]  # fail on missing files before encoding
    results = {}
    for data in loaded:
        start = time.perf_counter()
        progress = bool(getattr(encoder, "show_progress", False))
        res = score_transfer(data, lambda s, desc: encoder.encode(s, desc=desc), cfg, device, progress)
        res.extra["seconds"] = round(time.perf_counter() - start, 1)
        results[data.name] = res
    return results
