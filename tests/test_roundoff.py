"""The round-off rules of ``fastcl.testing`` (``roundoff``, ``assert_roundoff``, ``assert_close``)
can pass and can fail: other summation orders pass, an error of 1e-3 relative in float32 (a few
ulps in 16 bits) or a missing term does not."""

from __future__ import annotations

import pytest
import torch

from fastcl.testing import (
    ROUNDOFF_FACTOR,
    assert_close,
    assert_roundoff,
    close_bound,
    close_tolerance,
    eps,
    grad_rtol,
    loss_terms,
    roundoff,
    value_tol,
)
from tests.helpers.roundoff import grad_term_size


def _orders(dtype, n=4096, rows=64, seed=0):
    """Row sums of ``n`` terms in float64 and three orders in ``dtype``: BLAS, pairwise, one
    element at a time in blocks of 7."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g, dtype=torch.float64)
    ref = x.sum(1)
    xd = x.to(dtype)
    blas = xd @ torch.ones(n, dtype=dtype)
    pairwise = xd.sum(1)
    blocks = torch.zeros(rows, dtype=dtype)
    for j in range(0, n, 7):
        blocks = blocks + xd[:, j : j + 7].sum(1)
    return xd.double().sum(1), (blas, pairwise, blocks), x.abs().max().item(), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_other_orders_pass(dtype):
    want, orders, _, _ = _orders(dtype)
    for got in orders:  # terms of size ~1 (randn), so magnitude = max |want| ~ sqrt(n) covers them
        assert_roundoff(got.double(), want, dtype, terms=4096)


def test_an_error_of_1e_3_fails_in_float32():
    want, (got, *_), _, _ = _orders(torch.float32)
    with pytest.raises(AssertionError, match="round-off bound of torch.float32"):
        assert_roundoff(got.double() * (1 + 1e-3), want, torch.float32, terms=4096)
    with pytest.raises(AssertionError):  # one element off by 1e-3 of the largest
        bad = got.double().clone()
        bad[3] += 1e-3 * want.abs().max()
        assert_roundoff(bad, want, torch.float32, terms=4096)


def test_the_bound_is_the_formula():
    assert roundoff(torch.float32, 100, 2.0) == ROUNDOFF_FACTOR * eps(torch.float32) * 2.0 * 10
    assert eps(torch.bfloat16) == 2.0**-7 and eps(torch.float64) == 2.0**-52


def test_sixteen_bit_outputs_add_their_rounding():
    want = torch.linspace(-3, 3, 101, dtype=torch.float64)
    got = want.to(torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_roundoff(got.double(), want, torch.float32)
    assert_roundoff(got.double(), want, torch.float32, out_dtype=torch.bfloat16)


# ----------------------------------------------------------------------- assert_close


def _infonce(a, c, tau, order="gemm"):
    """Mean InfoNCE loss and its gradients: cosine logits of ``a`` against ``c`` (row i's
    positive is ``c[i]``), the sums in ``a``'s dtype (float32 for 16-bit inputs), in two orders:
    one GEMM, or the coordinates in 4 chunks added last to first."""
    cd = torch.float64 if a.dtype == torch.float64 else torch.float32
    a, c = (x.detach().to(cd).requires_grad_() for x in (a, c))
    an, cn = torch.nn.functional.normalize(a, dim=-1), torch.nn.functional.normalize(c, dim=-1)
    if order == "gemm":
        s = an @ cn.T
    else:
        parts = [x @ y.T for x, y in zip(an.chunk(4, dim=1), cn.chunk(4, dim=1))]
        s = sum(reversed(parts[:-1]), parts[-1])
    logits = s / tau
    loss = (torch.logsumexp(logits, 1) - logits.diagonal()).mean()
    return (loss, *torch.autograd.grad(loss, (a, c)))


B_, D_, TAU_ = 64, 256, 0.05
TERMS_ = loss_terms(B_, B_, D_)


def _close_all(got, want, dtype, inputs):
    """The loss and its two gradients against float64 within fastcl.testing's derived bound."""
    out = [x.to(dtype) if dtype in (torch.float16, torch.bfloat16) else x for x in got]  # stored in dtype
    assert_close("loss", out[0].double(), want[0], dtype, terms=TERMS_, magnitude=1 / TAU_)
    # a gradient's terms: a mean's row weight 1/B times 2 / (tau |x|), which cancel where a
    # row's softmax is close to its positive's indicator
    term = grad_term_size(inputs, similarity="cos", tau=TAU_, row_weight=1 / B_)
    for name, g, w in zip(("d a", "d c"), out[1:], want[1:]):
        assert_close(name, g.double(), w, dtype, terms=TERMS_, magnitude=term / TAU_, logit_scale=1 / TAU_)


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B_, D_, generator=g)
    c = torch.randn(B_, D_, generator=g)  # a loss of ~log B, far from 0: a relative error shows
    return a.to(dtype), c.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("order", ["gemm", "chunks"])
def test_close_accepts_other_orders(dtype, order):
    a, c = _inputs(dtype)
    want = _infonce(a.double(), c.double(), TAU_)
    _close_all(_infonce(a, c, TAU_, order), want, dtype, (a, c))


# A wrong result by ``rel`` relative: 1e-3 in float32 (~8000 eps); in 16 bits, whose storage
# alone is ``roundoff(dtype)`` = 4 eps relative, about 6 to 10 eps (5e-2 bfloat16, 1e-2 float16).
WRONG = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@pytest.mark.parametrize("dtype", list(WRONG))
def test_close_rejects_a_scale_error(dtype):
    a, c = _inputs(dtype)
    want = _infonce(a.double(), c.double(), TAU_)
    got = _infonce(a, c, TAU_)
    for i in range(3):  # the loss, then each gradient, off by WRONG relative
        bad = [x * (1 + WRONG[dtype]) if j == i else x for j, x in enumerate(got)]
        with pytest.raises(AssertionError, match="bound"):
            _close_all(bad, want, dtype, (a, c))


def test_close_rejects_a_missing_term_in_float32():
    """The loss without one candidate (the last column of the log-sum-exp) and a gradient with
    one row's contribution dropped both fail."""
    a, c = _inputs(torch.float32)
    want = _infonce(a.double(), c.double(), TAU_)
    loss, da, dc = _infonce(a, c, TAU_)
    an, cn = torch.nn.functional.normalize(a, dim=-1), torch.nn.functional.normalize(c, dim=-1)
    logits = an @ cn.T / TAU_
    short = (torch.logsumexp(logits[:, :-1], 1) - logits.diagonal()).mean()  # one term fewer
    with pytest.raises(AssertionError, match="bound"):
        _close_all((short.detach(), da, dc), want, torch.float32, (a, c))
    da_bad = da.clone()
    da_bad[5] = 0  # one anchor's gradient missing
    with pytest.raises(AssertionError, match="bound"):
        _close_all((loss, da_bad, dc), want, torch.float32, (a, c))


def test_close_bound_is_the_formula():
    """``close_bound`` is ``rtol |ref|_F + atol sqrt(n)`` of ``close_tolerance``: float32 sums,
    plus a 16-bit dtype's storage; the default terms are the shape's dimensions."""
    ref = torch.full((4, 9), 2.0, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        atol, rtol = close_tolerance(dtype, 13, 2.0)
        assert close_bound(ref, dtype) == pytest.approx(rtol * 12 + atol * 6)
    assert close_tolerance(torch.bfloat16, 13, 2.0)[1] == roundoff(torch.float32, 13) + roundoff(torch.bfloat16)
    # at scale the terms are charged at their own sizes: the logit's d products at 1/tau
    atol, rtol = value_tol(torch.float32, B=8, N=16, d=32, logit_scale=20.0)
    assert atol == pytest.approx(roundoff(torch.float32, 32, 20.0) + roundoff(torch.float32, 24))
    assert rtol == pytest.approx(roundoff(torch.float32, 24))


def test_at_scale_bounds_reject_a_float32_error_of_1e_3():
    """At a GPU grid size (B = N = 16384, d = 768, tau = 0.05) a 1e-3 relative error in float32
    fails both the value's and the gradients' bound; in bfloat16 they stay above its rounding."""
    shape = dict(B=16384, N=16384, d=768, logit_scale=20.0)
    assert grad_rtol(torch.float32, **shape) < 1e-3 / 2
    atol, rtol = value_tol(torch.float32, **shape)
    loss = 10.0  # a typical InfoNCE value at that size
    assert atol + rtol * loss < 1e-3 * loss / 2
    assert grad_rtol(torch.bfloat16, **shape) > roundoff(torch.bfloat16)
