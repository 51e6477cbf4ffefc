"""``JointLSE``: rows whose denominator spans two problems, every gradient formed in the forward
(GIST's anchor rows and positive–positive rows). It must equal the composition of two
recomputing calls (``strategy="recompute"`` takes that path) in value and every gradient,
temperature included, and must be the path a fused backend takes."""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L
from fastcl.ops import _cpp, dispatch, joint
from fastcl.testing import assert_close, assert_roundoff, loss_terms
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


# --------------------------------------------------------------------------------------
# The cpp backend's joint sweep (Backend.fused_joint) against the composition it replaces
# --------------------------------------------------------------------------------------

TILE = _cpp.EXTENSION.error() is None and "AVX512" in _cpp._capability


def _gist_run(inputs, *, native: bool, dtype, monkeypatch, **options):
    """Loss and gradients (anchor, positive, negatives, tau) of cpp GIST, joint sweep or composed."""
    a, p, n, guide = inputs
    with monkeypatch.context() as m:
        if not native:
            m.setattr(joint, "native", lambda spec: False)
        leaves = [x.to(dtype).requires_grad_() for x in (a, p, n)]
        tau = torch.tensor(0.05, dtype=torch.float64 if dtype == torch.float64 else torch.float32, requires_grad=True)
        loss = L.gist_loss(*leaves, guide=guide, temperature=tau, backend="cpp", **options)
        return [loss, *torch.autograd.grad(loss, [*leaves, tau])]


def _gist_inputs(B, d, g, Q, seed, nonfinite=None):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(B, d, generator=gen, dtype=torch.float64)
    p = a + 0.8 * torch.randn(B, d, generator=gen, dtype=torch.float64)
    n = torch.randn(B, Q, d, generator=gen, dtype=torch.float64)
    ga = torch.randn(B, g, generator=gen, dtype=torch.float64)
    guide = (ga, ga + 0.6 * torch.randn(B, g, generator=gen, dtype=torch.float64), torch.randn(B, Q, g, generator=gen))
    if nonfinite == "positive":  # p_3 anchors its own pp row and is everyone's candidate
        p[3, 1] = float("nan")
    elif nonfinite == "anchor":
        a[2, 0] = float("inf")
    return a, p, n, guide


@pytest.mark.parametrize("gemm", ["mkl", "own"])
@pytest.mark.parametrize("rows", [None, 5])
@pytest.mark.parametrize(
    "B, d, g, Q, options",
    [
        (1, 3, 2, 1, {}),
        (13, 17, 5, 1, {"margin": 0.1}),
        (37, 33, 9, 2, {"margin_strategy": "relative", "margin": 0.3, "contrast_anchors": False}),
        (29, 20, 7, 1, {"similarity": "dot", "margin": -0.2}),
    ],
)
def test_cpp_joint_sweep_equals_the_composed_calls(B, d, g, Q, options, rows, gemm, fastcl_config, monkeypatch):
    """One sweep with block 1 anchored by the positives must give the composition's value and
    every gradient to round-off, across row-block edges (``rows``) and with fastcl's GEMM tile.
    The dot-product case also holds rows whose own LSE is e^-88 of their loss in float32: the
    composed sweep's folded positive once overflowed there (w / r, docs/csrc.md)."""
    require("cpp")
    if gemm == "own" and not TILE:
        pytest.skip("the GEMM tile needs the AVX-512 build")
    fastcl_config(cpp={"test_rows": rows, "gemm": gemm})
    inputs = _gist_inputs(B, d, g, Q, seed=B * d)
    N = B * (3 + Q)
    for dtype in (torch.float64, torch.float32):
        got = _gist_run(inputs, native=True, dtype=dtype, monkeypatch=monkeypatch, **options)
        want = _gist_run(inputs, native=False, dtype=dtype, monkeypatch=monkeypatch, **options)
        # the logits' size 1/tau (times |a||c| for dot products) bounds every summed term
        size = 20.0 * (max(x.norm(dim=-1).max().item() for x in inputs[:3]) ** 2 if "similarity" in options else 1)
        assert_roundoff(got, want, dtype, terms=d + N, magnitude=size, msg=f"{dtype} joint vs composed")


def test_cpp_joint_sweep_is_taken_and_its_nonfinite_rows_match(monkeypatch):
    """GIST on cpp takes ``fused_joint`` (a spy), and NaN/inf in an anchor or a positive poison
    the same rows and gradients as the composition (the filter's rule: a dropped NaN reaches nothing)."""
    require("cpp")
    calls = []
    real = type(_cpp.BACKEND).fused_joint
    monkeypatch.setattr(type(_cpp.BACKEND), "fused_joint", lambda self, *a: calls.append(1) or real(self, *a))
    for nonfinite in ("positive", "anchor"):
        inputs = _gist_inputs(9, 6, 4, 1, seed=3, nonfinite=nonfinite)
        got = _gist_run(inputs, native=True, dtype=torch.float64, monkeypatch=monkeypatch, reduction="sum")
        want = _gist_run(inputs, native=False, dtype=torch.float64, monkeypatch=monkeypatch, reduction="sum")
        assert_roundoff(got, want, torch.float64, terms=6 + 36, magnitude=20.0, equal_nan=True, msg=nonfinite)
        assert torch.isnan(got[0]), "a non-finite row must make the summed loss NaN"
    assert len(calls) == 2
