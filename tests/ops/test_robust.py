"""Adversarial inputs (the non-finite rules of docs/contracts.md): no silent wrong answers.

* Non-finite values never disappear: NaN/Inf in a *valid* embedding makes the loss of
  every row that sees it NaN; in a *padded* slot it has no influence at all (the loss
  equals the loss with the slot zeroed, gradients are finite, the slot's is exactly 0).
  A padded slot's gradient stays exactly 0 next to a NaN/Inf anchor row too (not 0 * NaN).
* Cosine similarity is scale-free: fp32 inputs scaled by 1e30 give the unscaled loss.
* One validation rule per argument, the same for every loss and backend.
* SupMPN's head is exact in float64.

Backends: the reference plus ``tests/helpers/backends.py``'s list (CPU by default).
"""

from __future__ import annotations

import functools

import pytest
import torch

import fastcl.losses as L
from fastcl.ops import dispatch
from fastcl.ops.contract import TAG_ALL, TAG_PADDING, LSEProblem, OwnPositives
from fastcl.ops.head import head_rows
from fastcl.testing import eps
from tests.helpers.backends import backends_under_test, device_under_test, require
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_and_grads_roundoff, assert_loss_roundoff

BACKENDS = ["reference", *backends_under_test()]
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
LOSSES = {
    "supmpn": L.supmpn_loss,
    "supmpn_zero_logit": functools.partial(L.supmpn_loss, own_positives="zero_logit"),
    "supcon": L.supcon_loss,
}


@pytest.fixture(params=BACKENDS)
def backend(request):
    require(request.param)
    return request.param


def _structured(B=4, P=3, Q=2, d=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dev = device_under_test()

    def r(*s):
        return torch.randn(*s, generator=gen).to(device=dev, dtype=dtype)

    pm = torch.ones(B, P, dtype=torch.bool, device=dev)
    nm = torch.ones(B, Q, dtype=torch.bool, device=dev)
    pm[1, 2] = False
    nm[2, 0] = False
    return r(B, d), r(B, P, d), r(B, Q, d), pm, nm


def _terms(a, p, n):
    """Round-off terms (tests/helpers/roundoff.py): a logit's d, a row's candidates, B anchors."""
    B, d = a.shape
    return d + B * (p.shape[1] + (0 if n is None else n.shape[1])) + B


def _logit_scale(tau, similarity, *rows):
    """1/tau for cosine; the largest |a| |c| / tau of the finite rows for dot products."""
    if similarity == "cos":
        return 1 / tau
    norms = [r.detach().double().reshape(-1, r.shape[-1]).norm(dim=-1) for r in rows]
    a, *c = (x[torch.isfinite(x)].max().item() for x in norms)
    return a * max(c) / tau


def _loss_and_grads(fn, a, p, n, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (a, p, n)]
    out = fn(*leaves, **kw)
    grads = torch.autograd.grad(out.double().sum(), leaves)
    return out.detach(), grads


# --------------------------------------------------------------------------- bad input is refused


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("slot", ["positive", "negative"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_padded_nonfinite_has_no_influence(backend, loss, bad, slot, reduction):
    a, p, n, pm, nm = _structured()
    kw = dict(pos_mask=pm, neg_mask=nm, reduction=reduction, backend=backend, temperature=0.1)
    clean_p, clean_n = p.clone(), n.clone()
    if slot == "positive":
        clean_p[1, 2] = 0
        p[1, 2] = BAD[bad]
        p[1, 2, 0] = 1.0  # a mix of finite and non-finite values in the slot
    else:
        clean_n[2, 0] = 0
        n[2, 0] = BAD[bad]
    want, want_g = _loss_and_grads(LOSSES[loss], a, clean_p, clean_n, **kw)
    got, got_g = _loss_and_grads(LOSSES[loss], a, p, n, **kw)
    assert torch.isfinite(got).all(), got
    for name, g in zip(("anchor", "positives", "negatives"), got_g):
        assert torch.isfinite(g).all(), f"d {name} is not finite"
    assert_loss_and_grads_roundoff(got, want, got_g, want_g, a.dtype, terms=_terms(a, p, n), logit_scale=1 / 0.1)
    assert (got_g[1][~pm] == 0).all() and (got_g[2][~nm] == 0).all()


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("slot", ["anchor", "positive", "negative"])
@pytest.mark.parametrize("similarity", ["cos", "dot"])
def test_valid_nonfinite_makes_every_seeing_row_nan(backend, loss, bad, slot, similarity):
    a, p, n, pm, nm = _structured()
    if slot == "anchor":
        a[0, 3] = BAD[bad]
        seen_by = [0]
    elif slot == "positive":
        p[0, 1, 3] = BAD[bad]  # anchor 0's positive: a candidate of every row
        seen_by = [0, 1, 2, 3]
    else:
        n[3, 1, 3] = BAD[bad]
        seen_by = [0, 1, 2, 3]
    kw = dict(pos_mask=pm, neg_mask=nm, backend=backend, similarity=similarity, temperature=0.1)
    rows = LOSSES[loss](a, p, n, reduction="none", **kw)
    assert torch.isnan(rows[seen_by]).all(), rows
    others = [i for i in range(4) if i not in seen_by]
    assert torch.isfinite(rows[others]).all(), rows
    assert torch.isnan(LOSSES[loss](a, p, n, reduction="mean", **kw))


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("slot", ["positive", "negative"])
@pytest.mark.parametrize("similarity", ["cos", "dot"])
def test_valid_nonfinite_candidate_reaches_every_gradient(backend, loss, bad, slot, similarity):
    """A NaN/Inf candidate seen by every row makes every row's softmax undefined: each valid
    entry of every gradient is NaN (what autograd gives), never the finite ``exp(logit)`` of a
    row whose lse is NaN; padded slots stay exactly 0."""
    a, p, n, pm, nm = _structured()
    if slot == "positive":
        p[0, 1, 3] = BAD[bad]
    else:
        n[3, 1, 3] = BAD[bad]
    kw = dict(pos_mask=pm, neg_mask=nm, backend=backend, similarity=similarity, temperature=0.1)
    _, (ga, gp, gn) = _loss_and_grads(LOSSES[loss], a, p, n, **kw)
    assert torch.isnan(ga).all(), f"d anchor: {ga.isnan().sum()} of {ga.numel()} NaN"
    for name, g, m in (("positives", gp, pm), ("negatives", gn, nm)):
        assert torch.isnan(g[m]).all(), f"d {name}: {g[m].isnan().sum()} of {g[m].numel()} NaN"
        assert (g[~m] == 0).all(), f"a padded slot of d {name}"


@pytest.mark.parametrize("bad", list(BAD))
def test_pool_loss_padded_positive_and_candidate(backend, bad):
    """supcon_pool_loss: a padded positive index and a padded candidate holding NaN/Inf."""
    gen, dev = torch.Generator().manual_seed(3), device_under_test()
    a, c = torch.randn(3, 6, generator=gen).to(dev), torch.randn(5, 6, generator=gen).to(dev)
    idx = torch.tensor([[0, 4], [1, 2], [3, 4]], device=dev)
    cand_mask = torch.tensor([True, True, True, True, False], device=dev)
    clean = c.clone()
    clean[4] = 0
    c[4] = BAD[bad]
    kw = dict(cand_mask=cand_mask, backend=backend)

    def run(cands):
        leaves = [a.clone().requires_grad_(True), cands.clone().requires_grad_(True)]
        out = L.supcon_pool_loss(*leaves, idx, **kw)
        return out.detach(), torch.autograd.grad(out, leaves)

    want, want_g = run(clean)
    got, got_g = run(c)
    assert all(torch.isfinite(g).all() for g in got_g)
    # d = 6 coordinates, 5 candidates, 3 anchors; logits of size 1 / 0.05 (the default)
    assert_loss_and_grads_roundoff(got, want, got_g, want_g, a.dtype, terms=6 + 5 + 3, logit_scale=1 / 0.05)
    assert (got_g[1][4] == 0).all()


def _assert_like_reference(got, want, what, *, terms, logit_scale, logits=False):
    """NaN exactly where the float64 reference has NaN, the other entries within float64
    round-off of it (tests/helpers/roundoff.py; ``logits``: a logit-sized value, else a
    gradient)."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN entries differ from the reference"
    got, want = got.nan_to_num(0.0), want.nan_to_num(0.0)
    check = assert_loss_roundoff if logits else assert_grad_roundoff
    check(got, want, torch.float64, terms=terms, logit_scale=logit_scale, msg=what)


PADDED_LOSSES = {
    "supmpn": lambda a, p, n, pm, nm, **kw: L.supmpn_loss(a, p, n, pos_mask=pm, neg_mask=nm, **kw),
    "supcon": lambda a, p, n, pm, nm, **kw: L.supcon_loss(a, p, n, pos_mask=pm, neg_mask=nm, **kw),
    "mnrl": lambda a, p, n, pm, nm, **kw: L.mnrl_loss(a, p[:, 0], n, neg_mask=nm, **kw),
}


@pytest.mark.parametrize("loss", list(PADDED_LOSSES))
@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("strategy", ["fused", "recompute"])
@pytest.mark.parametrize("similarity", ["cos", "dot"])
def test_nonfinite_anchor_leaves_padded_slots_zero(
    fastcl_config, monkeypatch, backend, loss, bad, strategy, similarity
):
    """A NaN/Inf anchor row reaches every valid candidate (NaN) but no padded one: padded
    negatives and padded own positives (anchor 1's own) get exactly 0, as in the reference
    (the GEMM E_c = X^T A would give them 0 * NaN)."""
    if backend == "reference":
        pytest.skip("the reference is the oracle here")
    if strategy == "fused" and dispatch.get(backend).fused is None:
        pytest.skip(f"the {backend} backend has no fused path")
    a, p, n, pm, nm = _structured(dtype=torch.float64)  # pm[1, 2], nm[2, 0] padded
    a[1, 3] = BAD[bad]
    fn = functools.partial(PADDED_LOSSES[loss], pm=pm, nm=nm, temperature=0.1, similarity=similarity)
    want, want_g = _loss_and_grads(fn, a, p, n, backend="reference")
    fastcl_config(strategy=strategy)
    got, got_g = _loss_and_grads(fn, a, p, n, backend=backend)
    assert torch.isnan(got) and torch.isnan(want)
    scale = _logit_scale(0.1, similarity, a, p, n)
    for name, g, w in zip(("anchor", "positives", "negatives"), got_g, want_g):
        _assert_like_reference(g, w, f"d {name}", terms=_terms(a, p, n), logit_scale=scale)
    if loss != "mnrl":
        assert (got_g[1][~pm] == 0).all(), "a padded own positive"
    assert (got_g[2][~nm] == 0).all(), "a padded negative"
    assert torch.isfinite(got_g[0][[0, 2, 3]]).all()


@pytest.mark.parametrize(
    "dims, col",
    [(None, 3), ((3, 8), 1), ((3, 8), 5)],
    ids=["plain", "matryoshka-every-prefix", "matryoshka-long-prefix"],
)
@pytest.mark.parametrize("cosine", [True, False])
@pytest.mark.parametrize("bad", [*BAD, "finite"])
def test_nonfinite_anchor_primitive_backward(backend, bad, cosine, dims, col):
    """The primitive's backward (own positives folded), plain and Matryoshka: padded candidate
    rows (a padded own positive with a nonzero d_pos among them) exactly 0, next to a NaN/Inf
    anchor row too, every other entry NaN where the float64 reference has NaN and close to it
    elsewhere."""
    gen = torch.Generator().manual_seed(11)
    dev = device_under_test()
    B, P, d = 4, 2, 8

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(dev)

    a, b0, b1 = r(B, d), r(B * P + 3, d), r(2, d)  # block 0: the own positives, then 3 shared
    if bad != "finite":
        a[1, col] = BAD[bad]
    own = torch.arange(B, dtype=torch.int32).repeat_interleave(P)
    own[3] = TAG_PADDING  # anchor 1's second own positive
    t0 = torch.cat([own, torch.tensor([TAG_ALL, TAG_PADDING, TAG_ALL], dtype=torch.int32)]).to(dev)
    t1 = torch.tensor([TAG_PADDING, TAG_ALL], dtype=torch.int32, device=dev)
    b0[[3, B * P + 1]] = float("nan")  # padded rows are never read
    problem = LSEProblem(a, (b0, b1), (t0, t1), cosine, positives=OwnPositives(0, P), dims=dims)
    impl = dispatch.get(backend)
    if why := impl.unsupported(problem):
        pytest.skip("; ".join(why))
    lead = () if dims is None else (len(dims),)
    tau = torch.tensor(0.1, dtype=torch.float64, device=dev)
    g = r(*lead, B).abs() + 0.5  # nonzero: a zero row gradient is skipped by some backends
    d_pos = r(*lead, B, P)
    if bad != "finite":
        d_pos[..., 1, 0] = float("nan")  # what a head gives the NaN row's valid positive
    d_pos[..., 1, 1] = 0.7  # its padded one: folded, it must still give that row nothing

    ref = dispatch.get("reference")
    want_lse = ref.forward(problem, tau)[0]
    want_a, want_b = ref.backward(problem, tau, want_lse, g, d_pos)
    lse = impl.forward(problem, tau)[0]
    got_a, got_b = impl.backward(problem, tau, lse, g, d_pos)
    kw = dict(terms=d + B * P + 3 + 2 + B, logit_scale=_logit_scale(0.1, "cos" if cosine else "dot", a, b0, b1))
    _assert_like_reference(lse, want_lse, "lse", logits=True, **kw)
    _assert_like_reference(got_a, want_a, "d anchor", **kw)
    for k, (got, want, tags) in enumerate(zip(got_b, want_b, (t0, t1))):
        assert (got[tags == TAG_PADDING] == 0).all(), f"a padded row of d_block{k}"
        _assert_like_reference(got, want, f"d_block{k}", **kw)


# --------------------------------------------------------------------------- cosine is scale-free


@pytest.mark.parametrize("scale", [1e30, 1e20, 1e-6, 3e-5])
@pytest.mark.parametrize("loss", ["supmpn", "supcon"])
def test_cosine_is_scale_free(backend, scale, loss):
    a, p, n, pm, nm = _structured(d=16, seed=1)
    kw = dict(pos_mask=pm, neg_mask=nm, backend=backend, temperature=0.1)
    want, want_g = _loss_and_grads(LOSSES[loss], a, p, n, **kw)
    got, got_g = _loss_and_grads(LOSSES[loss], a * scale, p * scale, n * scale, **kw)
    # scaling rounds each input once, so the normalised rows move by float32 round-off:
    # as another summation order would (tests/helpers/roundoff.py)
    got_g = [g.double() * scale for g in got_g]  # d loss / d (s x) = (d loss / d x) / s
    assert_loss_and_grads_roundoff(got, want, got_g, want_g, torch.float32, terms=_terms(a, p, n), logit_scale=10.0)


def test_cosine_scale_free_float64(backend):
    a, p, n, pm, nm = _structured(d=16, seed=2, dtype=torch.float64)
    kw = dict(pos_mask=pm, neg_mask=nm, backend=backend, temperature=0.1)
    want = L.supmpn_loss(a, p, n, **kw)
    got = L.supmpn_loss(a * 1e200, p * 1e200, n * 1e200, **kw)
    assert_loss_roundoff(got, want, torch.float64, terms=_terms(a, p, n), logit_scale=10.0)


# ---------------------------------------------------------------------------- tensor temperatures

A, P, N = torch.randn(4, 8), torch.randn(4, 2, 8), torch.randn(4, 3, 8)


@pytest.mark.parametrize(
    "temperature",
    [
        float("inf"),
        torch.tensor(float("inf")),
        torch.tensor(float("nan")),
        1e-39,
        torch.tensor(1e-39),
        torch.tensor(0.0),
        torch.tensor(-1.0),
        1e-300,
        float("nan"),
    ],
    ids=["inf", "tensor-inf", "tensor-nan", "1e-39", "tensor-1e-39", "tensor-0", "tensor-neg", "1e-300", "nan"],
)
def test_bad_temperature_refused_on_every_backend(backend, temperature):
    with pytest.raises(ValueError, match="temperature"):
        L.supmpn_loss(A, P, N, temperature=temperature, backend=backend)


def test_float64_temperature_range_is_float64():
    # 1e-39 is a fine float64 temperature: 1/tau is finite in float64
    out = L.supmpn_loss(A.double(), P.double(), N.double(), temperature=1e-39, backend="reference")
    assert torch.isfinite(out)


@pytest.mark.parametrize("cls", [L.SupMPNLoss, L.SupConLoss, L.MNRLoss, L.InfoNCELoss, L.EdaCSELoss])
def test_modules_accept_tensor_temperature(cls):
    m = cls(temperature=torch.tensor(0.05))
    assert m.temperature == pytest.approx(0.05)
    with pytest.raises(ValueError, match="temperature"):
        cls(temperature=torch.tensor(float("inf")))
    with pytest.raises(ValueError, match="temperature"):
        cls(temperature=1e-39)
    m = cls(temperature=torch.tensor(0.1), learn_temperature=True)
    assert float(m.temperature) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.randn(0, 8), torch.randn(5, 8), torch.zeros(0, 1, dtype=torch.long)), ValueError, "non-empty"),
        ((torch.randn(3, 0), torch.randn(5, 0), torch.zeros(3, 1, dtype=torch.long)), ValueError, "non-empty"),
        ((torch.randn(3, 8), torch.randn(5, 8), [[0], [1], [2]]), TypeError, "pos_index must be"),
    ],
    ids=["B=0", "d=0", "list-index"],
)
def test_pool_loss_refuses_degenerate_inputs(args, exc, match):
    with pytest.raises(exc, match=match):
        L.supcon_pool_loss(*args)


def test_bad_strategy_refused_without_grad(backend):
    with pytest.raises(ValueError, match="strategy='bogus'"):
        with torch.no_grad():
            L.supmpn_loss(A, P, N, backend=backend, strategy="bogus")


# ---------------------------------------------------------------------------- the head in float64


def test_supmpn_head_is_exact_in_float64():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    gen = torch.Generator().manual_seed(5)
    lse = torch.randn(64, generator=gen, dtype=torch.float64) * 15
    pos = torch.randn(64, 3, generator=gen, dtype=torch.float64) * 15
    lse[:8] = pos[:8, 0] + torch.linspace(18, 40, 8, dtype=torch.float64)  # where softplus' threshold bites
    loss, dlse, dpos = head_rows(lse, pos, None, "softplus")
    # one rounding of each result (eps/2) and of the one exp/log1p it passes through (eps/2
    # relative, at most |x| eps/2 absolute through exp): 2 eps, relative to max(1, |loss|)
    ulp2 = 2 * eps(torch.float64)
    for i in range(64):
        xs = [mpmath.mpf(float(lse[i])) - mpmath.mpf(float(pos[i, k])) for k in range(3)]
        want = sum(mpmath.log1p(mpmath.exp(x)) for x in xs) / 3
        want_d = sum(1 / (1 + mpmath.exp(-x)) for x in xs) / 3
        assert abs(float(loss[i]) - float(want)) <= ulp2 * max(1.0, abs(float(want))), i
        assert abs(float(dlse[i]) - float(want_d)) <= ulp2, i
        for k in range(3):
            want_k = -1 / (1 + mpmath.exp(-xs[k])) / 3
            assert abs(float(dpos[i, k]) - float(want_k)) <= ulp2, (i, k)


def test_supmpn_head_exact_on_backends(backend):
    """The C++ head (csrc/cpu/head.h) must be as exact as head.py in float64."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    # anchor = negative = -positive: x = l_neg - l_pos = 2 / tau = 21, where softplus'
    # threshold (20) would return x and lose exp(-21) ~ 8e-10
    a = torch.tensor([[1.0, 0.0]], dtype=torch.float64, device=device_under_test())
    p = -a[:, None, :]
    n = a[:, None, :].clone()
    tau = 2 / 21
    out = L.supmpn_loss(a, p, n, temperature=tau, backend=backend)
    x = 2 / mpmath.mpf(tau)
    want = mpmath.log1p(mpmath.exp(x))
    # float64 round-off of two 2-term logits of size 1/tau (tests/helpers/roundoff.py)
    assert_loss_roundoff(
        out.cpu(), torch.tensor(float(want), dtype=torch.float64), torch.float64, terms=2, logit_scale=2 / tau
    )


@pytest.mark.parametrize("bad", list(BAD))
def test_anchor_without_positive_is_not_read(backend, bad):
    a, p, n, pm, nm = _structured()
    pm[2] = False  # anchor 2 has no valid positive: it contributes nothing
    kw = dict(pos_mask=pm, neg_mask=nm, backend=backend, temperature=0.1)
    clean = a.clone()
    clean[2] = 0
    a[2, 1] = BAD[bad]
    want, want_g = _loss_and_grads(L.supmpn_loss, clean, p, n, **kw)
    got, got_g = _loss_and_grads(L.supmpn_loss, a, p, n, **kw)
    assert all(torch.isfinite(g).all() for g in got_g)
    assert_loss_and_grads_roundoff(got, want, got_g, want_g, a.dtype, terms=_terms(a, p, n), logit_scale=1 / 0.1)
    assert (got_g[0][2] == 0).all()


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("Q", [0, 9])
def test_nonfinite_only_candidate_of_a_row(backend, bad, Q):
    """SupMPN, Q = 0: row 1's only candidate is anchor 0's positive; a NaN/Inf there must
    not be skipped as if the row were empty (a NaN-dropping max made lse = -inf, loss 0)."""
    gen, dev = torch.Generator().manual_seed(7), device_under_test()
    a, p = torch.randn(2, 3, generator=gen).to(dev), torch.randn(2, 1, 3, generator=gen).to(dev)
    n = torch.randn(2, Q, 3, generator=gen).to(dev) if Q else None
    nm = torch.zeros(2, Q, dtype=torch.bool, device=dev) if Q else None  # padded: no other candidate
    p[0, 0, 1] = BAD[bad]
    rows = L.supmpn_loss(a, p, n, neg_mask=nm, reduction="none", backend=backend)
    assert torch.isnan(rows).all(), rows
