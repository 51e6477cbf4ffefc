"""Dot similarity and non-finite *valid* rows on the Triton primitive (interpreter).

Contract (docs/losses.md, "Non-finite inputs"): a row holding NaN/Inf turns into an all-NaN
row before any logit is formed, with ``similarity="dot"`` as with cosine. The raw dot
product of an Inf row is ``+-inf`` (or NaN), and a ``-inf`` logit would vanish as
``exp(-inf) = 0``, so the kernels multiply rows by the pre-pass's row scale (1, or NaN for
a non-finite row). The cases below arrange every logit of the bad row to be ``-inf`` in
the raw product: without the row scale the rows that see it come out finite (or ``-inf``)
instead of NaN. Every dtype: fp32/fp64 apply the scale on load, 16-bit on the logit tile.

Runs in the Triton interpreter suite: skipped without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter suite runs with TRITON_INTERPRET=1 in its own process", allow_module_level=True)
pytest.importorskip("triton")

from fastcl.ops import _triton  # noqa: E402
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, poison_outputs  # noqa: E402

TRITON = _triton.BACKEND
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
B, N0, N1, D = 6, 40, 9, 16
BAD_ROW, OWNER = 17, 2  # candidate 17 of block 0 is row 2's own (left out of row 2 only)


def _problem(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(B, D, generator=gen)
    blocks = [torch.randn(n, D, generator=gen) for n in (N0, N1)]
    tags = [torch.full((n,), TAG_ALL, dtype=torch.int32) for n in (N0, N1)]
    tags[0][BAD_ROW] = OWNER
    tags[1][4] = TAG_PADDING  # a padded row holding Inf: never read, whatever the mode
    blocks[1][4] = float("inf")
    return a, blocks, tags


def _run(a, blocks, tags, dtype, backward=False):
    problem = LSEProblem(a.to(dtype), tuple(b.to(dtype) for b in blocks), tuple(tags), cosine=False)
    tau = torch.tensor(0.1)
    with poison_outputs():
        lse, mean_logit = TRITON.forward(problem, tau)
        if not backward:
            return lse, mean_logit
        _, d_blocks = TRITON.backward(problem, tau, lse, torch.ones(B))
    return lse, mean_logit, d_blocks


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_nonfinite_candidate_makes_its_rows_nan(dtype, bad):
    a, blocks, tags = _problem(dtype)
    a[:, 5] = a[:, 5].abs() + 0.5  # every raw logit of the bad candidate is bad * (+) = bad
    blocks[0][BAD_ROW, 5] = -abs(bad) if bad == bad else bad  # -inf raw logits: exp(-inf) = 0
    clean_lse, clean_ml = _run(a, [b.where(b.isfinite(), 0) for b in blocks], tags, dtype)
    lse, mean_logit, d_blocks = _run(a, blocks, tags, dtype, backward=True)
    sees = torch.arange(B) != OWNER
    assert torch.isnan(lse[sees]).all(), lse
    assert torch.isnan(mean_logit[sees]).all(), mean_logit
    # the owner never sees it: bitwise the result with the bad entry zeroed elsewhere
    assert torch.equal(lse[OWNER], clean_lse[OWNER]) and torch.equal(mean_logit[OWNER], clean_ml[OWNER])
    # the backward recomputes the same NaN logits: the bad row's gradient cannot be finite
    assert torch.isnan(d_blocks[0][BAD_ROW]).all(), d_blocks[0][BAD_ROW]
    assert (d_blocks[1][4] == 0).all()  # the padded Inf row is still never read


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_nonfinite_anchor_makes_its_row_nan(dtype, bad):
    a, blocks, tags = _problem(dtype, seed=1)
    for b in blocks:
        b[:, 5] = b[:, 5].abs() + 0.5
    a[1, 5] = -abs(bad) if bad == bad else bad  # row 1's raw logits all -inf: it would look empty
    lse, mean_logit = _run(a, blocks, tags, dtype)
    assert torch.isnan(lse[1]) and torch.isnan(mean_logit[1])
    others = torch.arange(B) != 1
    assert torch.isfinite(lse[others]).all() and torch.isfinite(mean_logit[others]).all()
