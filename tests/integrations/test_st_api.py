"""sentence-transformers 6 API parity of fastcl's ST losses.

* what ST hands over: the ``BatchEncoding`` of ``model.preprocess()`` / ``model.tokenize()``
  (any ``Mapping`` of tensors) works like a dict, for the plain and the cached losses;
* MNRL ``directions`` / ``partition_mode`` / ``hardness_mode`` / ``hardness_strength``:
  values and gradients equal sentence-transformers 6.2's ``MultipleNegativesRankingLoss``
  (float64, on the same embeddings) and, through a tiny model, its cached loss.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F

st = pytest.importorskip("sentence_transformers")

from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

from fastcl.integrations import sentence_transformers as fst  # noqa: E402
from tests.helpers import st as common  # noqa: E402
from tests.helpers.roundoff import (  # noqa: E402
    assert_grad_roundoff,
    assert_loss_roundoff,
    assert_tau_grad_roundoff,
)
from tests.helpers.seeds import case_seed  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _param_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, loss, features) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    value = loss(features, None)
    value.backward()
    return value.detach(), _param_grads(model)


# --------------------------------------------------------------------------- BatchEncoding


@pytest.mark.parametrize("make", ["preprocess", "tokenize"])
@pytest.mark.parametrize("cached", [False, True])
def test_batch_encoding_is_accepted(tmp_path, make, cached):
    model = common.tiny_model(tmp_path, dropout=0.0).train()
    rows = common.sentences(12, seed=11)
    encode = getattr(model, make)
    features = [encode(rows[i::3]) for i in range(3)]
    assert isinstance(features[0], Mapping) and not isinstance(features[0], dict), type(features[0])
    loss = (
        fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
        if cached
        else fst.MultipleNegativesRankingLoss(model)
    )
    ref_value, ref_grads = _step(model, st_losses.MultipleNegativesRankingLoss(model), [dict(f) for f in features])
    value, grads = _step(model, loss, features)
    common.assert_value_close(value, ref_value)
    common.assert_grads_close(grads, ref_grads, f"BatchEncoding from {make}")


def test_read_only_mapping_and_non_mapping(tmp_path):
    model = common.tiny_model(tmp_path, dropout=0.0).eval()
    rows = common.sentences(6, seed=12)
    features = [types.MappingProxyType(dict(model.preprocess(rows[i::2]))) for i in range(2)]
    with torch.no_grad():
        got = fst.MultipleNegativesRankingLoss(model)(features)
        want = fst.MultipleNegativesRankingLoss(model)([dict(f) for f in features])
    torch.testing.assert_close(got, want)
    with pytest.raises(TypeError, match="feature mapping"):
        fst.MultipleNegativesRankingLoss(model)([list(features[0].values()), dict(features[1])])


# --------------------------------------------------------------------------- ST 6 MNRL options

from sentence_transformers.util import cos_sim, dot_score  # noqa: E402

import fastcl.losses as L  # noqa: E402
from fastcl.losses.mnrl import DIRECTIONS  # noqa: E402
from tests.helpers.backends import require  # noqa: E402

GTE = DIRECTIONS  # all four: the GTE "improved contrastive loss"
OPTIONS = [  # (directions, partition_mode): every combination sentence-transformers accepts
    (("query_to_doc",), "joint"),
    (("query_to_doc", "query_to_query"), "joint"),
    (("query_to_doc", "doc_to_query"), "joint"),
    (("query_to_doc", "doc_to_doc"), "joint"),
    (("query_to_doc", "doc_to_query", "doc_to_doc"), "joint"),
    (GTE, "joint"),
    (("query_to_doc",), "per_direction"),
    (("query_to_doc", "doc_to_query"), "per_direction"),
]
HARDNESS = [None, "in_batch_negatives", "hard_negatives", "all_negatives"]
# float64 against float64 (ST, the oracle, another reduction): the sums behind one number are a
# logit's d (<= 7) coordinates, a row's candidates (all four directions: B (2 + Q) documents and B
# queries; B <= 6, Q <= 2) and a column's B anchors; logits of size scale (12, 1/0.07 ~ 14) plus a
# hardness term of size strength (<= 5), or |a| |c| scale for dot products (0.4-scaled inputs): 20.
F64_TERMS = 7 + 6 * 5 + 6
F64_SCALE = 20.0
F64 = dict(terms=F64_TERMS, logit_scale=F64_SCALE)


def _same(got, want, got_grads=(), want_grads=()):
    """A value and its gradients; a gradient may cancel to ~0 (B = 1: a softmax over one
    candidate), so its terms' size bounds it: d logit / d embedding, 1/|a| per unit of logit
    (inputs of norm ~sqrt(d) >= 1)."""
    assert_loss_roundoff(got, want, torch.float64, **F64)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        assert_grad_roundoff(g, w, torch.float64, term_size=1.0, **F64)


def _st_mnrl(
    directions, partition_mode, hardness_mode, hardness_strength, scale=20.0, sim="cos", model=None, cached=False, **kw
):
    cls = st_losses.CachedMultipleNegativesRankingLoss if cached else st_losses.MultipleNegativesRankingLoss
    return cls(
        model,
        scale=scale,
        similarity_fct=cos_sim if sim == "cos" else dot_score,
        directions=directions,
        partition_mode=partition_mode,
        hardness_mode=hardness_mode,
        hardness_strength=hardness_strength,
        **kw,
    )


def _embs(B, d, n, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(B, d, generator=gen, dtype=torch.float64)).requires_grad_() for _ in range(n)]


@pytest.mark.parametrize("backend", ["reference", "torch", "cpp"])
@pytest.mark.parametrize("Q", [0, 2])
@pytest.mark.parametrize("hardness_mode", HARDNESS)
@pytest.mark.parametrize("directions,partition_mode", OPTIONS)
def test_mnrl_options_equal_sentence_transformers(directions, partition_mode, hardness_mode, Q, backend):
    if backend != "reference":
        require(backend)
    seed = case_seed(directions, partition_mode, hardness_mode, Q) % 2**31
    sim = "dot" if seed % 2 else "cos"
    embs = _embs(6, 7, 2 + Q, seed, scale=0.4 if sim == "dot" else 1.0)
    strength = 4.0 if hardness_mode else 0.0
    ref = _st_mnrl(directions, partition_mode, hardness_mode, strength, scale=12.0, sim=sim)
    ours = fst.MultipleNegativesRankingLoss(
        torch.nn.Identity(),
        scale=12.0,
        similarity_fct=sim,
        directions=directions,
        partition_mode=partition_mode,
        hardness_mode=hardness_mode,
        hardness_strength=strength,
        backend=backend,
    )
    want = ref.compute_loss_from_embeddings(embs, None)
    got = ours.compute_loss_from_embeddings(embs)
    _same(got, want, torch.autograd.grad(got, embs), torch.autograd.grad(want, embs))


def _oracle(q, d, negs, tau, directions, partition_mode, hardness_mode, alpha):
    """sentence-transformers 6.2's MNRL written from docs/contracts.md with materialised float64 logits.

    Masked entries are removed with ``torch.where`` (ST multiplies ``-inf`` by the scale,
    which makes its gradient with respect to a learnable scale NaN).
    """
    qn, docs = F.normalize(q, dim=1), F.normalize(torch.cat([d, *negs]), dim=1)
    B, N = q.shape[0], docs.shape[0]
    rows, cols = torch.arange(B)[:, None], torch.arange(N)[None, :]
    own = cols % B == rows  # a query's own documents: its positive and its hard negatives
    is_pos = own & (cols < B)
    hard = {
        None: torch.zeros_like(own),
        "in_batch_negatives": ~own,
        "hard_negatives": own & ~is_pos,
        "all_negatives": ~is_pos,
    }[hardness_mode]
    s_qd = qn @ docs.T
    out = {"query_to_doc": s_qd / tau + alpha * torch.where(hard, s_qd.detach(), torch.zeros_like(s_qd))}
    dn = docs[:B]
    gone = torch.tensor(float("-inf"), dtype=q.dtype)
    if "query_to_query" in directions:
        out["query_to_query"] = torch.where(torch.eye(B, dtype=torch.bool), gone, qn @ qn.T / tau)
    if "doc_to_query" in directions:
        out["doc_to_query"] = dn @ qn.T / tau
    if "doc_to_doc" in directions:
        out["doc_to_doc"] = torch.where(own, gone, dn @ docs.T / tau)
    pos = out["query_to_doc"].diagonal()[:B] if N == B else out["query_to_doc"][torch.arange(B), torch.arange(B)]
    if partition_mode == "joint":
        log_z = torch.logsumexp(torch.cat(list(out.values()), dim=1), dim=1)
    else:
        log_z = torch.stack([torch.logsumexp(v, dim=1) for v in out.values()]).mean(0)
    return (log_z - pos).mean()


@pytest.mark.parametrize("hardness_mode", HARDNESS)
@pytest.mark.parametrize("B,Q", [(1, 0), (1, 1), (2, 0), (5, 2)])
@pytest.mark.parametrize("backend", ["reference", "torch", "cpp"])
def test_tiny_batches_and_learnable_temperature(hardness_mode, B, Q, backend):
    """B = 1 leaves some pieces empty (an LSE of nothing); the temperature gradient matches too."""
    if backend != "reference":
        require(backend)
    embs = _embs(B, 5, 2 + Q, seed=B * 10 + Q)
    tau = torch.tensor(0.07, dtype=torch.float64, requires_grad=True)
    negs = torch.stack(embs[2:], 1) if Q else None
    strength = 2.5 if hardness_mode else 0.0
    for directions, partition_mode in ((GTE, "joint"), (("query_to_doc", "doc_to_query"), "per_direction")):
        got = L.mnrl_loss(
            embs[0],
            embs[1],
            negs,
            temperature=tau,
            directions=directions,
            partition_mode=partition_mode,
            hardness_mode=hardness_mode,
            hardness_strength=strength,
            backend=backend,
        )
        want = _oracle(embs[0], embs[1], embs[2:], tau, directions, partition_mode, hardness_mode, strength)
        st_value = _st_mnrl(directions, partition_mode, hardness_mode, strength, scale=1 / 0.07)
        _same(want, st_value.compute_loss_from_embeddings(embs, None))  # the oracle is ST's
        *grads, d_tau = torch.autograd.grad(got, [*embs, tau])
        *want_grads, want_d_tau = torch.autograd.grad(want, [*embs, tau])
        _same(got, want, grads, want_grads)
        assert_tau_grad_roundoff(d_tau, want_d_tau, torch.float64, terms=F64_TERMS, logit_scale=F64_SCALE, rows=1)


def test_reductions_and_module():
    embs = _embs(5, 6, 3, seed=21)
    kw = dict(directions=GTE, hardness_mode="all_negatives", hardness_strength=1.5, temperature=0.1)
    mean = L.mnrl_loss(embs[0], embs[1], embs[2], **kw)
    rows = L.mnrl_loss(embs[0], embs[1], embs[2], reduction="none", **kw)
    assert rows.shape == (5,)
    _same(rows.mean(), mean)
    # the sum of B = 5 rows: B times a row's error
    summed = L.mnrl_loss(embs[0], embs[1], embs[2], reduction="sum", **kw)
    assert_loss_roundoff(summed, rows.sum(), torch.float64, terms=F64_TERMS, logit_scale=5 * F64_SCALE)
    module = L.MNRLoss(0.1, directions=GTE, hardness_mode="all_negatives", hardness_strength=1.5)
    _same(module(embs[0], embs[1], embs[2]), mean)
    # default options keep the plain fused path and its value
    _same(
        L.mnrl_loss(embs[0], embs[1], directions=("query_to_doc",), partition_mode="per_direction", temperature=0.1),
        L.mnrl_loss(embs[0], embs[1], temperature=0.1),
    )


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(directions=("query_to_query",)), ValueError, "query_to_doc"),
        (dict(directions=("query_to_doc", "sideways")), ValueError, "invalid directions"),
        (dict(directions="query_to_doc"), TypeError, "tuple"),
        (dict(directions=GTE, partition_mode="per_direction"), ValueError, "joint"),
        (dict(partition_mode="both"), ValueError, "partition_mode"),
        (dict(hardness_mode="hardest"), ValueError, "hardness_mode"),
        (dict(hardness_mode="hard_negatives", hardness_strength=-1.0), ValueError, "hardness_strength"),
        (dict(directions=GTE, neg_mask=torch.ones(3, 1, dtype=torch.bool)), ValueError, "neg_mask"),
        (dict(directions=GTE, process_group=object()), TypeError, "process_group"),
    ],
)
def test_option_errors(kw, err, match):
    a, p, n = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(err, match=match):
        L.mnrl_loss(a, p, n, **kw)


def test_st_class_config_and_warning(caplog):
    loss = fst.MultipleNegativesRankingLoss(torch.nn.Identity(), directions=GTE, hardness_mode="hard_negatives")
    assert "hardness_strength=0.0" in caplog.text
    cfg = loss.get_config_dict()
    assert cfg["directions"] == GTE and cfg["partition_mode"] == "joint" and cfg["hardness_mode"] == "hard_negatives"
    with pytest.raises(ValueError, match="joint"):
        fst.CachedMultipleNegativesRankingLoss(torch.nn.Identity(), directions=GTE, partition_mode="per_direction")


@pytest.mark.parametrize(
    "directions,partition_mode,hardness_mode",
    [
        (GTE, "joint", None),
        (("query_to_doc", "doc_to_query"), "per_direction", "in_batch_negatives"),
        (("query_to_doc", "query_to_query"), "joint", "hard_negatives"),
    ],
)
def test_plain_and_cached_match_sentence_transformers_through_a_model(
    tmp_path, directions, partition_mode, hardness_mode
):
    """Parameter gradients of a dropout-free tiny BERT: fastcl plain / cached vs ST plain / cached."""
    model = common.tiny_model(tmp_path, dropout=0.0).train()
    rows = common.sentences(15, seed=31)
    features = [model.preprocess(rows[i::3][:5]) for i in range(3)]
    opts = dict(
        directions=directions,
        partition_mode=partition_mode,
        hardness_mode=hardness_mode,
        hardness_strength=5.0 if hardness_mode else 0.0,
    )
    ref_value, ref_grads = _step(model, _st_mnrl(model=model, **opts), [dict(f) for f in features])
    runs = {
        "fastcl": fst.MultipleNegativesRankingLoss(model, **opts),
        "fastcl cached": fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, **opts),
        "ST cached": _st_mnrl(model=model, cached=True, mini_batch_size=2, **opts),
    }
    for name, loss in runs.items():
        value, grads = _step(model, loss, [dict(f) for f in features])
        common.assert_value_close(value, ref_value, name)
        common.assert_grads_close(grads, ref_grads, name)


# --------------------------------------------------------------------------- memory: no B x N buffer

MEM_B, MEM_D = 4096, 32
ROW_BYTES = MEM_B * 3 * MEM_B * 4  # one float32 [B, 3B] buffer (a query row: 2B documents + B queries): 192 MiB


def test_meter_sees_st_buffers():
    from benchmarks.harness.memory import cpu_extra_peak_bytes

    peer = cpu_extra_peak_bytes(
        "benchmarks.harness.api_cases:mnrl_directions_step", dict(backend="st-mnrl", B=MEM_B, d=MEM_D)
    )
    assert peer > ROW_BYTES, f"ST's MNRL (GTE directions) peaked at only {peer / 2**20:.0f} MiB"


@pytest.mark.parametrize("hardness_mode", [None, "in_batch_negatives"])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_gte_directions_have_no_bxn_buffer(backend, hardness_mode):
    require(backend)
    from benchmarks.harness.memory import cpu_extra_peak_bytes

    extra = cpu_extra_peak_bytes(
        "benchmarks.harness.api_cases:mnrl_directions_step",
        dict(backend=backend, B=MEM_B, d=MEM_D, hardness_mode=hardness_mode),
    )
    assert extra < ROW_BYTES / 2, f"{backend}: extra peak {extra / 2**20:.0f} MiB"


# --------------------------------------------------------------------------- SupConLabelsLoss


def test_supcon_labels_st_class_equals_pml():
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.losses import SupConLoss

    views = _embs(7, 5, 2, seed=41)
    labels = torch.tensor([0, 1, 0, 2, 1, 2, 3])
    got = fst.SupConLabelsLoss(torch.nn.Identity(), temperature=0.1).compute_loss_from_embeddings(views, labels)
    want = SupConLoss(temperature=0.1)(torch.cat(views), labels.repeat(2))
    # 2B = 14 candidates per row and per column, d = 5, logits of size 1/0.1
    kw = dict(terms=5 + 14 + 14, logit_scale=10.0)
    assert_loss_roundoff(got, want, torch.float64, **kw)
    for g, w in zip(torch.autograd.grad(got, views), torch.autograd.grad(want, views)):
        assert_grad_roundoff(g, w, torch.float64, **kw)
    with pytest.raises(ValueError, match="label"):
        fst.SupConLabelsLoss(torch.nn.Identity()).compute_loss_from_embeddings(views)


def test_supcon_labels_cached_equals_plain_through_a_model(tmp_path):
    model = common.tiny_model(tmp_path, dropout=0.0).train()
    rows = common.sentences(12, seed=43)
    features = [model.preprocess(rows[:6]), model.preprocess(rows[6:])]
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    ref_value, ref_grads = _step_labels(model, fst.SupConLabelsLoss(model, temperature=0.1), features, labels)
    value, grads = _step_labels(
        model, fst.SupConLabelsLoss(model, temperature=0.1, mini_batch_size=4), features, labels
    )
    common.assert_value_close(value, ref_value, scale=10.0)  # temperature 0.1
    common.assert_grads_close(grads, ref_grads, "cached SupConLabelsLoss")


def _step_labels(model, loss, features, labels):
    model.zero_grad()
    value = loss(features, labels)
    value.backward()
    return value.detach(), _param_grads(model)


# --------------------------------------------------------------------------- Matryoshka, AdaptiveLayerLoss

import random  # noqa: E402
import warnings  # noqa: E402

DIMS = [common.HIDDEN, common.HIDDEN // 2, common.HIDDEN // 4]


def _seeded_step(model, loss, features, labels=None, seed=0):
    random.seed(seed)  # Matryoshka2dLoss / AdaptiveLayerLoss sample layers and dims with `random`
    model.zero_grad()
    value = loss([dict(f) for f in features], labels)
    value.backward()
    return value.detach(), _param_grads(model)


@pytest.mark.parametrize(
    "options", [{}, dict(directions=GTE, hardness_mode="in_batch_negatives", hardness_strength=5.0)]
)
def test_cached_losses_work_inside_matryoshka(tmp_path, options):
    """fastcl's cached MNRL inside MatryoshkaLoss: sentence-transformers' gradients (they raised before)."""
    model = common.tiny_model(tmp_path, dropout=0.0).train()
    rows = common.sentences(18, seed=51)
    features = [model.preprocess(rows[i::3][:6]) for i in range(3)]
    ref = _seeded_step(
        model,
        st_losses.MatryoshkaLoss(
            model, st_losses.MultipleNegativesRankingLoss(model, **options), DIMS, matryoshka_weights=[1.0, 0.5, 0.25]
        ),
        features,
    )
    runs = {
        "ST cached": st_losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, **options),
        "fastcl cached": fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, **options),
        "fastcl plain": fst.MultipleNegativesRankingLoss(model, **options),
    }
    for name, inner in runs.items():
        value, grads = _seeded_step(
            model, st_losses.MatryoshkaLoss(model, inner, DIMS, matryoshka_weights=[1.0, 0.5, 0.25]), features
        )
        common.assert_value_close(value, ref[0], name)
        common.assert_grads_close(grads, ref[1], name)
    with torch.no_grad():  # evaluation: the value, no backward inside
        loss = st_losses.MatryoshkaLoss(
            model,
            fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, **options),
            DIMS,
            matryoshka_weights=[1.0, 0.5, 0.25],
        )
        common.assert_value_close(loss([dict(f) for f in features], None), ref[0])


def test_cached_supcon_labels_inside_matryoshka(tmp_path):
    model = common.tiny_model(tmp_path, dropout=0.0).train()
    rows = common.sentences(8, seed=52)
    features = [model.preprocess(rows)]
    labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    plain = _seeded_step(model, st_losses.MatryoshkaLoss(model, fst.SupConLabelsLoss(model), DIMS), features, labels)
    cached = _seeded_step(
        model, st_losses.MatryoshkaLoss(model, fst.SupConLabelsLoss(model, mini_batch_size=3), DIMS), features, labels
    )
    common.assert_value_close(cached[0], plain[0])
    common.assert_grads_close(cached[1], plain[1], "cached SupConLabelsLoss in MatryoshkaLoss")


def test_matryoshka_2d_and_adaptive_layer(tmp_path):
    """Uncached: same gradients as sentence-transformers' MNRL inside Matryoshka2dLoss and
    AdaptiveLayerLoss (the latter raised KeyError: 'all_layer_embeddings'). Cached: warns at
    construction, as sentence-transformers does for its own cached losses."""
    model = common.tiny_model(tmp_path, dropout=0.0).train()
    rows = common.sentences(12, seed=53)
    features = [model.preprocess(rows[:6]), model.preprocess(rows[6:])]
    for wrap in (
        lambda inner: st_losses.Matryoshka2dLoss(model, inner, DIMS, n_layers_per_step=1, n_dims_per_step=2),
        lambda inner: st_losses.AdaptiveLayerLoss(model, inner),
    ):
        ref = _seeded_step(model, wrap(st_losses.MultipleNegativesRankingLoss(model)), features, seed=7)
        got = _seeded_step(model, wrap(fst.MultipleNegativesRankingLoss(model)), features, seed=7)
        common.assert_value_close(got[0], ref[0])
        common.assert_grads_close(got[1], ref[1], "2d / adaptive layer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st_losses.AdaptiveLayerLoss(model, fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2))
    assert any("not compatible" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert fst.CachedMultipleNegativesRankingLoss(model).uses_gradient_cache
    assert not fst.MultipleNegativesRankingLoss(model).uses_gradient_cache
