"""``gist_loss`` and the self-margin filter against their float64 oracles, on every backend.

``fastcl.reference.gist`` writes sentence-transformers 6.2's ``GISTEmbedLoss`` forward out
(the ``[ap | aa | pp | an]`` similarity blocks, ``-inf`` where the guide drops a candidate,
cross-entropy); ``fastcl.reference.self_margin_mnrl`` the self-margin filter. Values and the
gradients of every embedding argument must agree (float64) for every option: margin
strategy x margin x contrast_anchors x contrast_positives x 0, 1 or 2 negatives per anchor x
temperature, the reductions, and Matryoshka prefixes (the sum over prefixes, the guide's
decisions shared by all of them; the self-margin thresholds per prefix). The guide groups
the texts into a few meanings, so it drops some in-batch candidates and keeps others.

The drop-ins built on these (sentence-transformers' ``GISTEmbedLoss``): tests/integrations/test_st_gist.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import fastcl.losses as L
from fastcl import reference as R
from tests.helpers.backends import backends_under_test, device_under_test, require
from tests.helpers.gradcache import one_thread  # noqa: F401  (the fixture)
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff

# B = 7: one intra-op thread (two stall each other on a busy 2-core machine: 5x slower)
pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = ["reference", *backends_under_test()]
B, D, G = 7, 9, 5
# float64 sums behind a value or gradient entry: a logit's D coordinates, a row's candidates
# (the [ap | aa | pp | an] blocks, up to 5 x B) and a column's B anchors
TERMS = D + 5 * B + B


@pytest.fixture(params=BACKENDS)
def backend(request):
    require(request.param)
    return request.param


def _inputs(Q: int, seed: int, *, B: int = B, d: int = D):
    """anchor, positive, negatives ([B, Q, d] or None, [B, d] for Q = 1 as a 2-D tensor) with
    grad, and the guide (ga, gp[, gn]) of three meanings: a_i and p_i share one."""
    g = torch.Generator().manual_seed(seed)
    dev = device_under_test()
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    n = B * (2 + Q)
    meanings = r(3, G)
    of = torch.randint(0, 3, (n,), generator=g)
    of[B : 2 * B] = of[:B]
    guide = meanings[of] + 0.6 * r(n, G)
    a, p = r(B, d), r(B, d)
    p = p + 0.5 * a  # pairs that agree, as after some training
    neg = None if Q == 0 else (r(B, d) if Q == 1 else r(B, Q, d))
    leaves = [t.to(dev).requires_grad_() for t in (a, p, neg) if t is not None]
    ga, gp = guide[:B].to(dev), guide[B : 2 * B].to(dev)
    gn = guide[2 * B :].to(dev)
    guide_t = (ga, gp) if Q == 0 else (ga, gp, gn if Q == 1 else gn.reshape(Q, B, G).transpose(0, 1).contiguous())
    return leaves, guide_t


def _negatives(leaves):
    return leaves[2] if len(leaves) > 2 else None


def _value_grads(fn, leaves):
    value = fn()
    return value.detach(), torch.autograd.grad(value.sum(), leaves)


def _scale(leaves, temperature: float, similarity: str = "cos", weight: float = 1.0) -> tuple[float, float]:
    """The logits' size, ``1/temperature`` (cos) or ``max|a| max|c| / temperature`` (dot), times
    ``weight`` (the sum of Matryoshka weights); and the size of a gradient's terms, softmax
    weights times d logit / d a, which cancel where the softmax saturates: ``|c| / temperature``
    for dot products, ``(c/|c| - cos a/|a|) / (|a| temperature) <= 2 / (min|a| temperature)``."""
    norms = [t.detach().norm(dim=-1) for t in leaves]
    big, small = max(n.max().item() for n in norms), min(n.min().item() for n in norms)
    if similarity != "dot":
        return weight / temperature, 2 * weight / (small * temperature)
    return weight * big**2 / temperature, weight * big / temperature


def _assert_same(got, want, what, scale: tuple[float, float]):
    """Float64 round-off of :data:`TERMS` sums with logits and gradient terms of the sizes
    ``scale`` (:func:`_scale`)."""
    (v, g), (rv, rg) = got, want
    logits, term = scale
    assert torch.isfinite(v).all(), what
    assert_loss_roundoff(v, rv, torch.float64, terms=TERMS, logit_scale=logits, msg=f"{what}: value")
    for i, (a, b) in enumerate(zip(g, rg)):
        kw = dict(terms=TERMS, logit_scale=logits, term_size=term, msg=f"{what}: gradient {i}")
        assert_grad_roundoff(a, b, torch.float64, **kw)


def _guide_drops(guide, strategy: str, margin: float) -> tuple[int, int]:
    """How many anchor-row candidates the guide drops, of how many (own positives excluded)."""
    ga, gp = guide[0], guide[1]
    cands = torch.cat([gp, ga, *([guide[2].reshape(-1, G)] if len(guide) > 2 else [])])
    cos = torch.nn.functional.cosine_similarity
    g = cos(ga, gp)[:, None]
    drop = cos(ga[:, None], cands[None], dim=-1) > (g - margin if strategy == "absolute" else g - g.abs() * margin)
    drop[torch.arange(B), torch.arange(B)] = False
    return int(drop.sum()), drop.numel() - B


@pytest.mark.parametrize("Q", [0, 1, 2])
@pytest.mark.parametrize("strategy", ["absolute", "relative"])
def test_gist_equals_reference_for_every_option(backend, strategy, Q):
    leaves, guide = _inputs(Q, seed=3 + Q)
    a, p, n = leaves[0], leaves[1], _negatives(leaves)
    for margin, anchors, positives, temperature in itertools.product(
        [0.0, 0.1, 0.3], [True, False], [True, False], [0.01, 0.05]
    ):
        dropped, total = _guide_drops(guide, strategy, margin)
        assert 0 < dropped < total, f"{strategy} {margin}: the guide drops {dropped} of {total}"
        opts = dict(
            margin_strategy=strategy,
            margin=margin,
            contrast_anchors=anchors,
            contrast_positives=positives,
            temperature=temperature,
        )
        _assert_same(
            _value_grads(lambda o=opts: L.gist_loss(a, p, n, guide=guide, backend=backend, **o), leaves),
            _value_grads(lambda o=opts: R.gist(a, p, n, guide=guide, **o), leaves),
            f"{backend}, Q={Q}, {opts}",
            _scale(leaves, temperature),
        )


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_gist_reductions(backend, reduction):
    leaves, guide = _inputs(2, seed=11)
    a, p, n = leaves
    opts = dict(margin=0.1, margin_strategy="relative", reduction=reduction)
    got = _value_grads(lambda: L.gist_loss(a, p, n, guide=guide, backend=backend, **opts), leaves)
    want = _value_grads(lambda: R.gist(a, p, n, guide=guide, **opts), leaves)
    _assert_same(got, want, reduction, _scale(leaves, 0.01))  # gist_loss's default temperature
    assert got[0].shape == ((B,) if reduction == "none" else ())


def test_gist_negative_absolute_margin_and_module(backend):
    """A negative absolute margin raises the threshold above the positive's similarity (fewer
    drops); ``GISTLoss`` is the function."""
    leaves, guide = _inputs(1, seed=5)
    a, p, n = leaves
    opts = dict(margin=-0.05, contrast_positives=False, temperature=0.05)
    want = _value_grads(lambda: R.gist(a, p, n, guide=guide, **opts), leaves)
    scale = _scale(leaves, 0.05)
    got = _value_grads(lambda: L.gist_loss(a, p, n, guide=guide, backend=backend, **opts), leaves)
    _assert_same(got, want, "fn", scale)
    module = L.GISTLoss(backend=backend, **opts)
    _assert_same(_value_grads(lambda: module(a, p, n, guide=guide), leaves), want, "module", scale)
    assert "margin=-0.05" in repr(module)


@pytest.mark.parametrize("weights", [None, (1.0, 0.5, 0.25)])
def test_gist_matryoshka_is_the_sum_over_prefixes(backend, weights):
    """Every prefix of the model's embeddings against the same guide decisions (the guide is not
    truncated: sentence-transformers' MatryoshkaLoss around GISTEmbedLoss)."""
    leaves, guide = _inputs(1, seed=13)
    a, p, n = leaves
    dims, w = (D, 6, 3), weights or (1.0, 1.0, 1.0)
    opts = dict(margin=0.1, temperature=0.05)

    def oracle():
        return sum(wk * R.gist(a[:, :m], p[:, :m], n[:, :m], guide=guide, **opts) for wk, m in zip(w, dims))

    got = _value_grads(
        lambda: L.gist_loss(
            a, p, n, guide=guide, backend=backend, matryoshka_dims=dims, matryoshka_weights=weights, **opts
        ),
        leaves,
    )
    _assert_same(
        got, _value_grads(oracle, leaves), f"dims {dims}, weights {weights}", _scale(leaves, 0.05, weight=sum(w))
    )


# --------------------------------------------------------------------------- self-margin filter


def _self_margin_dropped(a, cands, p, margin) -> int:
    cos = torch.nn.functional.cosine_similarity
    s = cos(a[:, None], cands[None], dim=-1)
    drop = s > cos(a, p)[:, None] + margin
    drop[torch.arange(a.shape[0]), torch.arange(a.shape[0])] = False
    return int(drop.sum())


@pytest.mark.parametrize("Q", [0, 1, 2])
def test_self_margin_mnrl_equals_reference(backend, Q):
    leaves, _ = _inputs(Q, seed=21 + Q)
    a, p, n = leaves[0], leaves[1], _negatives(leaves)
    with torch.no_grad():  # the positives agree with their anchors, yet some candidates beat them
        cands = torch.cat([p, *([] if n is None else [n.reshape(-1, D)])])
        assert _self_margin_dropped(a, cands, p, 0.0) > 0
    for margin, reduction, similarity in itertools.product([0.0, 0.1, 0.3], ["mean", "none", "sum"], ["cos", "dot"]):
        opts = dict(temperature=0.05, reduction=reduction, similarity=similarity)
        _assert_same(
            _value_grads(
                lambda m=margin, o=opts: L.mnrl_loss(a, p, n, false_negative_margin=m, backend=backend, **o), leaves
            ),
            _value_grads(lambda m=margin, o=opts: R.self_margin_mnrl(a, p, n, margin=m, **o), leaves),
            f"{backend}, Q={Q}, margin={margin}, {opts}",
            _scale(leaves, 0.05, similarity),
        )


@pytest.mark.parametrize("margin", [0.0, 0.2])
def test_self_margin_symmetric_infonce_equals_reference(backend, margin):
    leaves, _ = _inputs(0, seed=31)
    a, p = leaves

    def oracle():
        kw = dict(margin=margin, temperature=0.05)
        return 0.5 * (R.self_margin_mnrl(a, p, **kw) + R.self_margin_mnrl(p, a, **kw))

    got = _value_grads(
        lambda: L.infonce_loss(a, p, symmetric=True, false_negative_margin=margin, temperature=0.05, backend=backend),
        leaves,
    )
    scale = _scale(leaves, 0.05)
    _assert_same(got, _value_grads(oracle, leaves), f"margin {margin}", scale)
    module = L.InfoNCELoss(temperature=0.05, symmetric=True, false_negative_margin=margin, backend=backend)
    _assert_same(_value_grads(lambda: module(a, p), leaves), _value_grads(oracle, leaves), "module", scale)


def test_self_margin_matryoshka_thresholds_per_prefix(backend):
    leaves, _ = _inputs(1, seed=41)
    a, p, n = leaves
    dims = (D, 5, 2)

    def oracle():
        return sum(R.self_margin_mnrl(a[:, :m], p[:, :m], n[:, :m], margin=0.1) for m in dims)

    got = _value_grads(
        lambda: L.mnrl_loss(a, p, n, false_negative_margin=0.1, matryoshka_dims=dims, backend=backend), leaves
    )
    # mnrl_loss's default temperature 0.05; three prefixes of weight 1
    _assert_same(got, _value_grads(oracle, leaves), f"dims {dims}", _scale(leaves, 0.05, weight=3.0))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda a, p, g: L.gist_loss(a, p, guide=g, margin_strategy="cosine"), "margin_strategy"),
        (lambda a, p, g: L.gist_loss(a, p, guide=g, margin_strategy="relative", margin=-0.1), "margin >= 0"),
        (lambda a, p, g: L.gist_loss(a, p, guide=g, margin=float("inf")), "finite"),
        (lambda a, p, g: L.gist_loss(a, p, guide=(g[0], g[1][:-1])), "guide_positive must be"),
        (lambda a, p, g: L.gist_loss(a, p, guide=(g[0].requires_grad_(), g[1])), "requires grad"),
        (lambda a, p, g: L.gist_loss(a, p, guide=(g[0], g[1][:, :3])), "one width"),
        (lambda a, p, g: L.gist_loss(a, p, a.detach()[:, None], guide=g), "guide_negatives exactly when"),
        (lambda a, p, g: L.mnrl_loss(a, p, false_negative_margin=-0.1), "false_negative_margin"),
        (lambda a, p, g: L.infonce_loss(a, p, false_negative_margin=float("nan")), "false_negative_margin"),
        (lambda a, p, g: L.GISTLoss(margin_strategy="relative", margin=-1.0), "margin >= 0"),
    ],
)
def test_bad_input_raises(call, match):
    leaves, guide = _inputs(0, seed=0)
    guide = tuple(t.clone() for t in guide)
    with pytest.raises(ValueError, match=match):
        call(*leaves, guide)


def test_guide_must_be_a_tuple():
    leaves, guide = _inputs(0, seed=0)
    with pytest.raises(TypeError, match="guide must be a tuple"):
        L.gist_loss(*leaves, guide=guide[0])
