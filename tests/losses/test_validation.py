"""Clear errors for bad input, raised before any compute."""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L

A, P, N = torch.randn(4, 8), torch.randn(4, 2, 8), torch.randn(4, 3, 8)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: L.supmpn_loss(A[0], P, N), ValueError, "anchor must have shape"),
        (lambda: L.supmpn_loss(A, P[:, 0], N), ValueError, "positives must have shape"),
        (lambda: L.supmpn_loss(A, P[:3], N), ValueError, r"positives must have shape \[B=4"),
        (lambda: L.supmpn_loss(A, torch.randn(4, 2, 7), N), ValueError, "d=8"),
        (lambda: L.supmpn_loss(A, P, torch.randn(4, 3, 5)), ValueError, "negatives must have shape"),
        (lambda: L.supmpn_loss(A, P, N[:, :, None]), ValueError, "negatives must have shape"),
        (lambda: L.supmpn_loss(A, torch.randn(4, 0, 8)), ValueError, "P = 0"),
        (lambda: L.supmpn_loss(torch.randn(0, 8), torch.randn(0, 1, 8)), ValueError, "non-empty"),
        (lambda: L.supmpn_loss(A, P.double(), N), TypeError, "one dtype"),
        (lambda: L.supmpn_loss(A.long(), P.long()), TypeError, "float16, bfloat16"),
        (
            lambda: L.supmpn_loss(A, P, N, pos_mask=torch.ones(4, 3, dtype=torch.bool)),
            ValueError,
            "pos_mask must have shape",
        ),
        (lambda: L.supmpn_loss(A, P, N, neg_mask=torch.ones(4, 3)), TypeError, "torch.bool"),
        (lambda: L.supmpn_loss(A, P, neg_mask=torch.ones(4, 3, dtype=torch.bool)), ValueError, "without negatives"),
        (
            lambda: L.supmpn_loss(A, P, N, pos_mask=torch.zeros(4, 2, dtype=torch.bool)),
            ValueError,
            "no anchor has a valid positive",
        ),
        (lambda: L.supmpn_loss(A, P, N, temperature=0.0), ValueError, "temperature"),
        (lambda: L.supmpn_loss(A, P, N, temperature=-1.0), ValueError, "temperature"),
        (lambda: L.supmpn_loss(A, P, N, temperature=float("nan")), ValueError, "temperature"),
        (lambda: L.supmpn_loss(A, P, N, temperature=torch.tensor(-0.1)), ValueError, "temperature"),
        (lambda: L.supmpn_loss(A, P, N, temperature=torch.tensor([0.1, 0.2])), ValueError, "0-d"),
        (lambda: L.supmpn_loss(A, P, N, temperature="0.1"), TypeError, "temperature"),
        (lambda: L.supmpn_loss(A, P, N, reduction="avg"), ValueError, "reduction"),
        (lambda: L.supmpn_loss(A, P, N, similarity="l2"), ValueError, "similarity"),
        (lambda: L.supmpn_loss(A, P, N, own_positives="keep"), ValueError, "own_positives"),
        (lambda: L.mnrl_loss(A, P, N), ValueError, "positive must have shape"),
        (lambda: L.infonce_loss(A, A[:3]), ValueError, "positives must have shape"),
        (lambda: L.edacse_loss(A, A, A, lam="x"), TypeError, "lam"),
        (lambda: L.grouped_cosine_loss(A, A, group_size=3), ValueError, "does not divide"),
        (lambda: L.grouped_cosine_loss(A, A[:, :4], group_size=4), ValueError, "same shape"),
        (lambda: L.grouped_cosine_loss(A, A, group_size=0), TypeError, "group_size"),
        (lambda: L.gclsr_loss(A, A, A, A, group_size=5), ValueError, "does not divide"),
        (lambda: L.supcon_pool_loss(A, A, torch.tensor([[0], [1], [2], [9]])), ValueError, "pos_index must be in"),
        (lambda: L.supcon_pool_loss(A, A, torch.tensor([[0.0]] * 4)), TypeError, "integer"),
        (lambda: L.supmpn_loss(A, P, N, backend="nope"), RuntimeError, "unknown backend"),
        (lambda: L.SupMPNLoss(temperature=0), ValueError, "temperature"),
    ],
)
def test_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_finite_check_is_opt_in(monkeypatch):
    bad = A.clone()
    bad[0, 0] = float("nan")
    L.infonce_loss(bad, A)  # no check by default: no host sync
    monkeypatch.setenv("FASTCL_CHECK_FINITE", "1")
    with pytest.raises(ValueError, match="inf or NaN"):
        L.infonce_loss(bad, A)


def test_pool_loss_takes_minus_one_in_padded_slots():
    """A ``pos_index`` slot that ``pos_mask`` marks as padding is not read: ``-1`` (the usual
    padding index) is fine there and the loss equals the one with any valid index in the slot;
    a ``-1`` in a valid slot is still refused."""
    g = torch.Generator().manual_seed(0)
    a, c = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g)
    mask = torch.tensor([[True, True], [True, False], [True, False], [False, False]])
    padded = torch.tensor([[0, 1], [2, -1], [3, -1], [-1, -1]])
    filled = torch.tensor([[0, 1], [2, 5], [3, 0], [4, 4]])
    for backend in ("reference", "torch"):
        got = L.supcon_pool_loss(a, c, padded, pos_mask=mask, backend=backend)
        want = L.supcon_pool_loss(a, c, filled, pos_mask=mask, backend=backend)
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="pos_index must be in"):
        L.supcon_pool_loss(a, c, padded, pos_mask=torch.ones(4, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="pos_index must be in"):
        L.supcon_pool_loss(a, c, padded)


def test_no_valid_positive_raises_on_cpu_and_is_nan_without_a_host_read():
    """A CPU mask is read: no valid positive anywhere raises. A mask on a GPU is not read on
    the host (no sync, capturable in a CUDA graph): the reduction's weights make such a loss
    NaN, never a finite 0 (here the device rule is checked on a 'meta' mask, which cannot be
    read at all, and the weights on the CPU)."""
    import fastcl.losses as L
    from fastcl import _checks
    from fastcl.ops.head import reduction_weights

    a, p = torch.randn(4, 8), torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="no anchor has a valid positive"):
        L.supmpn_loss(a, p, pos_mask=torch.zeros(4, 2, dtype=torch.bool))
    _checks.check_some_positive(torch.zeros(4, 2, dtype=torch.bool, device="meta"))  # no read, no error
    none = torch.zeros(4, dtype=torch.bool)
    for reduction in ("mean", "sum"):
        assert reduction_weights(none, reduction).isnan().all()
        assert not reduction_weights(torch.tensor([True, False, True, False]), reduction).isnan().any()
    assert (reduction_weights(none, "none") == 0).all()
    assert not reduction_weights(torch.ones(4, dtype=torch.bool), "sum", maybe_empty=False).isnan().any()
