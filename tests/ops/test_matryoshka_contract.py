"""The Matryoshka contract (``LSEProblem.dims``): validation, and every backend that takes
dims against an independent float64 oracle (tests/helpers/matryoshka.py)."""

from __future__ import annotations

import pytest
import torch

from fastcl.ops import dispatch
from fastcl.ops.backend import dims_reason
from fastcl.ops.contract import LSEProblem
from tests.helpers.backends import backends_under_test, device_under_test, require
from tests.helpers.matryoshka import check_backend, prefix_problem


@pytest.mark.parametrize("dims", [(), (8, 8), (0,), (9,), (4, 12)])
def test_bad_dims_raise(dims):
    a = torch.randn(3, 8)
    with pytest.raises(ValueError, match="matryoshka dims"):
        LSEProblem(a, (a, a[:0]), (torch.full((3,), -1, dtype=torch.int32),) * 2, dims=dims)


def test_prefix_is_a_view_of_the_first_coordinates():
    prob = prefix_problem(4, 5, 3, 10, (10, 6, 2))
    sub = prob.prefix(1)
    assert sub.dims is None and sub.dim == 6 and prob.num_prefixes == 3
    assert sub.anchor.data_ptr() == prob.anchor.data_ptr() and torch.equal(sub.blocks[1], prob.blocks[1][:, :6])


@pytest.mark.parametrize("cosine", [True, False])
@pytest.mark.parametrize("own", [0, 2])
@pytest.mark.parametrize("dims", [(16,), (16, 8, 3), (5, 16, 1)])
def test_reference_matches_oracle(cosine, own, dims):
    prob = prefix_problem(7, 9, 6, 16, dims, cosine=cosine, own=own, generator=torch.Generator().manual_seed(1))
    check_backend(dispatch.get("reference"), prob, 0.2)


@pytest.fixture(params=backends_under_test())
def backend(request):
    require(request.param)
    return request.param


@pytest.mark.parametrize("cosine", [True, False])
@pytest.mark.parametrize("own", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backend_matches_oracle(backend, cosine, own, dtype):
    """Odd sizes, padded and self-excluded slots, an unsorted dims tuple, folded own positives."""
    dev = device_under_test()
    prob = prefix_problem(
        11, 13, 7, 37, (37, 20, 33, 4), dtype=dtype, device=dev, cosine=cosine, own=own,
        generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    reasons = dispatch.reasons(backend, prob)
    if reasons == [dims_reason(backend)]:
        pytest.skip(f"{backend} does not take matryoshka dims yet")
    check_backend(dispatch.get(backend), prob, 0.1)
