"""A training step that calls a loss compiles with ``torch.compile(fullgraph=True)``.

Backend choice runs inside the traced region (``contrastive_loss`` -> ``dispatch.choose``):
it must not break the graph (no importlib, availability checks taken as trace constants;
docs/design.md, "Dispatch"). Value and gradients must equal eager ones.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fastcl.losses as L
from fastcl.testing import assert_roundoff

B, P, Q, D = 4, 2, 3, 8

LOSSES = {
    "supmpn": lambda a, p, n, be: L.supmpn_loss(a, p, n, backend=be),
    "supcon": lambda a, p, n, be: L.supcon_loss(a, p, n, temperature=0.1, backend=be),
    "mnrl": lambda a, p, n, be: L.mnrl_loss(a, p[:, 0], n, backend=be),
    "infonce": lambda a, p, n, be: L.infonce_loss(a, p[:, 0], symmetric=True, backend=be),
    "gclsr": lambda a, p, n, be: L.gclsr_loss(a, p[:, 0], p[:, 1], n[:, 0], group_size=4, backend=be),
    "matryoshka": lambda a, p, n, be: L.supmpn_loss(
        a, p, n, backend=be, matryoshka_dims=(8, 3), matryoshka_weights=(1, 2)
    ),
}


def _step(encoder: torch.nn.Linear, loss_fn, backend: str):
    def step(a, p, n):  # encoder forward + loss, as a training step compiles it
        return loss_fn(encoder(a), encoder(p), encoder(n), backend)

    return step


def _assert_same_sums(got, want, got_grads, want_grads):
    """Compiled and eager float32 steps sum in different orders: a logit sums D terms of size
    1/tau (tau >= 0.05), a row N = B (1 + P + Q) candidates, the encoder's gradients the same
    N rows; the logits' round-off is absolute in the loss, relative in the gradients."""
    terms, inv_tau = D + 2 * B * (1 + P + Q), 1 / 0.05
    assert_roundoff(got, want, terms=terms, magnitude=inv_tau, msg="loss")
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert_roundoff(g, w, terms=terms, magnitude=w.abs().max().item() * inv_tau, msg=f"grad {i}")


def _value_and_grads(fn, encoder, inputs):
    encoder.zero_grad()
    loss = fn(*inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in encoder.parameters()]


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
def test_training_step_compiles_fullgraph(loss, backend):
    gen = torch.Generator().manual_seed(5)
    encoder = torch.nn.Linear(D, D)
    inputs = (
        torch.randn(B, D, generator=gen),
        torch.randn(B, P, D, generator=gen),
        torch.randn(B, Q, D, generator=gen),
    )
    step = _step(encoder, LOSSES[loss], backend)
    torch._dynamo.reset()
    # aot_eager: dynamo (where graph breaks happen) and AOTAutograd's joint forward/backward
    # trace, without paying inductor's C++ compile in every case
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:  # fastcl's code traces without Dynamo's warnings
        warnings.simplefilter("always")
        got, got_grads = _value_and_grads(compiled, encoder, inputs)
    assert not [w for w in caught if "fastcl" in str(w.filename) + str(w.message)], [str(w.message) for w in caught]
    want, want_grads = _value_and_grads(step, encoder, inputs)
    _assert_same_sums(got, want, got_grads, want_grads)


def test_inductor_compiles_the_auto_cpu_backend():
    """The default backend (inductor) on the automatic CPU choice (``cpp`` when built)."""
    gen = torch.Generator().manual_seed(6)
    encoder = torch.nn.Linear(D, D)
    inputs = (
        torch.randn(B, D, generator=gen),
        torch.randn(B, P, D, generator=gen),
        torch.randn(B, Q, D, generator=gen),
    )
    step = _step(encoder, LOSSES["supmpn"], "auto")
    torch._dynamo.reset()
    got, got_grads = _value_and_grads(torch.compile(step, fullgraph=True), encoder, inputs)
    want, want_grads = _value_and_grads(step, encoder, inputs)
    _assert_same_sums(got, want, got_grads, want_grads)
