"""fastcl's fused ``matryoshka_dims`` on the sentence-transformers losses equals
sentence-transformers' ``MatryoshkaLoss`` around its own (cached) MNRL: values and parameter
gradients of a float64 tiny BERT, cos and dot, with weights and with ``n_dims_per_step``."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("sentence_transformers")

from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402
from sentence_transformers.util import cos_sim, dot_score  # noqa: E402

from fastcl.integrations import sentence_transformers as fst  # noqa: E402
from tests.helpers import st as common  # noqa: E402
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DIMS, WEIGHTS = (8, 16, 4), (0.5, 1.0, 2.0)  # unsorted on purpose: ST sorts them


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return common.tiny_model(tmp_path_factory.mktemp("st"), dropout=0.0).double().train()


def _features(model, negatives: int):
    rows = common.sentences(5 * (2 + negatives), seed=11)
    return [model.preprocess(rows[i * 5 : (i + 1) * 5]) for i in range(2 + negatives)]


def _step(model, loss, features, seed=0):
    model.zero_grad()
    random.seed(seed)  # n_dims_per_step draws with Python's random, in both
    value = loss([dict(f) for f in features], None)
    value.backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want, similarity=cos_sim):
    """Float64 round-off of the tiny BERT's MODEL_TERMS sums, logits of size ST_SCALE (cos) or
    ST_SCALE |e|^2 <= ST_SCALE x HIDDEN (dot: mean-pooled LayerNorm'd coordinates of size <= 1),
    the dims' losses weighted by up to sum(WEIGHTS)."""
    scale = common.ST_SCALE * (common.HIDDEN if similarity is dot_score else 1) * sum(WEIGHTS)
    kw = dict(terms=common.MODEL_TERMS, logit_scale=scale)
    assert_loss_roundoff(got[0], want[0], torch.float64, **kw)
    assert got[1].keys() == want[1].keys()
    # attention key biases' gradients cancel to ~0: terms as large as the largest gradient entry
    size = max(g.abs().max().item() for g in want[1].values())
    for k in want[1]:
        assert_grad_roundoff(got[1][k], want[1][k], torch.float64, **kw, term_size=size, msg=k)


@pytest.mark.parametrize("similarity", [cos_sim, dot_score])
@pytest.mark.parametrize("negatives", [0, 1])
@pytest.mark.parametrize("n_dims_per_step", [-1, 2])
def test_equals_st_matryoshka_around_mnrl(model, similarity, negatives, n_dims_per_step):
    features = _features(model, negatives)
    mat = dict(matryoshka_weights=WEIGHTS, n_dims_per_step=n_dims_per_step)
    st_loss = st_losses.MultipleNegativesRankingLoss(model, similarity_fct=similarity)
    want = _step(model, st_losses.MatryoshkaLoss(model, st_loss, list(DIMS), **mat), features)
    ours = fst.MultipleNegativesRankingLoss(model, similarity_fct=similarity, matryoshka_dims=DIMS, **mat)
    _assert_same(_step(model, ours, features), want, similarity)


GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


@pytest.mark.parametrize(
    "options",
    [dict(directions=GTE, hardness_mode="in_batch_negatives", hardness_strength=4.0),
     dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction", hardness_mode="all_negatives", hardness_strength=2.0)],
)  # fmt: skip
def test_equals_st_matryoshka_around_mnrl_with_st6_options(model, options):
    features = _features(model, 1)
    st_loss = st_losses.MultipleNegativesRankingLoss(model, **options)
    want = _step(model, st_losses.MatryoshkaLoss(model, st_loss, list(DIMS), WEIGHTS), features)
    ours = fst.MultipleNegativesRankingLoss(model, matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS, **options)
    _assert_same(_step(model, ours, features), want)


@pytest.mark.parametrize("similarity", [cos_sim, dot_score])
def test_cached_equals_st_matryoshka_around_cached_mnrl(model, similarity):
    features = _features(model, 1)
    st_loss = st_losses.CachedMultipleNegativesRankingLoss(model, similarity_fct=similarity, mini_batch_size=2)
    want = _step(model, st_losses.MatryoshkaLoss(model, st_loss, list(DIMS), WEIGHTS), features)
    ours = fst.CachedMultipleNegativesRankingLoss(
        model, similarity_fct=similarity, mini_batch_size=2, matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS
    )
    _assert_same(_step(model, ours, features), want, similarity)


def test_config_and_validation():
    loss = fst.MultipleNegativesRankingLoss(torch.nn.Identity(), matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS)
    cfg = loss.get_config_dict()
    assert cfg["matryoshka_dims"] == (16, 8, 4) and cfg["matryoshka_weights"] == (1.0, 0.5, 2.0)
    assert "matryoshka_dims" not in fst.InfoNCELoss(torch.nn.Identity()).get_config_dict()
    with pytest.raises(ValueError, match="distinct"):
        fst.SupMPNLoss(torch.nn.Identity(), matryoshka_dims=(8, 8))
    with pytest.raises(ValueError, match="one weight"):
        fst.InfoNCELoss(torch.nn.Identity(), matryoshka_dims=(8, 4), matryoshka_weights=(1.0,))
    embs = [torch.randn(4, 6) for _ in range(2)]
    with pytest.raises(ValueError, match="embedding size 6"):
        fst.InfoNCELoss(torch.nn.Identity(), matryoshka_dims=(8, 4)).compute_loss_from_embeddings(embs)
