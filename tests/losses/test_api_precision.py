"""Low precision for the new API losses: bf16/fp16 inputs at tau = 0.01 stay finite and close
to the float64 reference (docs/contracts.md, "Precision"), on the fused CPU backends."""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L
from fastcl.testing import assert_close, loss_terms
from tests.helpers.backends import require

GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def _labels_case(dt):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 2, 32, generator=gen).to(dt)
    y = torch.randint(0, 8, (64,), generator=gen)
    return [x], lambda t, b: L.supcon_loss(t[0], labels=y, temperature=0.01, backend=b)


def _mnrl_case(dt):
    gen = torch.Generator().manual_seed(2)
    cols = [torch.randn(64, 32, generator=gen).to(dt) for _ in range(3)]
    return cols, lambda t, b: L.mnrl_loss(
        *t, temperature=0.01, directions=GTE, hardness_mode="in_batch_negatives", hardness_strength=9.0, backend=b
    )


@pytest.mark.parametrize("case", [_labels_case, _mnrl_case], ids=["supcon_labels", "mnrl_gte_hardness"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_low_precision_is_finite_and_close(backend, dtype, case):
    require(backend)
    inputs, fn = case(dtype)
    leaves = [t.clone().requires_grad_() for t in inputs]
    ref_leaves = [t.double().requires_grad_() for t in inputs]
    got, ref = fn(leaves, backend), fn(ref_leaves, "reference")
    assert got.dtype == dtype
    grads = torch.autograd.grad(got, leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves)
    # both cases: 64 rows of d = 32 against at most 3 * 64 candidates, logits of size 1/tau = 100
    terms = loss_terms(64, 3 * 64, 32)
    assert_close("loss", got, ref, dtype, terms=terms, magnitude=100.0)
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        assert_close("grad", g, r, dtype, terms=terms, logit_scale=100.0)
