"""``matryoshka_dims`` / ``matryoshka_weights`` on every LSE loss: float64 values and gradients
equal the weighted sum of the plain loss on each truncated prefix (sentence-transformers'
``MatryoshkaLoss`` definition), on the reference backend and every backend under test."""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L
from fastcl.losses import mnrl_directions_loss
from fastcl.ops.backend import MATRYOSHKA_BACKENDS, dims_reason
from tests.helpers.backends import backends_under_test, device_under_test, require
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff, assert_tau_grad_roundoff

B, P, Q, D = 6, 2, 3, 12
DIMS, WEIGHTS = (12, 5, 8), (1.0, 0.5, 2.0)
# a logit's D coordinates, a row's B (1 + P + Q) candidates, a column's B anchors
TERMS = D + B * (1 + P + Q) + B
GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def _inputs(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device).requires_grad_()  # noqa: E731
    return dict(
        a=r(B, D),
        p=r(B, P, D),
        n=r(B, Q, D),
        p1=r(B, D),
        v=r(B, D),
        tau=torch.tensor(0.2, dtype=torch.float64, device=device, requires_grad=True),
    )


def _pos_mask(x):
    return torch.tensor(
        [[True, False], [True, True], [False, False], [True, True], [False, True], [True, True]], device=x["a"].device
    )


# name -> fn(x, **kw) running the loss on inputs x (a dict of tensors) with extra kw
CASES = {
    "supmpn": lambda x, **kw: L.supmpn_loss(x["a"], x["p"], x["n"], pos_mask=_pos_mask(x), **kw),
    "supmpn_zero_logit": lambda x, **kw: L.supmpn_loss(x["a"], x["p"], x["n"], own_positives="zero_logit", **kw),
    "supcon": lambda x, **kw: L.supcon_loss(x["a"], x["p"], x["n"], neg_mask=(torch.rand(B, Q, generator=torch.Generator().manual_seed(1)) > 0.4).to(x["a"].device), **kw),
    "supcon_labels": lambda x, **kw: L.supcon_loss(x["p"], labels=torch.tensor([0, 1, 0, 2, 1, 3], device=x["a"].device), **kw),
    "mnrl": lambda x, **kw: L.mnrl_loss(x["a"], x["p1"], x["n"], **kw),
    "mnrl_directions": lambda x, **kw: mnrl_directions_loss(x["a"], x["p1"], x["n"], directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction", hardness_mode="all_negatives", hardness_strength=2.0, **kw),
    "mnrl_gte_in_batch": lambda x, **kw: mnrl_directions_loss(x["a"], x["p1"], x["n"], directions=GTE, hardness_mode="in_batch_negatives", hardness_strength=3.0, **kw),
    "mnrl_gte_hard_negatives": lambda x, **kw: mnrl_directions_loss(x["a"], x["p1"], x["n"], directions=GTE, hardness_mode="hard_negatives", hardness_strength=3.0, **kw),
    "mnrl_q2q": lambda x, **kw: L.mnrl_loss(x["a"], x["p1"], directions=("query_to_doc", "query_to_query"), **kw),
    "infonce_symmetric": lambda x, **kw: L.infonce_loss(x["a"], x["p1"], symmetric=True, **kw),
    "edacse": lambda x, **kw: L.edacse_loss(x["a"], x["p1"], x["v"], **kw),
    "supcon_pool": lambda x, **kw: L.supcon_pool_loss(x["a"], x["p"].flatten(0, 1), torch.arange(B * P, device=x["a"].device).view(B, P), **kw),
}  # fmt: skip


def _truncated(x, m):
    return {k: (v if k == "tau" else v[..., :m]) for k, v in x.items()}


def _grads(loss, x):
    keys = [k for k in x if x[k].requires_grad]
    grads = torch.autograd.grad(loss.sum(), [x[k] for k in keys], allow_unused=True)
    return {k: torch.zeros_like(x[k]) if g is None else g for k, g in zip(keys, grads)}


@pytest.mark.parametrize("backend", ["reference", *backends_under_test()])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("similarity", ["cos", "dot"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_the_weighted_sum_of_truncated_losses(case, backend, reduction, similarity):
    require(backend)
    if backend not in MATRYOSHKA_BACKENDS:
        pytest.skip(dims_reason(backend))
    fn, x = CASES[case], _inputs(device=device_under_test())
    kw = dict(temperature=x["tau"], reduction=reduction, similarity=similarity)
    got = fn(x, backend=backend, matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS, **kw)
    want = sum(w * fn(_truncated(x, m), backend="reference", **kw) for m, w in zip(DIMS, WEIGHTS))
    # float64: logits of size 1/tau (cos) or |a| |c| / tau ~ D / tau (dot), weighted by sum(WEIGHTS);
    # a sum over the B rows (the gradients always differentiate the sum) adds B of them
    scale = sum(WEIGHTS) * (D if similarity == "dot" else 1) / float(x["tau"])
    assert_loss_roundoff(got, want, torch.float64, terms=TERMS, logit_scale=scale * (B if reduction == "sum" else 1))
    got_g, want_g = _grads(got, x), _grads(want, x)
    for k in got_g:
        if k == "tau":
            rows = 1 if reduction == "mean" else B
            assert_tau_grad_roundoff(got_g[k], want_g[k], torch.float64, terms=TERMS, logit_scale=scale, rows=rows)
        else:  # a gradient may cancel: terms of size d logit / d x ~ 1 per unit of logit
            assert_grad_roundoff(
                got_g[k], want_g[k], torch.float64, terms=TERMS, logit_scale=scale, term_size=1.0, msg=k
            )


def test_default_weights_are_one_and_order_does_not_matter():
    x = _inputs(2)
    one = L.mnrl_loss(x["a"], x["p1"], backend="torch", matryoshka_dims=(4, 12))
    other = L.mnrl_loss(x["a"], x["p1"], backend="torch", matryoshka_dims=(12, 4), matryoshka_weights=[1, 1])
    want = L.mnrl_loss(x["a"], x["p1"]) + L.mnrl_loss(x["a"][:, :4], x["p1"][:, :4])
    torch.testing.assert_close(one, want)
    torch.testing.assert_close(other, want)


def test_modules_take_the_options():
    x = _inputs(3)
    mod = L.MNRLoss(0.1, matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS)
    fn = L.mnrl_loss(x["a"], x["p1"], temperature=0.1, matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS)
    torch.testing.assert_close(mod(x["a"], x["p1"]), fn)
    for cls in (L.SupMPNLoss, L.SupConLoss, L.InfoNCELoss, L.EdaCSELoss):
        assert cls(matryoshka_dims=(8, 4)).options["matryoshka_dims"] == (8, 4)


@pytest.mark.parametrize(
    "dims, weights, match",
    [((8, 8), None, "distinct"), ((13,), None, "distinct"), ((0, 4), None, "distinct"), ((8, 4), (1.0,), "one weight"),
     ((8, 4), (1.0, float("nan")), "finite"), (None, (1.0,), "without matryoshka_dims")],
)  # fmt: skip
def test_bad_options_raise(dims, weights, match):
    x = _inputs()
    with pytest.raises(ValueError, match=match):
        L.mnrl_loss(x["a"], x["p1"], matryoshka_dims=dims, matryoshka_weights=weights)
    with pytest.raises(ValueError, match=match):
        L.supcon_pool_loss(x["a"], x["p1"], torch.arange(B)[:, None], matryoshka_dims=dims, matryoshka_weights=weights)


def test_fused_strategy_refuses_dims(fastcl_config, monkeypatch):
    fastcl_config(strategy="fused")
    x = _inputs()
    with pytest.raises(ValueError, match="matryoshka dims"):
        L.mnrl_loss(x["a"], x["p1"], backend="torch", matryoshka_dims=(8, 4))


def test_double_backward_on_the_reference_backend():
    g = torch.Generator().manual_seed(4)
    a, p, n = (torch.randn(3, *s, 6, generator=g, dtype=torch.float64, requires_grad=True) for s in ((), (2,), (2,)))

    def loss(a, p, n):
        return L.supmpn_loss(
            a, p, n, backend="reference", temperature=0.5, matryoshka_dims=(6, 2, 4), matryoshka_weights=(1, 2, 3)
        )

    torch.autograd.gradgradcheck(loss, (a, p, n))
    with pytest.raises(RuntimeError, match="first derivatives only"):
        (d_a,) = torch.autograd.grad(
            L.supmpn_loss(a, p, n, backend="torch", matryoshka_dims=(6, 2)), a, create_graph=True
        )
        d_a.sum().backward()


def test_half_precision_on_torch():
    x = {k: v.detach().to(torch.bfloat16) for k, v in _inputs(5).items() if k != "tau"}
    got = L.mnrl_loss(x["a"], x["p1"], x["n"], backend="torch", matryoshka_dims=DIMS)
    want = sum(L.mnrl_loss(x["a"][:, :m].double(), x["p1"][:, :m].double(), x["n"][..., :m].double()) for m in DIMS)
    assert got.dtype == torch.bfloat16
    # bfloat16 inputs summed in float32, the result rounded to bfloat16; logits of size 1/0.05 per dim
    assert_loss_roundoff(got, want, torch.bfloat16, terms=TERMS, logit_scale=len(DIMS) / 0.05)


# --------------------------------------------------------------------------- argument papercuts


def test_numpy_integers_and_generators_are_dims_and_weights():
    """NumPy integers are ints (as NumPy scalars are numbers for the temperature), and any
    iterable of dims or weights works once, in the functions and in the modules alike."""
    np = pytest.importorskip("numpy")
    x = _inputs(4)
    want = L.mnrl_loss(x["a"], x["p1"], matryoshka_dims=(12, 4), matryoshka_weights=(1.0, 0.5))
    for dims, weights in [
        (np.array([12, 4]), np.array([1.0, 0.5])),
        ((np.int64(12), np.int32(4)), (np.float32(1.0), 0.5)),
        ((m for m in (12, 4)), (w for w in (1.0, 0.5))),
    ]:
        got = L.mnrl_loss(x["a"], x["p1"], matryoshka_dims=dims, matryoshka_weights=weights)
        torch.testing.assert_close(got, want)
    mod = L.MNRLoss(0.05, matryoshka_dims=(m for m in (12, 4)), matryoshka_weights=(w for w in (1.0, 0.5)))
    torch.testing.assert_close(mod(x["a"], x["p1"]), want)
    torch.testing.assert_close(mod(x["a"], x["p1"]), want)  # the module kept them, not a spent generator
    assert mod.options["matryoshka_dims"] == (12, 4) and mod.options["matryoshka_weights"] == (1.0, 0.5)


def _dims_id(dims) -> str:  # stable across processes (pytest-xdist's workers must agree)
    return type(dims).__name__ if not isinstance(dims, tuple) else repr(dims)


@pytest.mark.parametrize("dims", [iter(()), (m for m in ()), (), (4.0, 2), ("8",), (True, 4)], ids=_dims_id)
def test_bad_dims_say_what_was_given(dims):
    """A spent or empty iterable, floats, strings and bools are refused with what they were."""
    x = _inputs(5)
    with pytest.raises((TypeError, ValueError), match=r"matryoshka_dims"):
        L.mnrl_loss(x["a"], x["p1"], matryoshka_dims=dims)


def test_generator_dims_error_names_the_values():
    """A generator of out-of-range dims is reported with its values, not as the spent ``()``."""
    x = _inputs(5)
    with pytest.raises(ValueError, match=r"\(12, 40\)"):
        L.mnrl_loss(x["a"], x["p1"], matryoshka_dims=(m for m in (12, 40)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_are_finite_in_the_compute_dtype(dtype):
    """1e300 is a finite Python float but inf in float32 (the compute dtype of 16- and 32-bit
    inputs): refused up front instead of returning inf; float64 inputs take it."""
    x = {k: v.detach().to(dtype) for k, v in _inputs(6).items()}
    with pytest.raises(ValueError, match="matryoshka_weights"):
        L.mnrl_loss(x["a"], x["p1"], matryoshka_dims=(12, 4), matryoshka_weights=(1e300, 1.0))
    with pytest.raises(ValueError, match="matryoshka_weights"):
        L.supcon_labels_loss(x["a"], torch.arange(B) % 2, matryoshka_dims=(12, 4), matryoshka_weights=(1.0, -1e39))
    x64 = _inputs(6)
    out = L.mnrl_loss(x64["a"], x64["p1"], matryoshka_dims=(12, 4), matryoshka_weights=(1e300, 1.0))
    assert torch.isfinite(out)
