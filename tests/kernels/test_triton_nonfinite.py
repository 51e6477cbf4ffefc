"""Non-finite and extreme inputs on the Triton kernels (interpreter; the non-finite rules of docs/contracts.md).

Contract: a NaN/Inf in a *valid* embedding makes the loss of every row that sees it NaN
(never a finite number, never -inf); a NaN/Inf in a *padded* slot (mask False, tag
``TAG_PADDING``) has no influence at all: the loss and every gradient are exactly those of
the same call with that slot zeroed, and the padded slot's gradient is exactly zero.
Cosine similarity is scale-free: fp32 rows scaled by 1e30 give the same logits.

Runs in the Triton interpreter suite (``tests/kernels/test_triton_suite.py``): skipped without
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter suite runs with TRITON_INTERPRET=1 in its own process", allow_module_level=True)
pytest.importorskip("triton")

import fastcl.losses as L  # noqa: E402
from fastcl.ops import _triton  # noqa: E402
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, OwnPositives, poison_outputs  # noqa: E402
from fastcl.testing import assert_close, loss_terms  # noqa: E402

TRITON = _triton.BACKEND
LOSSES = {"supmpn": L.supmpn_loss, "supcon": L.supcon_loss}


def _batch(B=5, P=2, Q=3, d=24, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a, p, n = (torch.randn(*s, generator=gen).to(dtype) for s in ((B, d), (B, P, d), (B, Q, d)))
    return a, p, n


def _run(loss, a, p, n, **kw):
    leaves = [x.clone().requires_grad_() for x in (a, p, n)]
    with poison_outputs():
        out = LOSSES[loss](*leaves, temperature=0.1, reduction="none", backend="triton", **kw)
        out.sum().backward()
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("loss", ["supmpn", "supcon"])
def test_nonfinite_valid_negative_makes_its_rows_nan(loss, bad):
    a, p, n = _batch()
    n[0, 1, 3] = bad
    out, _ = _run(loss, a, p, n)
    # every anchor sees every negative (in-batch), so every row is NaN: never 0, never -inf
    assert torch.isnan(out).all(), out


def test_nonfinite_candidate_is_nan_exactly_for_the_rows_that_see_it():
    """The primitive: a NaN candidate tagged as row 2's own positive is excluded from row 2
    only; every other row's lse is NaN, row 2's is finite (a split that never sees it)."""
    gen = torch.Generator().manual_seed(1)
    B, N, d = 6, 40, 16
    a, c = torch.randn(B, d, generator=gen), torch.randn(N, d, generator=gen)
    tags = torch.full((N,), TAG_ALL, dtype=torch.int32)
    c[17, 5] = float("nan")
    tags[17] = 2
    problem = LSEProblem(a, (c, c[:0]), (tags, tags[:0]))
    with poison_outputs():
        lse, mean_logit = TRITON.forward(problem, torch.tensor(0.1))
    rows = torch.arange(B) != 2
    assert torch.isnan(lse[rows]).all() and torch.isnan(mean_logit[rows]).all()
    assert torch.isfinite(lse[2]) and torch.isfinite(mean_logit[2])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("similarity", ["cos", "dot"])
@pytest.mark.parametrize("loss", ["supmpn", "supcon"])
def test_nonfinite_padded_negative_has_no_influence(loss, similarity, bad):
    a, p, n = _batch(seed=2)
    neg_mask = torch.ones(n.shape[:2], dtype=torch.bool)
    neg_mask[0, 1] = neg_mask[3, 2] = False
    clean = n.clone()
    clean[~neg_mask] = 0
    dirty = n.clone()
    dirty[0, 1] = bad
    dirty[3, 2, 7] = bad
    want, want_grads = _run(loss, a, p, clean, neg_mask=neg_mask, similarity=similarity)
    got, got_grads = _run(loss, a, p, dirty, neg_mask=neg_mask, similarity=similarity)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert torch.isfinite(g).all()
        assert torch.equal(g, w)
    assert (got_grads[2][~neg_mask] == 0).all()


def test_nonfinite_padded_candidate_in_the_primitive():
    """Backward of the primitive with NaN/Inf in padded rows of both blocks, cosine: the
    padded rows' gradients are exactly zero and nothing else changes."""
    gen = torch.Generator().manual_seed(3)
    B, N0, N1, d = 7, 45, 20, 40
    a = torch.randn(B, d, generator=gen)
    blocks = [torch.randn(n, d, generator=gen) for n in (N0, N1)]
    tags = [torch.full((n,), TAG_ALL, dtype=torch.int32) for n in (N0, N1)]
    pads = [torch.tensor([0, 16, 33, 44]), torch.tensor([5, 19])]
    for t, idx in zip(tags, pads):
        t[idx] = TAG_PADDING
    tau, g = torch.tensor(0.1), torch.randn(B, generator=gen)

    def run(fill):
        bl = [b.clone() for b in blocks]
        for b, idx in zip(bl, pads):
            b[idx] = fill
        problem = LSEProblem(a, tuple(bl), tuple(tags))
        with poison_outputs():
            lse, ml = TRITON.forward(problem, tau)
            da, db = TRITON.backward(problem, tau, lse, g)
        return [lse, ml, da, *db]

    want = run(0.0)
    for fill in (float("nan"), float("inf")):
        got = run(fill)
        for x, y in zip(got, want):
            assert torch.equal(x, y)
        for db, idx in zip(got[3:], pads):
            assert (db[idx] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scales", [(1e30, 1e30), (1e30, 1e-5), (1e-5, 1e25)])
def test_cosine_primitive_is_scale_free(dtype, scales):
    """Anchors and candidates scaled by ``scales`` give the logits of the unscaled rows, and
    gradients scaled by the inverse: the raw product of two rows (1e60) would overflow
    fp32, ``|x|^-2`` (1e-60) would underflow. (The loss functions also need the torch-side
    positive logits, ``fastcl/ops/normalize.py``, to be scale-free; not this kernel's code.)"""
    gen = torch.Generator().manual_seed(4)
    B, P, extra, Q, d = 6, 2, 3, 30, 20
    a = torch.randn(B, d, generator=gen, dtype=torch.float64)
    c0 = torch.randn(extra + B * P, d, generator=gen, dtype=torch.float64)
    c1 = torch.randn(Q, d, generator=gen, dtype=torch.float64)
    tags0 = torch.cat(
        [torch.full((extra,), TAG_ALL, dtype=torch.int32), torch.arange(B, dtype=torch.int32).repeat_interleave(P)]
    )
    tags1 = torch.full((Q,), TAG_ALL, dtype=torch.int32)
    tau, g, d_pos = torch.tensor(0.1), torch.randn(B, generator=gen), torch.randn(B, P, generator=gen)

    def run(sa, sc):
        x = [t.to(dtype) * s for t, s in ((a, sa), (c0, sc), (c1, sc))]
        problem = LSEProblem(x[0], (x[1], x[2]), (tags0, tags1), True, 1e-8, OwnPositives(extra, P))
        with poison_outputs():
            lse, ml = TRITON.forward(problem, tau)
            da, (d0, d1) = TRITON.backward(problem, tau, lse, g, d_pos)
        return lse, ml, da * sa, d0 * sc, d1 * sc

    want = run(1.0, 1.0)
    got = run(*scales)
    # the same sums on scaled rows: a logit's d, a row's extra + B P + Q candidates, a candidate's
    # B anchors; logits 1/tau, an absolute error of lse and mean logits, a relative one of gradients
    terms = loss_terms(B, extra + B * P + Q, d)
    for name, x, y in zip(("lse", "mean_logit", "d anchor", "d block0", "d block1"), got, want):
        assert torch.isfinite(x).all(), name
        kw = dict(logit_scale=1 / float(tau)) if name.startswith("d ") else dict(magnitude=1 / float(tau))
        assert_close(name, x, y, dtype, terms=terms, **kw)
