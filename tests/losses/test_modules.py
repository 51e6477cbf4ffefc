"""nn.Module wrappers, learnable temperature, autocast."""

from __future__ import annotations

import math

import pytest
import torch

import fastcl.losses as L
from fastcl.testing import roundoff


def test_modules_match_functions():
    a, p, n = torch.randn(6, 16), torch.randn(6, 3, 16), torch.randn(6, 2, 16)
    pm = torch.rand(6, 3) > 0.2
    pm[0, 0] = True
    cases = [
        (L.SupMPNLoss(0.05)(a, p, n, pos_mask=pm), L.supmpn_loss(a, p, n, pos_mask=pm)),
        (L.SupMPNLoss(0.05, own_positives="zero_logit")(a, p, n), L.supmpn_loss(a, p, n, own_positives="zero_logit")),
        (L.SupConLoss(0.1, reduction="sum")(a, p, n), L.supcon_loss(a, p, n, temperature=0.1, reduction="sum")),
        (L.MNRLoss(0.05)(a, p[:, 0], n), L.mnrl_loss(a, p[:, 0], n)),
        (L.InfoNCELoss(0.05, symmetric=True)(a, p[:, 0]), L.infonce_loss(a, p[:, 0], symmetric=True)),
        (L.EdaCSELoss(0.05, lam=0.3)(a, p[:, 0], p[:, 1]), L.edacse_loss(a, p[:, 0], p[:, 1], lam=0.3)),
        (L.GroupedCosineLoss(4)(a, p[:, 0]), L.grouped_cosine_loss(a, p[:, 0], group_size=4)),
        (L.GCLSRLoss(8)(a, p[:, 0], p[:, 1], n[:, 0]), L.gclsr_loss(a, p[:, 0], p[:, 1], n[:, 0], group_size=8)),
    ]
    for got, want in cases:  # the module calls the function: the same sums, bitwise
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_learnable_temperature_gets_gradient_and_stays_positive():
    loss_fn = L.SupConLoss(0.07, learn_temperature=True)
    # exp(log(0.07)) in float32: log's rounding, times |log 0.07| by exp, and exp's own
    assert math.isclose(loss_fn.temperature.item(), 0.07, rel_tol=roundoff(torch.float32, 1, 1 + abs(math.log(0.07))))
    opt = torch.optim.SGD(loss_fn.parameters(), lr=10.0)
    a, p = torch.randn(8, 16), torch.randn(8, 2, 16)
    loss = loss_fn(a, p)
    loss.backward()
    g = loss_fn.log_temperature.grad
    assert g is not None and torch.isfinite(g) and g != 0
    opt.step()
    assert loss_fn.temperature.item() > 0
    assert "log_temperature" in loss_fn.state_dict()
    assert "learnable" in repr(loss_fn)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_autocast_does_not_change_the_result(backend):
    enc = torch.nn.Linear(16, 32)
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, p = enc(x), enc(x + 0.1 * torch.randn_like(x))
        assert a.dtype == torch.bfloat16
        loss = L.infonce_loss(a, p, backend=backend)
    loss.backward()
    want = L.infonce_loss(a.detach(), p.detach(), backend=backend)
    assert loss.dtype == torch.bfloat16
    torch.testing.assert_close(loss, want)
    assert torch.isfinite(enc.weight.grad).all()
