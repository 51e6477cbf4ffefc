"""Numeric options take NumPy scalars as Python numbers (sentence-transformers and PyTorch do).

``np.float32(0.05)`` is not a Python ``float``; a config loaded with NumPy often holds one.
It must give the same result as ``float(value)``, and a bool must still be refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastcl.losses as L
from fastcl.gclsr.augment import PWVA

TOL = dict(rtol=0, atol=0)  # the same float: bitwise


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)


@pytest.mark.parametrize("value", [np.float32(0.07), np.float64(0.07), np.int64(1)])
def test_temperature(value):
    a, p, _ = _inputs()
    want = L.infonce_loss(a, p, temperature=float(value), backend="torch")
    torch.testing.assert_close(L.infonce_loss(a, p, temperature=value, backend="torch"), want, **TOL)
    module = L.InfoNCELoss(value, backend="torch")
    assert type(module.temperature) is float
    torch.testing.assert_close(module(a, p), want, **TOL)


def test_hardness_lam_and_matryoshka_weights():
    a, p, n = _inputs(1)
    kw = dict(temperature=0.05, hardness_mode="in_batch_negatives", backend="torch")
    torch.testing.assert_close(
        L.mnrl_loss(a, p, n, hardness_strength=np.float32(2.5), **kw),
        L.mnrl_loss(a, p, n, hardness_strength=2.5, **kw),
        **TOL,
    )
    torch.testing.assert_close(
        L.edacse_loss(a, p, n, lam=np.float32(0.5), backend="torch"), L.edacse_loss(a, p, n, lam=0.5, backend="torch")
    )
    dims = dict(matryoshka_dims=(8, 4), backend="torch")
    torch.testing.assert_close(
        L.mnrl_loss(a, p, matryoshka_weights=(np.float32(1.0), np.float64(0.5)), **dims),
        L.mnrl_loss(a, p, matryoshka_weights=(1.0, 0.5), **dims),
        **TOL,
    )
    assert PWVA(p=np.float32(0.5)).p == 0.5


@pytest.mark.parametrize(
    "call",
    [
        lambda a, p, n: L.infonce_loss(a, p, temperature=True),
        lambda a, p, n: L.infonce_loss(a, p, temperature=np.bool_(True)),
        lambda a, p, n: L.mnrl_loss(a, p, n, hardness_mode="in_batch_negatives", hardness_strength=True),
        lambda a, p, n: L.edacse_loss(a, p, n, lam=True),
        lambda a, p, n: L.mnrl_loss(a, p, matryoshka_dims=(8, 4), matryoshka_weights=(True, 1.0)),
    ],
)
def test_bools_are_still_refused(call):
    with pytest.raises((TypeError, ValueError)):
        call(*_inputs(2))
