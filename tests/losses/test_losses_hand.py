"""Tiny cases whose expected numbers are derived by hand here, from the formulas in docs/losses.md.

The vectors are chosen so every cosine is 1, 0, -1 or 1/sqrt(2); the expected losses are
written out with ``math`` from those cosines, never computed by fastcl's code.
"""

from __future__ import annotations

import math

import pytest
import torch

import fastcl.losses as L
from tests.helpers.roundoff import assert_loss_roundoff, assert_tau_grad_roundoff

E = math.e
R2 = 1 / math.sqrt(2)
BACKENDS = ["reference", "torch"]


def t(x):
    return torch.tensor(x, dtype=torch.float64)


# float64 against the same formula in math's float64: a logit's d = 2 coordinates, a row's up to
# 4 candidates and a column's 2 anchors (symmetric), the mean over 2 rows
TERMS = 2 + 4 + 2 + 2


def _hand(got, want, logit_scale: float = 1.0) -> None:
    """A loss against its hand-derived value: logits of size ``logit_scale`` (``1/tau`` for cosine)."""
    assert_loss_roundoff(
        got, torch.as_tensor(want, dtype=torch.float64), torch.float64, terms=TERMS, logit_scale=logit_scale
    )


# Two anchors along the axes, one positive and one negative each (d = 2, tau = 1).
A = t([[1.0, 0.0], [0.0, 1.0]])
POS = t([[[2.0, 0.0]], [[0.0, 3.0]]])  # cos(a0,p0)=1 cos(a0,p1)=0 ; cos(a1,p0)=0 cos(a1,p1)=1
NEG = t([[[-1.0, 0.0]], [[1.0, 1.0]]])  # cos(a0,n0)=-1 cos(a0,n1)=1/sqrt2 ; cos(a1,n0)=0 cos(a1,n1)=1/sqrt2


@pytest.mark.parametrize("backend", BACKENDS)
def test_supmpn_eq7(backend):
    # R_i = every candidate except anchor i's own positive
    r0 = math.exp(0) + math.exp(-1) + math.exp(R2)
    r1 = math.exp(0) + math.exp(0) + math.exp(R2)
    term0 = -1 + math.log(E + r0)
    term1 = -1 + math.log(E + r1)
    got = L.supmpn_loss(A, POS, NEG, temperature=1.0, backend=backend)
    _hand(got, (term0 + term1) / 2)
    none = L.supmpn_loss(A, POS, NEG, temperature=1.0, reduction="none", backend=backend)
    _hand(none, [term0, term1])
    total = L.supmpn_loss(A, POS, NEG, temperature=1.0, reduction="sum", backend=backend)
    _hand(total, term0 + term1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_supcon_includes_own_positive(backend):
    lse0 = math.log(E + 1 + math.exp(-1) + math.exp(R2))
    lse1 = math.log(1 + E + 1 + math.exp(R2))
    got = L.supcon_loss(A, POS, NEG, temperature=1.0, backend=backend)
    _hand(got, ((lse0 - 1) + (lse1 - 1)) / 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_scales_logits(backend):
    tau = 0.5  # logits double
    lse0 = math.log(math.exp(2) + 1 + math.exp(-2) + math.exp(2 * R2))
    lse1 = math.log(1 + math.exp(2) + 1 + math.exp(2 * R2))
    got = L.supcon_loss(A, POS, NEG, temperature=tau, backend=backend)
    _hand(got, ((lse0 - 2) + (lse1 - 2)) / 2, logit_scale=1 / tau)


@pytest.mark.parametrize("backend", BACKENDS)
def test_supmpn_other_own_positives(backend):
    # One anchor, two own positives (cos 1 and 0) and one negative (cos -1).
    a = t([[1.0, 0.0]])
    pos = t([[[1.0, 0.0], [0.0, 1.0]]])
    neg = t([[[-1.0, 0.0]]])
    # eq. 7: R = exp(-1) only (own positives are not in the denominator)
    eq7 = (-1 + math.log(E + math.exp(-1)) + (0 + math.log(1 + math.exp(-1)))) / 2
    # released code: the other own positive stays with logit 0, adding exp(0) = 1
    code = (-1 + math.log(E + math.exp(-1) + 1) + (0 + math.log(1 + math.exp(-1) + 1))) / 2
    got = L.supmpn_loss(a, pos, neg, temperature=1.0, backend=backend)
    got_code = L.supmpn_loss(a, pos, neg, temperature=1.0, own_positives="zero_logit", backend=backend)
    _hand(got, eq7)
    _hand(got_code, code)


@pytest.mark.parametrize("backend", BACKENDS)
def test_supmpn_empty_denominator_is_zero(backend):
    # B = 1, Q = 0: R_i is empty, so each term is -l + log(exp(l)) = 0 (docs/contracts.md, SupMPN).
    got = L.supmpn_loss(t([[1.0, 2.0]]), t([[[3.0, -1.0]]]), temperature=0.05, backend=backend)
    assert got.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_masks_remove_slots_and_anchors(backend):
    # Anchor 1 has no valid positive: the mean runs over anchor 0 only. n1 is padding.
    pos_mask = torch.tensor([[True], [False]])
    neg_mask = torch.tensor([[True], [False]])
    # anchor 0: candidates = p0 (own), n0 ; p1 is padding too (its slot is masked)
    expected = -1 + math.log(E + math.exp(-1))
    got = L.supcon_loss(A, POS, NEG, pos_mask=pos_mask, neg_mask=neg_mask, temperature=1.0, backend=backend)
    _hand(got, expected)
    rows = L.supcon_loss(
        A, POS, NEG, pos_mask=pos_mask, neg_mask=neg_mask, temperature=1.0, reduction="none", backend=backend
    )
    assert rows[1].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_dot_similarity(backend):
    # Liao: raw dot products. <a0,p0>=2 <a0,p1>=0 <a0,n0>=-1 <a0,n1>=1 ; <a1,.> = 0,3,0,1
    lse0 = math.log(math.exp(2) + 1 + math.exp(-1) + E)
    lse1 = math.log(1 + math.exp(3) + 1 + E)
    got = L.supcon_loss(A, POS, NEG, temperature=1.0, similarity="dot", backend=backend)
    _hand(got, ((lse0 - 2) + (lse1 - 3)) / 2, logit_scale=3.0)  # dot products up to 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_mnrl_is_cross_entropy_over_positives_and_negatives(backend):
    # Same numbers as SupCon with P = 1: row i against [p0, p1, n0, n1].
    lse0 = math.log(E + 1 + math.exp(-1) + math.exp(R2))
    lse1 = math.log(1 + E + 1 + math.exp(R2))
    got = L.mnrl_loss(A, POS[:, 0], NEG[:, 0], temperature=1.0, backend=backend)
    _hand(got, ((lse0 - 1) + (lse1 - 1)) / 2)
    got_2d = L.mnrl_loss(A, POS[:, 0], NEG, temperature=1.0, backend=backend)
    _hand(got_2d, got.item())


@pytest.mark.parametrize("backend", BACKENDS)
def test_infonce_and_symmetric(backend):
    a = t([[1.0, 0.0], [0.0, 1.0]])
    p = t([[1.0, 1.0], [0.0, 2.0]])  # cos: a0p0=1/sqrt2 a0p1=0 a1p0=1/sqrt2 a1p1=1
    row0 = -R2 + math.log(math.exp(R2) + 1)
    row1 = -1 + math.log(math.exp(R2) + E)
    # columns: p0 against a0 (own, cos 1/sqrt2), a1 (1/sqrt2); p1 against a0 (0), a1 (own, 1)
    col0 = -R2 + math.log(2 * math.exp(R2))
    col1 = -1 + math.log(1 + E)
    got = L.infonce_loss(a, p, temperature=1.0, backend=backend)
    _hand(got, (row0 + row1) / 2)
    sym = L.infonce_loss(a, p, temperature=1.0, symmetric=True, backend=backend)
    _hand(sym, 0.5 * ((row0 + row1) / 2 + (col0 + col1) / 2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_edacse(backend):
    a = t([[1.0, 0.0], [0.0, 1.0]])
    drop = t([[1.0, 0.0], [0.0, 1.0]])  # cos 1 on the diagonal, 0 off it
    aug = t([[-1.0, 0.0], [0.0, 1.0]])  # cos a0.aug0=-1, a0.aug1=0, a1.aug0=0, a1.aug1=1
    first = -1 + math.log(E + 1)
    second = ((1 + math.log(math.exp(-1) + 1)) + (-1 + math.log(1 + E))) / 2
    got = L.edacse_loss(a, drop, aug, lam=0.6, temperature=1.0, backend=backend)
    _hand(got, first + 0.6 * second)


@pytest.mark.parametrize("backend", BACKENDS)
def test_supcon_pool_shared_positive(backend):
    # Two anchors share candidate 0 as their positive; candidate 2 is padding.
    a = t([[1.0, 0.0], [1.0, 1.0]])
    cands = t([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    pos_index = torch.tensor([[0], [0]])
    cand_mask = torch.tensor([True, True, False])
    # anchor 0: cos = 1, 0 ; anchor 1: cos = 1/sqrt2, 1/sqrt2
    row0 = -1 + math.log(E + 1)
    row1 = -R2 + math.log(2 * math.exp(R2))
    got = L.supcon_pool_loss(a, cands, pos_index, cand_mask=cand_mask, temperature=1.0, backend=backend)
    _hand(got, (row0 + row1) / 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_gradient(backend):
    # InfoNCE, B = 2: dL/dtau = mean_i (s_ii - sum_j p_ij s_ij) / tau^2
    a = t([[1.0, 0.0], [0.0, 1.0]])
    p = t([[1.0, 1.0], [0.0, 2.0]])
    tau = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    sims = [[R2, 0.0], [R2, 1.0]]
    grad = 0.0
    for i in range(2):
        w = [math.exp(s / 0.5) for s in sims[i]]
        mean_s = sum(wj * s for wj, s in zip(w, sims[i])) / sum(w)
        grad += (sims[i][i] - mean_s) / 0.5**2 / 2
    L.infonce_loss(a, p, temperature=tau, backend=backend).backward()
    # the mean (rows = 1) of logit differences of size 1/tau, times 1/tau
    want = torch.tensor(grad, dtype=torch.float64)
    assert_tau_grad_roundoff(tau.grad, want, torch.float64, terms=TERMS, logit_scale=1 / 0.5, rows=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_cosine_and_gclsr(backend):
    h = t([[1.0, 0.0, 0.0, 1.0]])
    z = t([[1.0, 0.0, 1.0, 0.0]])  # group cosines: 1 and 0
    _hand(L.grouped_cosine_loss(h, z, group_size=2, backend=backend), -0.5)
    _hand(L.grouped_cosine_loss(h, z, group_size=4, backend=backend), -0.5)  # SimSiam: cos = 1/2
    h2 = t([[0.0, 1.0, 0.0, 1.0]])
    z2 = t([[0.0, 2.0, 0.0, -1.0]])  # L(h1, z2): groups (1,0)v(0,2)=0 ; (0,1)v(0,-1)=-1 -> 0.5
    # L(h2, z1): (0,1)v(1,0)=0 ; (0,1)v(1,0)=0 -> 0
    got = L.gclsr_loss(h, z, h2, z2, group_size=2, backend=backend)
    _hand(got, 0.5 * (0.5 + 0.0))
