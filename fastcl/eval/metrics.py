"""Correlation metrics for STS, computed in float64 with NumPy (no SciPy needed).

``spearman`` equals ``scipy.stats.spearmanr(x, y).statistic`` (average ranks for ties,
then Pearson); the tests check it against SciPy.
"""

from __future__ import annotations

import numpy as np
import torch

AGGREGATIONS = ("all", "wmean", "mean")


def _as_vector(name: str, x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains inf or NaN")
    return arr


def _pair(x, y) -> tuple[np.ndarray, np.ndarray]:
    x, y = _as_vector("x", x), _as_vector("y", y)
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same length, got {x.size} and {y.size}")
    if x.size < 2:
        raise ValueError("a correlation needs at least 2 pairs")
    return x, y


def rankdata(x: np.ndarray) -> np.ndarray:
    """1-based ranks; tied values get the mean of the ranks they span."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    # boundaries of runs of equal values in sorted order
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], xs.size]
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty_like(xs)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def pearson(x, y) -> float:
    """Pearson correlation; NaN when either side is constant (as SciPy)."""
    x, y = _pair(x, y)
    xc, yc = x - x.mean(), y - y.mean()
    denom = np.sqrt((xc * xc).sum() * (yc * yc).sum())
    return float((xc * yc).sum() / denom) if denom > 0 else float("nan")


def spearman(x, y) -> float:
    """Spearman rank correlation (ties averaged); NaN when either side is constant."""
    x, y = _pair(x, y)
    return pearson(rankdata(x), rankdata(y))


def paired_cosine(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Row-wise cosine of ``(N, H)`` embeddings, in float64; zero rows give 0."""
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"expected two (N, H) tensors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.double(), b.double()
    num = (a * b).sum(-1)
    den = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num)).numpy()


def aggregate(per_subset: dict[str, float], sizes: dict[str, int], pooled: float, how: str) -> float:
    """SentEval's STS aggregates: ``all`` (pairs of every subset pooled into one Spearman,
    given as ``pooled``), ``mean`` (plain mean of subset scores), ``wmean`` (weighted by
    subset size)."""
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation={how!r}; expected one of {AGGREGATIONS}")
    if how == "all":
        return pooled
    names = list(per_subset)
    values = np.array([per_subset[n] for n in names], dtype=np.float64)
    if how == "mean":
        return float(values.mean())
    weights = np.array([sizes[n] for n in names], dtype=np.float64)
    return float((values * weights).sum() / weights.sum())
