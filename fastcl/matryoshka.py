"""Matryoshka prefixes for every LSE loss: ``matryoshka_dims`` and ``matryoshka_weights``.

``loss = sum_k w_k * loss(embeddings[..., :m_k])``: each prefix is truncated and then the
loss runs as usual (cosine similarity normalises each prefix by its own norm), exactly
sentence-transformers' ``MatryoshkaLoss(model, loss, matryoshka_dims, matryoshka_weights)``
(weights default to 1). Every LSE loss runs all prefixes in one fused call
(``LSEProblem.dims``: one pass over ``d``); MNRL with ``directions``/hardness options gets
``[K, B]`` rows from each of its primitive calls and combines them prefix by prefix.

Differences from sentence-transformers: a repeated dim, a dim above ``d`` or below 1 raise
``ValueError`` (ST would compute a repeated prefix twice and clip a large one to ``d``).
"""

from __future__ import annotations

import math
import random

import torch
from torch import Tensor

from . import _checks


def check(dims, weights, d: int | None = None) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """``(dims, weights)`` validated (weights default to 1), or None without dims.

    ``dims``: distinct ints in ``1..d`` (any order); ``weights``: finite numbers, one per dim.
    """
    if dims is None:
        if weights is not None:
            raise ValueError("matryoshka_weights given without matryoshka_dims")
        return None
    if isinstance(dims, (int, str)) or not all(isinstance(m, int) and not isinstance(m, bool) for m in dims):
        raise TypeError(f"matryoshka_dims must be a sequence of ints, got {dims!r}")
    dims = tuple(dims)
    if not dims or len(set(dims)) != len(dims) or any(m < 1 or (d is not None and m > d) for m in dims):
        limit = "" if d is None else f" (embedding size {d})"
        raise ValueError(f"matryoshka_dims must be distinct ints in 1..d{limit}, got {dims}")
    weights = (1.0,) * len(dims) if weights is None else tuple(weights)
    if len(weights) != len(dims):
        raise ValueError(f"matryoshka_weights needs one weight per dim: {len(weights)} weights, {len(dims)} dims")
    for w in weights:
        if not _checks.is_real_number(w) or not math.isfinite(w):
            raise ValueError(f"matryoshka_weights must be finite numbers, got {weights}")
    return dims, tuple(float(w) for w in weights)


def sample(dims, weights, n_dims_per_step: int, rng: random.Random | None = None):
    """sentence-transformers' ``n_dims_per_step``: that many (dim, weight) pairs drawn per
    step without replacement (``-1`` or ``>= K``: all)."""
    if dims is None or n_dims_per_step <= 0 or n_dims_per_step >= len(dims):
        return dims, weights
    weights = (1.0,) * len(dims) if weights is None else tuple(weights)
    picked = sorted((rng or random).sample(range(len(dims)), n_dims_per_step))
    return tuple(dims[k] for k in picked), tuple(weights[k] for k in picked)


def weight_tensor(checked, like: Tensor) -> Tensor | None:
    """``[K]`` weights in the compute dtype of ``like`` (None without dims)."""
    if checked is None:
        return None
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.tensor(checked[1], dtype=dtype, device=like.device)
