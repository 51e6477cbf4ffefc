"""The fused Function's backward with an upstream gradient of 1 (skipped multiply) and
of any other value (multiplied): both must give the reference's gradients.

ContrastiveLSE.backward skips the multiply by the upstream gradient when it is exactly 1
on the CPU (loss.backward()); this checks both branches against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from fastcl import reference as R
from fastcl.losses import supmpn_loss
from tests.helpers.backends import backends_under_test, require
from tests.helpers.roundoff import assert_grad_roundoff, assert_tau_grad_roundoff


@pytest.mark.parametrize("backend", [b for b in backends_under_test() if b in ("torch", "cpp")])
@pytest.mark.parametrize("upstream", [1.0, 2.5, -0.75])
def test_reduced_loss_gradient_times_upstream(backend, upstream):
    require(backend)
    g = torch.Generator().manual_seed(17)
    B, P, Q, d = 6, 2, 3, 8
    leaves = [torch.randn(*s, generator=g, dtype=torch.float32) for s in ((B, d), (B, P, d), (B, Q, d))]
    tau = torch.tensor(0.1)

    def grads(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
        t = tau.detach().to(dtype).requires_grad_()
        loss = fn(*xs, temperature=t)
        loss.backward(torch.tensor(upstream, dtype=dtype))
        return [x.grad for x in xs] + [t.grad]

    got = grads(lambda *x, **k: supmpn_loss(*x, **k, backend=backend), torch.float32)
    want = grads(R.supmpn, torch.float64)
    # float32 round-off (tests/helpers/roundoff.py): d + N + B terms, logits of size 1/tau
    kw = dict(terms=d + B * (P + Q) + B, logit_scale=1 / 0.1)
    for u, w in zip(got[:3], want[:3]):
        assert_grad_roundoff(u, w, torch.float32, **kw)
    assert_tau_grad_roundoff(got[3], want[3], torch.float32, rows=abs(upstream), **kw)
