"""The primitive on a candidate set cut into blocks (``fastcl.ops.blockwise``, the ring's math
without communication): merged forward partials and per-block backward shares equal one call
on the whole set, on every backend, with own positives, padding, empty rows and Matryoshka dims."""

from __future__ import annotations

import pytest
import torch

from fastcl.ops import dispatch
from fastcl.ops.blockwise import Merged, block_grad, foreign_tags
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, OwnPositives
from tests.helpers.backends import backends_under_test, require
from tests.helpers.matryoshka import check_roundoff

B, P, Q, D = 5, 2, 3, 12


def _pieces(parts: int, dtype, *, empty_row: bool, g: torch.Generator):
    """``parts`` blocks of ``(positives [B*P, d], negatives [B*Q, d])`` and their tags: piece 0
    holds the anchors' own positives (owner tags), the others are foreign (no owner tags)."""
    pieces = []
    for j in range(parts):
        b0, b1 = torch.randn(B * P, D, generator=g, dtype=dtype), torch.randn(B * Q, D, generator=g, dtype=dtype)
        t0 = torch.arange(B, dtype=torch.int32).repeat_interleave(P) if j == 0 else torch.full((B * P,), TAG_ALL)
        t0 = t0.to(torch.int32)
        t1 = torch.full((B * Q,), TAG_ALL, dtype=torch.int32)
        t0[torch.rand(B * P, generator=g) < 0.3] = TAG_PADDING
        t1[torch.rand(B * Q, generator=g) < 0.3] = TAG_PADDING
        if empty_row and j > 0:  # a block where every candidate is padding: lse_t = -inf in every row
            t0[:], t1[:] = TAG_PADDING, TAG_PADDING
        pieces.append(((b0, b1), (t0, t1)))
    return pieces


def _whole(anchor, pieces, dims):
    b0 = torch.cat([p[0][0] for p in pieces])
    b1 = torch.cat([p[0][1] for p in pieces])
    t0 = torch.cat([p[1][0] for p in pieces])
    t1 = torch.cat([p[1][1] for p in pieces])
    return LSEProblem(anchor, (b0, b1), (t0, t1), positives=OwnPositives(0, P), dims=dims)


@pytest.fixture(params=["reference", *backends_under_test()])
def backend(request):
    require(request.param)
    return dispatch.get(request.param)


@pytest.mark.parametrize("dims", [None, (12, 5, 9)], ids=["plain", "matryoshka"])
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("empty_row", [False, True])
def test_blocks_equal_one_call(backend, dims, parts, empty_row):
    g = torch.Generator().manual_seed(parts + 7 * empty_row)
    anchor = torch.randn(B, D, generator=g, dtype=torch.float64)
    pieces = _pieces(parts, torch.float64, empty_row=empty_row, g=g)
    whole = _whole(anchor, pieces, dims)
    tau = torch.tensor(0.2, dtype=torch.float32)
    rows = (B,) if dims is None else (len(dims), B)
    gr = torch.randn(rows, generator=g, dtype=torch.float64)
    d_pos = torch.randn((*rows, P), generator=g, dtype=torch.float64)

    lse, ml = backend.forward(whole, tau)
    merged, partials = Merged(), []
    for j, (blocks, tags) in enumerate(pieces):
        pos = OwnPositives(0, P) if j == 0 else None
        prob = LSEProblem(anchor, blocks, tags, positives=pos, dims=dims)
        lse_t, ml_t = backend.forward(prob, tau)
        merged.add(lse_t, ml_t)
        partials.append((prob, lse_t))
    # float64 sums in another order (per block, then merged): tests/helpers/matryoshka.py
    check_roundoff("lse", merged.lse, lse, whole, 0.2, logits=True)
    check_roundoff("mean_logit", merged.mean_logit, ml, whole, 0.2, logits=True)

    d_a, (d0, d1) = backend.backward(whole, tau, lse, gr, d_pos)
    got_a = torch.zeros_like(d_a)
    got0, got1 = [], []
    for j, (prob, lse_t) in enumerate(partials):
        a, (b0, b1) = backend.backward(prob, tau, lse_t, block_grad(gr, merged.lse, lse_t), d_pos if j == 0 else None)
        got_a += a
        got0.append(b0)
        got1.append(b1)
    up = gr.abs().max().item() + d_pos.abs().sum(-1).max().item()
    check_roundoff("d_anchor", got_a, d_a, whole, 0.2, logits=False, upstream=up)
    check_roundoff("d_block0", torch.cat(got0), d0, whole, 0.2, logits=False, upstream=up)
    check_roundoff("d_block1", torch.cat(got1), d1, whole, 0.2, logits=False, upstream=up)


def test_merge_keeps_nan_and_empty_rows():
    m = Merged()
    ninf = float("-inf")
    m.add(torch.tensor([ninf, 1.0, ninf]), torch.tensor([0.0, 2.0, 0.0]))
    m.add(torch.tensor([ninf, float("nan"), 0.5]), torch.tensor([0.0, 1.0, 3.0]))
    assert m.lse[0] == ninf and m.mean_logit[0] == 0  # empty everywhere: -inf and 0, no NaN
    assert m.lse[1].isnan() and m.mean_logit[1].isnan()  # a non-finite input reaches the row
    assert m.lse[2] == 0.5 and m.mean_logit[2] == 3.0
    assert block_grad(torch.ones(3), m.lse, torch.tensor([ninf, 0.0, ninf])).tolist()[::2] == [0.0, 0.0]


def test_foreign_tags_forget_owners_keep_padding():
    tags = torch.tensor([TAG_PADDING, TAG_ALL, 0, 3], dtype=torch.int32)
    assert foreign_tags(tags).tolist() == [TAG_PADDING, TAG_ALL, TAG_ALL, TAG_ALL]
