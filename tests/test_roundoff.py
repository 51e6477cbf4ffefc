"""The round-off rule of ``fastcl.testing`` (``roundoff``, ``assert_roundoff``) can pass and
can fail: other summation orders pass, an error of 1e-3 relative in float32 does not."""

from __future__ import annotations

import pytest
import torch

from fastcl.testing import ROUNDOFF_FACTOR, assert_roundoff, eps, roundoff


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
