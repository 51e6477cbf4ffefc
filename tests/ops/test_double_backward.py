"""Double backward never gives a silent ``None`` or a wrong second derivative.

The ``reference`` backend's backward is plain differentiable torch ops: ``gradgradcheck``
passes through the public losses. Every other backend computes first derivatives in
kernels; a second backward through them raises an error naming ``backend="reference"``.
"""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L
from fastcl.ops import dispatch
from tests.helpers.backends import backends_under_test, device_under_test, require
from tests.helpers.roundoff import assert_grad_roundoff, assert_tau_grad_roundoff

B, P, Q, D = 4, 2, 3, 5


def _inputs(dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    a, p, n = (
        torch.randn(*s, generator=gen, dtype=dtype).to(device).requires_grad_() for s in ((B, D), (B, P, D), (B, Q, D))
    )
    tau = torch.tensor(0.3, dtype=torch.float64, device=device, requires_grad=True)
    return a, p, n, tau


CASES = {
    "supmpn": lambda a, p, n, t, be: L.supmpn_loss(a, p, n, temperature=t, backend=be),
    "supmpn_zero_logit_masked": lambda a, p, n, t, be: L.supmpn_loss(
        a,
        p,
        n,
        temperature=t,
        backend=be,
        own_positives="zero_logit",
        pos_mask=torch.tensor([[True, False], [True, True], [False, False], [True, True]], device=a.device),
    ),
    "supcon_none": lambda a, p, n, t, be: L.supcon_loss(a, p, n, temperature=t, reduction="none", backend=be),
    "mnrl_dot": lambda a, p, n, t, be: L.mnrl_loss(a, p[:, 0], n, temperature=t, similarity="dot", backend=be),
    "pool": lambda a, p, n, t, be: L.supcon_pool_loss(
        a,
        n.reshape(B * Q, D),
        torch.tensor([[0, 1], [3, 4], [6, 8], [9, 11]], device=a.device),
        temperature=t,
        backend=be,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_gradgradcheck(fastcl_config, monkeypatch, case):
    fastcl_config(strategy="recompute")
    fn = CASES[case]
    # fast mode: a random projection of each Jacobian (tests/helpers/gradcheck.py), ~10x faster
    assert torch.autograd.gradgradcheck(lambda *x: fn(*x, "reference"), _inputs(), fast_mode=True)


def test_grouped_cosine_gradgradcheck():
    h = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    z = torch.randn(3, 12, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda h: L.grouped_cosine_loss(h, z, group_size=4, reduction="none"), (h,))


@pytest.mark.parametrize("strategy", ["fused", "recompute"])
@pytest.mark.parametrize("case", ["supmpn", "supcon_none", "pool"])
@pytest.mark.parametrize("backend", backends_under_test())
def test_other_backends_refuse_double_backward(fastcl_config, monkeypatch, backend, case, strategy):
    require(backend)
    if strategy == "fused" and (case == "supcon_none" or dispatch.get(backend).fused is None):
        pytest.skip("reduction='none' and backends without a fused path always recompute")
    fastcl_config(strategy=strategy)
    dev = device_under_test()
    a, p, n, t = _inputs(torch.float32, dev)
    loss = CASES[case](a, p, n, t, backend)
    upstream = torch.ones_like(loss)
    g_a, g_t = torch.autograd.grad(loss, (a, t), upstream, create_graph=True)
    # the first derivatives are the usual ones (the shared positives' logits take a
    # differentiable formula under create_graph: float32 rounding differs)
    want = torch.autograd.grad(CASES[case](a, p, n, t, backend), (a, t), upstream)
    kw = dict(terms=D + B * (P + Q) + B, logit_scale=1 / 0.3)  # tests/helpers/roundoff.py
    assert_grad_roundoff(g_a, want[0], torch.float32, msg="d anchor", **kw)
    assert_tau_grad_roundoff(g_t, want[1], torch.float32, rows=loss.numel(), **kw)
    assert g_a.requires_grad, "a gradient that drops out of the graph would make the second backward silent"
    with pytest.raises(
        RuntimeError, match=rf"{backend!r} backend computes first derivatives only.*backend='reference'"
    ):
        (g_a.square().sum() + g_t).backward()
