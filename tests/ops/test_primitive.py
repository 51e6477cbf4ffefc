"""The fused primitive itself: gradcheck in float64, the lse contract, edge cases."""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L
from fastcl.ops import dispatch
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, OwnPositives, poison_outputs
from fastcl.ops.positive_logits import positive_logits
from fastcl.reference import ReferenceLSE
from tests.helpers.backends import backends_under_test, device_under_test, require
from tests.helpers.gradcheck import gradcheck_contrastive
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_and_grads_roundoff, assert_loss_roundoff


def _problem(B, N0, N1, d, dtype=torch.float64, device="cpu", cosine=True, exclude=True):
    a = torch.randn(B, d, dtype=dtype, device=device)
    b0 = torch.randn(N0, d, dtype=dtype, device=device)
    b1 = torch.randn(N1, d, dtype=dtype, device=device)
    t0 = (
        torch.randint(-2, B, (N0,), dtype=torch.int32, device=device)
        if exclude
        else torch.full((N0,), TAG_ALL, dtype=torch.int32, device=device)
    )
    t1 = torch.where(torch.rand(N1, device=device) < 0.3, TAG_PADDING, TAG_ALL).to(torch.int32)
    return LSEProblem(a, (b0, b1), (t0, t1), cosine)


@pytest.mark.parametrize("strategy", ["fused", "recompute"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kind", ["cross_entropy", "softplus"])
@pytest.mark.parametrize("cosine", [True, False])
def test_gradcheck_contrastive_lse(fastcl_config, monkeypatch, strategy, reduction, kind, cosine):
    if strategy == "fused" and reduction == "none":
        pytest.skip("reduction='none' always recomputes")
    fastcl_config(strategy=strategy)
    gradcheck_contrastive("torch", kind=kind, reduction=reduction, cosine=cosine)


@pytest.fixture(params=["reference", *backends_under_test()])
def backend(request):
    require(request.param)
    return request.param


def test_lse_contract(backend):
    """lse and mean_logit against the reference; empty rows give -inf and 0; every output written."""
    impl = dispatch.get(backend)
    dev = device_under_test()
    prob = _problem(6, 11, 7, 9, dtype=torch.float32, device=dev)
    # row 5 loses every candidate: all block-0 tags become 5 or padding, block 1 all padding
    t0 = torch.where(torch.arange(11, device=dev) % 2 == 0, 5, TAG_PADDING).to(torch.int32)
    t1 = torch.full((7,), TAG_PADDING, dtype=torch.int32, device=dev)
    prob = LSEProblem(prob.anchor, prob.blocks, (t0, t1), True)
    tau = torch.tensor(0.1, device=dev)
    want = ReferenceLSE().forward(
        LSEProblem(prob.anchor.double(), tuple(b.double() for b in prob.blocks), prob.tags), tau
    )[0]
    with poison_outputs():
        got, mean_logit = impl.forward(prob, tau)
    assert torch.isfinite(mean_logit).all()
    assert got.dtype == torch.float32 and got.shape == (6,)
    assert got[5].item() == float("-inf")
    assert_loss_roundoff(got[:5], want[:5], torch.float32, terms=9 + 18 + 6, logit_scale=1 / 0.1, msg="lse")


def test_fused_and_recompute_agree(fastcl_config, monkeypatch):
    B, P, Q, d = 9, 3, 2, 17
    a, pos, neg = torch.randn(B, d), torch.randn(B, P, d), torch.randn(B, Q, d)
    outs = {}
    for strategy in ("fused", "recompute"):
        fastcl_config(strategy=strategy)
        leaves = [x.clone().requires_grad_() for x in (a, pos, neg)]
        loss = L.supmpn_loss(*leaves, backend="torch")
        loss.backward()
        outs[strategy] = (loss.detach(), *[x.grad for x in leaves])
    (loss, *grads), (want, *want_grads) = outs["fused"], outs["recompute"]
    assert_loss_and_grads_roundoff(
        loss, want, grads, want_grads, torch.float32, terms=d + B * (P + Q) + B, logit_scale=1 / 0.05
    )


def test_fused_strategy_rejects_none_reduction(fastcl_config, monkeypatch):
    fastcl_config(strategy="fused")
    a = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="fused"):
        L.infonce_loss(a, torch.randn(3, 4), reduction="none", backend="torch")


def test_upstream_gradient_scales(monkeypatch):
    """Backward must multiply the gradient formed in forward by the upstream gradient."""
    a, p = torch.randn(5, 8, requires_grad=True), torch.randn(5, 8)
    (L.infonce_loss(a, p, backend="torch") * 3.5).backward()
    g1 = a.grad.clone()
    a.grad = None
    L.infonce_loss(a, p, backend="reference").backward()
    want = 3.5 * a.grad
    assert_grad_roundoff(g1, want, torch.float32, terms=8 + 5 + 5, logit_scale=1 / 0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_temperature_low_precision_is_finite(backend, dtype):
    if backend == "reference":
        pytest.skip("the eager reference in low precision may overflow; that is why fastcl exists")
    dev = device_under_test()
    a = torch.randn(16, 64, device=dev, dtype=dtype, requires_grad=True)
    p = torch.randn(16, 4, 64, device=dev, dtype=dtype, requires_grad=True)
    n = torch.randn(16, 4, 64, device=dev, dtype=dtype, requires_grad=True)
    loss = L.supmpn_loss(a, p, n, temperature=0.01, backend=backend)
    loss.backward()
    for x in (loss, a.grad, p.grad, n.grad):
        assert torch.isfinite(x).all()


def test_zero_vectors_are_finite(backend):
    dev = device_under_test()
    a = torch.randn(4, 8, device=dev)
    a[1] = 0
    p = torch.randn(4, 2, 8, device=dev)
    p[2, 1] = 0
    n = torch.zeros(4, 1, 8, device=dev)
    leaves = [x.requires_grad_() for x in (a, p, n)]
    for fn in (L.supmpn_loss, L.supcon_loss):
        loss = fn(*leaves, backend=backend)
        grads = torch.autograd.grad(loss, leaves)
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)


def test_positive_logits_gradcheck():
    a = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    p = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    tau = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    for cosine in (True, False):
        assert torch.autograd.gradcheck(
            lambda a, p, t, cosine=cosine: positive_logits(a, p, t, cosine=cosine, eps=1e-8), (a, p, tau)
        )


def test_grouped_cosine_gradcheck():
    h = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    z = torch.randn(3, 12, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h: L.grouped_cosine_loss(h, z, group_size=4, reduction="none"), (h,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, group", [((7, 48), 16), ((3, 5), 5), ((2, 4096), 16), ((5, 30), 1)])
def test_grouped_cosine_matches_reference(dtype, shape, group):
    h = torch.randn(*shape).to(dtype).requires_grad_()
    z = torch.randn(*shape).to(dtype).requires_grad_()
    with poison_outputs():
        got = L.grouped_cosine_loss(h, z, group_size=group, backend="torch")
    got.backward()
    assert z.grad is None, "z is stop-gradient"
    h64 = h.detach().double().requires_grad_()
    want = L.grouped_cosine_loss(h64, z.detach().double(), group_size=group, backend="reference")
    want.backward()
    # a cosine sums `group` products, the mean B * groups cosines (<= 1, no temperature); a
    # gradient term is (z^ - cos h^) / (|h_group| B groups), which cancels to exactly 0 for
    # group_size 1 (h^ and z^ are +-1): its size is the bound's then
    B, groups = shape[0], shape[1] // group
    terms = group + B * groups
    assert_loss_roundoff(got, want, dtype, terms=terms, logit_scale=1.0)
    norms = h64.detach().view(B, groups, group).norm(dim=-1).clamp_min(1e-8)
    term = 1 / (norms.min().item() * B * groups)
    assert_grad_roundoff(h.grad, h64.grad, dtype, terms=terms, logit_scale=1.0, term_size=term)


def test_own_positives_must_fit_in_block0():
    from fastcl.ops.contract import LSEProblem

    a, b0, b1 = torch.randn(3, 4), torch.randn(6, 4), torch.randn(0, 4)
    tags = (torch.full((6,), -1, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
    LSEProblem(a, (b0, b1), tags, positives=OwnPositives(0, 2))  # 3 anchors x 2 = 6 rows: fits
    with pytest.raises(ValueError, match="do not fit"):
        LSEProblem(a, (b0, b1), tags, positives=OwnPositives(1, 2))


@pytest.mark.parametrize("configured", ["auto", "fused", "recompute"])
def test_strategy_is_an_argument(fastcl_config, monkeypatch, configured):
    """``strategy=`` picks the algorithm per call, functions and modules alike, whatever
    ``fastcl.config`` (``FASTCL_STRATEGY``) says; ``"auto"`` follows the configuration."""
    from fastcl.ops import _torch_impl

    calls = []
    sweep = _torch_impl._sweep
    monkeypatch.setattr(_torch_impl, "_sweep", lambda *a, **k: calls.append("head" in k) or sweep(*a, **k))
    fastcl_config(strategy=configured)
    a, p, n = torch.randn(5, 8, requires_grad=True), torch.randn(5, 2, 8), torch.randn(5, 3, 8)
    x, y = torch.randn(15, 8, requires_grad=True), torch.arange(15) % 4
    gte = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")

    def ran(loss_fn) -> str:
        """ "fused" when every sweep formed the gradient in forward (a head), "recompute" when
        every one was a forward or a recompute backward."""
        calls.clear()
        loss_fn().backward()
        return "fused" if all(calls) else "recompute" if not any(calls) else str(calls)

    for strategy in ("fused", "recompute"):
        assert ran(lambda s=strategy: L.supmpn_loss(a, p, n, backend="torch", strategy=s)) == strategy
        assert ran(lambda s=strategy: L.SupMPNLoss(backend="torch", strategy=s)(a, p, n)) == strategy
        assert ran(lambda s=strategy: L.supcon_labels_loss(x, y, backend="torch", strategy=s)) == strategy
    # sentence-transformers 6 options reduce the primitive's rows afterwards: never fused
    assert ran(lambda: L.mnrl_loss(a, p[:, 0], backend="torch", strategy="recompute", directions=gte)) == "recompute"
    with pytest.raises(ValueError, match="strategy='fused' needs reduction 'mean' or 'sum'"):
        L.mnrl_loss(a, p[:, 0], backend="torch", strategy="fused", directions=gte).backward()
    assert ran(lambda: L.supmpn_loss(a, p, n, backend="torch")) == (
        "recompute" if configured == "recompute" else "fused"
    )
