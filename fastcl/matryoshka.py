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
import numbers
import random
from collections.abc import Iterable

import torch
from torch import Tensor

from . import _checks


def _as_tuple(name: str, values) -> tuple:
    """``values`` read once into a tuple (a generator is spent afterwards); a string, a number
    or anything else that is not an iterable of values is refused."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence (any iterable), got {values!r}")
    return tuple(values)


def check(
    dims, weights, d: int | None = None, dtype: torch.dtype | None = None
) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """``(dims, weights)`` validated as Python ints and floats (weights default to 1), or None
    without dims.

    ``dims``: distinct integers in ``1..d`` (Python's or NumPy's), any iterable, any order;
    ``weights``: real numbers, one per dim, finite in ``dtype`` (the compute dtype: a weight
    that is finite as a Python float but overflows float32 would turn the loss into inf).
    """
    if dims is None:
        if weights is not None:
            raise ValueError("matryoshka_weights given without matryoshka_dims")
        return None
    dims = _as_tuple("matryoshka_dims", dims)
    if not all(isinstance(m, numbers.Integral) and not isinstance(m, bool) for m in dims):
        raise TypeError(f"matryoshka_dims must be integers, got {dims!r}")
    dims = tuple(int(m) for m in dims)
    if not dims or len(set(dims)) != len(dims) or any(m < 1 or (d is not None and m > d) for m in dims):
        limit = "" if d is None else f" (embedding size {d})"
        raise ValueError(f"matryoshka_dims must be distinct ints in 1..d{limit}, got {dims}")
    weights = (1.0,) * len(dims) if weights is None else _as_tuple("matryoshka_weights", weights)
    if len(weights) != len(dims):
        raise ValueError(f"matryoshka_weights needs one weight per dim: {len(weights)} weights, {len(dims)} dims")
    largest = math.inf if dtype is None else torch.finfo(dtype).max
    for w in weights:
        if not _checks.is_real_number(w) or not abs(float(w)) <= largest:  # NaN fails too
            where = "" if dtype is None else f" in {dtype}"
            raise ValueError(f"matryoshka_weights must be finite numbers{where}, got {weights}")
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
