"""SentEval's three ways of scoring a classifier on frozen features.

``inner_kfold``  MR, CR, SUBJ, MPQA (SentEval ``InnerKFoldClassifier``): stratified k-fold
                 over all data; inside each outer training part, a stratified k-fold picks
                 the L2 value (each inner model early-stops on its inner test fold); the
                 chosen L2 is refit on the outer training part (5 % held out for early
                 stopping) and scored on the outer test fold. Reports mean accuracies.
``kfold``        TREC, MRPC (``KFoldClassifier``): k-fold on the training set picks L2, refit
                 on the whole training set (5 % held out), scored on the test set.
``split``        SST-2 (``SplitClassifier``): each L2 trains on train, early-stops on dev;
                 the best dev accuracy picks the model scored on test.

Folds come from scikit-learn's ``StratifiedKFold(shuffle=True, random_state=seed)`` over
the rows in the order given, as SentEval does (the loaders sort rows SentEval's way).
Accuracies are percentages; model-selection scores are rounded to 2 decimals before the
arg-max, as in SentEval (ties pick the smallest L2).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fastcl.eval.classifier import ClassifierConfig, TrainSet, fit_grid


def _folds(y: np.ndarray, k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from sklearn.model_selection import StratifiedKFold

    skf = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
    return list(skf.split(np.zeros(len(y)), y))


def _pick(scores: list[float]) -> tuple[int, float]:
    rounded = [round(100 * s, 2) for s in scores]
    best = int(np.argmax(rounded))
    return best, rounded[best]


def inner_kfold(x: Tensor, y: np.ndarray, nclasses: int, cfg: ClassifierConfig, desc: str | None = None) -> dict:
    """Nested cross-validation (MR, CR, SUBJ, MPQA). Returns ``devacc``, ``acc``, ``l2``."""
    y = np.asarray(y)
    outer = _folds(y, cfg.kfold, cfg.seed)
    grid = cfg.l2_grid
    # every (outer fold, inner fold) x L2 model in one run
    sets = [TrainSet(train[tr], train[te]) for train, _ in outer for tr, te in _folds(y[train], cfg.kfold, cfg.seed)]
    inner = fit_grid(x, y, nclasses, sets, grid, cfg, desc).val_accuracy.reshape(len(outer), cfg.kfold, len(grid))
    dev, chosen = [], []
    for o in range(len(outer)):
        r, score = _pick(list(inner[o].mean(axis=0)))
        chosen.append(grid[r])
        dev.append(score)
    final = fit_grid(x, y, nclasses, [TrainSet(train) for train, _ in outer], np.array(chosen)[:, None], cfg, desc)
    test = []
    for o, (_, te) in enumerate(outer):
        pred = final.predict(x[te], o, 0)
        test.append(round(100 * float((pred == y[te]).mean()), 2))
    return {"devacc": round(float(np.mean(dev)), 2), "acc": round(float(np.mean(test)), 2), "l2": chosen}


def kfold(
    x_train: Tensor, y_train, x_test: Tensor, y_test, nclasses: int, cfg: ClassifierConfig, desc: str | None = None
) -> dict:
    """k-fold L2 selection on train, refit, score on test (TREC, MRPC). Adds ``pred``."""
    y_train, y_test = np.asarray(y_train), np.asarray(y_test)
    folds = _folds(y_train, cfg.kfold, cfg.seed)
    grid = cfg.l2_grid
    scan = fit_grid(x_train, y_train, nclasses, [TrainSet(tr, te) for tr, te in folds], grid, cfg, desc).val_accuracy
    r, devacc = _pick(list(scan.mean(axis=0)))
    final = fit_grid(x_train, y_train, nclasses, [TrainSet(np.arange(len(y_train)))], [grid[r]], cfg, desc)
    pred = final.predict(x_test, 0, 0)
    acc = round(100 * float((pred == y_test).mean()), 2)
    return {"devacc": devacc, "acc": acc, "l2": grid[r], "pred": pred}


def split(x_train, y_train, x_dev, y_dev, x_test, y_test, nclasses: int, cfg: ClassifierConfig, desc=None) -> dict:
    """Train / early-stop on dev / test (SST-2)."""
    x = torch.cat([x_train, x_dev])
    y = np.concatenate([np.asarray(y_train), np.asarray(y_dev)])
    rows = TrainSet(np.arange(len(y_train)), np.arange(len(y_train), len(y)))
    grid = cfg.l2_grid
    fit = fit_grid(x, y, nclasses, [rows], grid, cfg, desc)
    r, devacc = _pick(list(fit.val_accuracy[0]))
    # SentEval refits the chosen L2 identically (same data and seed): reuse that model
    pred = fit.predict(x_test, 0, r)
    acc = round(100 * float((pred == np.asarray(y_test)).mean()), 2)
    return {"devacc": devacc, "acc": acc, "l2": grid[r]}
