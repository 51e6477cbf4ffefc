"""Matryoshka dims on the Triton kernels (the ``PREFIXES`` path of ``kernels/lse_fwd.py`` and
``kernels/lse_bwd.py``), in the interpreter.

Values and gradients against the independent float64 oracle (``tests/helpers/matryoshka.py``)
on shapes that cross the interpreter's tile (16), feature-chunk (32), split and dS-chunk
(32 columns) edges, with ``d`` and the prefix lengths off every multiple; every dtype,
cosine and dot, folded own positives, unsorted dims and K = 1..5; empty rows; non-finite
inputs (a NaN reaches exactly the prefixes that contain its coordinate; a padded slot has no
influence); the refusal beyond 8 prefixes. Outputs and scratch are poisoned with NaN.
Runs in the Triton interpreter suite (``tests/kernels/test_triton_suite.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter suite runs with TRITON_INTERPRET=1 in its own process", allow_module_level=True)
pytest.importorskip("triton")

from benchmarks.triton_tools import aot  # noqa: E402
from fastcl.kernels import _common  # noqa: E402
from fastcl.ops import _triton, dispatch  # noqa: E402
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, poison_outputs  # noqa: E402
from tests.helpers.matryoshka import check_backend, check_roundoff, oracle, prefix_problem  # noqa: E402

TRITON = _triton.BACKEND


def _check(prob: LSEProblem, tau: float = 0.1) -> None:
    """16-bit: inputs are exact in float64, so the error is the kernels' (float32 accumulation,
    gradients rounded to the input dtype): tests/helpers/matryoshka.py bounds both."""
    assert not TRITON.unsupported(prob), TRITON.unsupported(prob)
    with poison_outputs():
        check_backend(TRITON, prob, tau)


CASES = [  # dims (d = 45 unless the dims say more), dtype
    ((45,), torch.float32),
    ((45, 7), torch.float64),
    ((20, 45, 3), torch.float32),
    ((33, 1, 17, 40), torch.bfloat16),
    ((40, 6, 32, 12, 45), torch.float16),
    ((16, 33), torch.float32),  # the largest prefix < d: the tail gets no gradient
]


@pytest.mark.parametrize("own", [0, 2])
@pytest.mark.parametrize("cosine", [True, False], ids=["cos", "dot"])
@pytest.mark.parametrize("dims, dtype", CASES, ids=[f"K{len(c[0])}-{str(c[1])[6:]}" for c in CASES])
def test_matches_oracle(dims, dtype, cosine, own):
    gen = torch.Generator().manual_seed(len(dims) * 10 + own)
    # block 0: 2 * 19 own positives + 40 rows = 3 dS chunks and 3 forward splits
    prob = prefix_problem(19, 40, 9, 45, dims, dtype=dtype, cosine=cosine, own=own, generator=gen)
    _check(prob, 0.1 if cosine else 0.5)


def test_empty_rows_give_minus_inf():
    """Row 0 sees no candidate (every block-0 tag is 0, block 1 is padding): lse -inf, mean 0, no gradient."""
    gen = torch.Generator().manual_seed(3)
    a, c0, c1 = (torch.randn(n, 21, generator=gen) for n in (5, 18, 4))
    tags = (torch.zeros(18, dtype=torch.int32), torch.full((4,), TAG_PADDING, dtype=torch.int32))
    prob = LSEProblem(a, (c0, c1), tags, dims=(21, 5, 13))
    with poison_outputs():
        lse, mean = TRITON.forward(prob, torch.tensor(0.2))
    assert (lse[:, 0] == float("-inf")).all() and (mean[:, 0] == 0).all()
    assert torch.isfinite(lse[:, 1:]).all()
    _check(prob, 0.2)


def _nan_problem(dtype=torch.float32, cosine=True):
    gen = torch.Generator().manual_seed(4)
    a, c0 = torch.randn(6, 30, generator=gen).to(dtype), torch.randn(20, 30, generator=gen).to(dtype)
    tags = (torch.full((20,), TAG_ALL, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
    tags[0][7] = 2  # candidate 7 is left out of row 2 only
    return a, c0, tags


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("cosine", [True, False], ids=["cos", "dot"])
def test_nonfinite_reaches_exactly_the_prefixes_that_contain_it(cosine, bad):
    """A NaN/Inf at coordinate 12 of a valid candidate: prefixes longer than 12 are NaN in
    every row that sees it (not row 2, which excludes it); shorter prefixes are unchanged."""
    a, c0, tags = _nan_problem(cosine=cosine)
    dims = (30, 8, 12, 13)
    clean = LSEProblem(a, (c0, c0[:0]), tags, cosine, dims=dims)
    c0 = c0.clone()
    c0[7, 12] = bad
    dirty = LSEProblem(a, (c0, c0[:0]), tags, cosine, dims=dims)
    tau = torch.tensor(0.3)
    with poison_outputs():
        want, _ = TRITON.forward(clean, tau)
        got, _ = TRITON.forward(dirty, tau)
    sees = torch.arange(6) != 2
    for k, m in enumerate(dims):
        if m <= 12:
            assert torch.equal(got[k], want[k]), (m, got[k], want[k])
        else:
            assert torch.isnan(got[k, sees]).all() and torch.equal(got[k, 2], want[k, 2]), (m, got[k])
    with poison_outputs():
        d_a, _ = TRITON.backward(dirty, tau, got, torch.ones(len(dims), 6))
    assert torch.isnan(d_a[sees]).all()


@pytest.mark.parametrize("cosine", [True, False], ids=["cos", "dot"])
def test_nonfinite_beyond_every_prefix_is_never_read(cosine):
    """A NaN at coordinate 12 when every prefix is at most 12 long: outputs and gradients are
    bitwise those of the clean input (the coordinate gets gradient 0)."""
    a, c0, tags = _nan_problem(cosine=cosine)
    dims = (8, 12, 5)
    bad = c0.clone()
    bad[7, 12:] = float("nan")
    tau, g = torch.tensor(0.3), torch.rand(3, 6, generator=torch.Generator().manual_seed(9))
    outs = []
    for c in (c0, bad):
        prob = LSEProblem(a, (c, c[:0]), tags, cosine, dims=dims)
        with poison_outputs():
            lse, mean = TRITON.forward(prob, tau)
            d_a, (d_c, _) = TRITON.backward(prob, tau, lse, g)
        outs.append((lse, mean, d_a, d_c))
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    assert (outs[1][3][:, 12:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cosine", [True, False], ids=["cos", "dot"])
def test_nonfinite_padded_row_has_no_influence(cosine, dtype):
    """NaN/Inf in a padded candidate: every output and gradient is bitwise that of a zero
    there, and the padded row's gradient is exactly zero."""
    a, c0, tags = _nan_problem(dtype, cosine)
    tags[0][[3, 11]] = TAG_PADDING
    dims = (30, 9, 17)
    c_bad = c0.clone()
    c_bad[3, 2], c_bad[11, 20] = float("nan"), float("inf")
    c_zero = c0.clone()
    c_zero[[3, 11]] = 0
    tau = torch.tensor(0.3)
    g = torch.rand(3, 6, generator=torch.Generator().manual_seed(5))
    outs = []
    for c in (c_bad, c_zero):
        prob = LSEProblem(a, (c, c[:0]), tags, cosine, dims=dims)
        with poison_outputs():
            lse, mean = TRITON.forward(prob, tau)
            d_a, (d_c, _) = TRITON.backward(prob, tau, lse, g.to(lse.dtype))
        outs.append((lse, mean, d_a, d_c))
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    assert (outs[0][3][[3, 11]] == 0).all()


def test_unsorted_dims_follow_the_callers_order():
    """Row k of the outputs is dims[k], whatever the order: permuting dims permutes rows."""
    gen = torch.Generator().manual_seed(6)
    prob = prefix_problem(7, 12, 5, 26, (26, 3, 14), generator=gen, dtype=torch.float32)
    perm = LSEProblem(prob.anchor, prob.blocks, prob.tags, dims=(14, 26, 3))
    tau = torch.tensor(0.1)
    with poison_outputs():
        lse, mean = TRITON.forward(prob, tau)
        lse_p, mean_p = TRITON.forward(perm, tau)
    assert torch.equal(lse_p, lse[[2, 0, 1]]) and torch.equal(mean_p, mean[[2, 0, 1]])


def test_more_than_eight_prefixes_are_refused():
    prob = prefix_problem(3, 4, 2, 12, tuple(range(1, 10)))
    reasons = TRITON.unsupported(prob)
    assert reasons and "at most 8" in reasons[0]
    with pytest.raises(dispatch.BackendUnavailableError, match="at most 8"):
        dispatch.choose(prob, backend="triton")


def test_oracle_agrees_with_plain_triton_for_one_full_prefix():
    """dims = (d,) is the plain problem: the Matryoshka path gives the plain path's values."""
    gen = torch.Generator().manual_seed(8)
    prob = prefix_problem(9, 14, 6, 20, (20,), generator=gen, dtype=torch.float64, own=1)
    plain = LSEProblem(prob.anchor, prob.blocks, prob.tags, positives=prob.positives)
    tau = torch.tensor(0.1, dtype=torch.float64)
    lse, mean = TRITON.forward(prob, tau)
    lse_1, mean_1 = TRITON.forward(plain, tau)
    check_roundoff("lse", lse[0], lse_1, prob, 0.1, logits=True)
    check_roundoff("mean_logit", mean[0], mean_1, prob, 0.1, logits=True)
    want = oracle(prob, 0.1, torch.ones(1, 9))[0]
    check_roundoff("lse against the oracle", lse, want, prob, 0.1, logits=True)


def test_every_real_launch_is_in_the_aot_list():
    """Launches of real Matryoshka runs (every dtype, cosine and dot, several chunks, with
    own positives) are all in the list the AOT test compiles."""
    gen = torch.Generator().manual_seed(12)
    with _common.recording() as launched:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for cosine in (True, False):
                prob = prefix_problem(5, 30, 4, 12, (12, 3, 7), dtype=dtype, cosine=cosine, own=2, generator=gen)
                lse, _ = TRITON.forward(prob, torch.tensor(0.2))
                TRITON.backward(prob, torch.tensor(0.2), lse, torch.ones(3, 5), torch.ones(3, 5, 2))
    launched = {x.key for x in launched}
    known = {x.key for x in aot.dry_runs("interp")}
    assert launched and launched <= known, sorted(launched - known)


def test_custom_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(7)
    prob = prefix_problem(5, 10, 3, 20, (20, 4, 9), dtype=torch.bfloat16, own=2, generator=gen)
    (c0, c1), (t0, t1) = prob.blocks, prob.tags
    tau, dims = torch.tensor(0.1), [20, 4, 9]
    args = (prob.anchor, c0, c1, t0, t1, tau)
    lse, _ = torch.ops.fastcl_triton.lse_forward(*args, True, 1e-8, dims)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.fastcl_triton.lse_forward.default, (*args, True, 1e-8, dims), test_utils=checks)
    bwd = (*args, lse, torch.ones(3, 5), torch.ones(3, 5, 2), True, 1e-8, True, dims)
    torch.library.opcheck(torch.ops.fastcl_triton.lse_backward.default, bwd, test_utils=checks)


def test_cosine_is_scale_free_and_huge_rows_are_refused_as_nan():
    """fp32 cosine rows scaled by 1e12 give the same logits and scaled gradients; a row with
    an entry >= 2^50 makes every row that sees it NaN (never a finite or dropped logit)."""
    p = prefix_problem(6, 10, 4, 24, (24, 9, 16), dtype=torch.float32, generator=torch.Generator().manual_seed(10))
    tau, g = torch.tensor(0.1), torch.rand(3, 6, generator=torch.Generator().manual_seed(11))

    def run(scale, row=None):
        c1 = p.blocks[1] * scale
        if row is not None:
            c1[row, 5] = 2.0**51
        q = LSEProblem(p.anchor * scale, (p.blocks[0] * scale, c1), p.tags, dims=p.dims)
        with poison_outputs():
            lse, mean = TRITON.forward(q, tau)
            d_a, _ = TRITON.backward(q, tau, lse, g)
        return lse, mean, d_a

    lse, mean, d_a = run(1.0)
    lse_s, mean_s, d_a_s = run(1e12)
    # scaling rounds each input once (eps/2): the normalised rows, hence the logits, move by
    # float32 round-off of their d-term sums, as two summation orders would
    check_roundoff("lse", lse_s, lse, p, 0.1, logits=True)
    check_roundoff("mean_logit", mean_s, mean, p, 0.1, logits=True)
    check_roundoff("d_anchor", d_a_s * 1e12, d_a, p, 0.1, logits=False)
    valid = int(torch.nonzero(p.tags[1] == TAG_ALL)[0])  # a candidate every row keeps
    lse_h, _, _ = run(1.0, valid)
    assert torch.isnan(lse_h).all()


def test_empty_problems():
    """No anchor, or no candidate: [K, 0] outputs, or -inf rows and all-zero gradients."""
    gen = torch.Generator().manual_seed(14)
    tau = torch.tensor(0.1)
    for B, n0, n1 in [(0, 4, 3), (3, 0, 0)]:
        a, c0, c1 = (torch.randn(n, 10, generator=gen) for n in (B, n0, n1))
        tags = (torch.full((n0,), TAG_ALL, dtype=torch.int32), torch.full((n1,), TAG_ALL, dtype=torch.int32))
        prob = LSEProblem(a, (c0, c1), tags, dims=(10, 4))
        with poison_outputs():
            lse, mean = TRITON.forward(prob, tau)
            d_a, (d_0, d_1) = TRITON.backward(prob, tau, lse, torch.ones(2, B))
        assert lse.shape == (2, B) and (lse == float("-inf")).all() and (mean == 0).all()
        assert all((x == 0).all() for x in (d_a, d_0, d_1))
