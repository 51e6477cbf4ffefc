"""``JointLSE``: rows whose denominator spans two problems, every gradient formed in the forward
(GIST's anchor rows and positive–positive rows). It must equal the composition of two
recomputing calls (``strategy="recompute"`` takes that path) in value and every gradient,
temperature included, and must be the path a fused backend takes."""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L
from fastcl.ops import dispatch, joint
from fastcl.testing import assert_close, loss_terms
from tests.helpers.backends import backends_under_test, require


@pytest.mark.parametrize("backend", backends_under_test())
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_joint_sweep_equals_two_recomputed_calls(backend, reduction, monkeypatch):
    require(backend)
    if dispatch.get(backend).fused is None:
        pytest.skip(f"{backend} has no gradient-in-forward sweep")
    g = torch.Generator().manual_seed(5)
    B, d, gd = 11, 24, 7
    a = torch.randn(B, d, generator=g)
    p, n = a + torch.randn(B, d, generator=g), torch.randn(B, 2, d, generator=g)
    guide = (torch.randn(B, gd, generator=g), torch.randn(B, gd, generator=g), torch.randn(B, 2, gd, generator=g))
    runs, used = {}, []
    real = joint.JointLSE.apply
    monkeypatch.setattr(joint.JointLSE, "apply", lambda *args: used.append(1) or real(*args))
    for strategy in ("auto", "recompute"):
        leaves = [x.clone().requires_grad_() for x in (a, p, n)]
        tau = torch.tensor(0.07, requires_grad=True)
        loss = L.gist_loss(
            *leaves, guide=guide, margin=0.05, temperature=tau, reduction=reduction, backend=backend, strategy=strategy
        )
        runs[strategy] = (loss, *torch.autograd.grad(loss, [*leaves, tau]))
    assert used == [1], "the fused backend's mean/sum GIST must take the joint sweep (and recompute must not)"
    for name, x, y in zip(("loss", "d anchor", "d positive", "d negatives", "d tau"), runs["auto"], runs["recompute"]):
        # GIST's rows: B anchors against 3 + 2 blocks of B candidates, logits of size 1/tau; d tau
        # sums the rows' logit differences times 1/tau (fastcl.testing's module docstring)
        weight = 1.0 if reduction == "mean" else float(B)
        size = {"loss": 1 / 0.07, "d tau": weight / 0.07**2}.get(name)
        kw = dict(magnitude=size) if size else dict(logit_scale=1 / 0.07)
        assert_close(f"joint vs recompute: {name}", x, y, torch.float32, terms=loss_terms(B, 5 * B, d), **kw)
