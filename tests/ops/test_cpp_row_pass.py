"""The cpp fused step's row pass against the float64 reference, on the paths it chooses between.

Cosine logits lie in [-1/tau, 1/tau]: for 1/tau <= 25 (float32) the kernel uses 1/tau as the
row's shift instead of its max (one pass over the row instead of two), and it keeps the row
factor ``r = g / (|a| tau sum_p)`` of the weights X = r * Q out of the row, applying it to the
GEMMs' operands instead. Each case below reaches one of those choices: the bounded shift with
rows whose logits all sit at the bottom of the range (sum_p ~ exp(-2/tau), r large), the exact
max (small tau, dot products), and rows whose r is zero (no valid positive) or NaN.
"""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L
from fastcl.testing import assert_roundoff
from tests.helpers.backends import require


def _grads(fn, tensors, backend):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves, backend=backend)
    return out.detach(), torch.autograd.grad(out.double().sum(), leaves)


def _check(fn, tensors, logit_scale):
    """float32 against the float64 reference. Each logit is a dot product of ``d`` terms, each
    log-sum-exp a sum over ``N`` candidates, a candidate's gradient a sum over ``B`` anchors: the
    logits carry ``eps * logit_scale`` of round-off, which is an absolute error of the loss and a
    relative one of the softmax weights, hence of the gradients."""
    require("cpp")
    got, got_g = _grads(fn, tensors, "cpp")
    ref, ref_g = _grads(fn, [t.double() for t in tensors], "reference")
    a = tensors[0]
    terms = a.shape[-1] + a.shape[0] * sum(t[0].numel() // t.shape[-1] for t in tensors[1:]) + a.shape[0]
    assert_roundoff(got.double(), ref, torch.float32, terms=terms, magnitude=logit_scale, msg="loss")
    for i, (g, r) in enumerate(zip(got_g, ref_g)):
        scale = r.abs().max().item() * logit_scale
        assert_roundoff(g.double(), r, torch.float32, terms=terms, magnitude=scale, msg=f"grad {i}")


def _inputs(B=6, P=3, Q=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, d, generator=g), torch.randn(B, P, d, generator=g), torch.randn(B, Q, d, generator=g)


@pytest.mark.parametrize("tau", [0.01, 0.03, 0.04, 0.05, 1.0])
@pytest.mark.parametrize("loss", ["supmpn", "supcon"])
def test_values_and_grads_across_temperatures(loss, tau):
    fn = getattr(L, f"{loss}_loss")
    _check(lambda a, p, n, backend: fn(a, p, n, temperature=tau, backend=backend), _inputs(), 1 / tau)


@pytest.mark.parametrize("tau", [0.04, 0.05])
def test_rows_at_the_bottom_of_the_bound(tau):
    # anchor 0 points away from every candidate: its logits all lie near -1/tau, so with the
    # shift 1/tau every p is ~exp(-2/tau) and the row factor r is ~exp(2/tau) (finite, large);
    # anchor 1 is tiny (clamped norm): a larger r again. Its gradient is scaled by 1/eps and
    # dominates the bound, so the other rows are checked far more loosely than float32 allows
    # (the kernel without the bound carried ~1e-3 of relative error there too).
    a, p, n = _inputs(B=4, P=2, Q=2, d=8)
    c = torch.randn(8, generator=torch.Generator().manual_seed(1))
    p[:], n[:] = c, c
    p[:, :, 0] += torch.linspace(0, 0.1, 2)  # not all equal
    a[0] = -c
    a[1] = c * 1e-9
    fn = lambda a, p, n, backend: L.supmpn_loss(a, p, n, temperature=tau, backend=backend)  # noqa: E731
    _check(fn, (a, p, n), 1 / tau)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_rows_without_gradient(reduction):
    # row 1 has no valid positive: weight 0, g = 0, so r = 0 and X is formed in the row instead
    a, p, n = _inputs()
    pos_mask = torch.ones(6, 3, dtype=torch.bool)
    pos_mask[1] = False

    def fn(a, p, n, backend):
        return L.supcon_loss(a, p, n, pos_mask=pos_mask, reduction=reduction, temperature=0.05, backend=backend)

    _check(fn, (a, p, n), 1 / 0.05)


def test_dot_product_logits_take_the_row_max():
    # no cosine bound: logits up to ~40, the exact max is needed for exp not to overflow
    a, p, n = _inputs(d=16)
    _check(
        lambda a, p, n, backend: L.mnrl_loss(a, p[:, 0], n, temperature=0.5, similarity="dot", backend=backend),
        (a * 2, p * 2, n * 2),
        40.0,
    )


def test_nan_anchor_row_gives_nan_row():
    a, p, n = _inputs()
    a[3, 5] = float("nan")
    fn = lambda a, p, n, backend: L.supmpn_loss(a, p, n, temperature=0.05, reduction="mean", backend=backend)  # noqa: E731
    require("cpp")
    out, grads = _grads(fn, (a, p, n), "cpp")
    assert torch.isnan(out)
    assert torch.isnan(grads[0][3]).all()
