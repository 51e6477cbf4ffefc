"""Parity audit: fastcl against the peers it claims to match, on the same embeddings.

* sentence-transformers 6.2 ``MultipleNegativesRankingLoss`` (directions, partition_mode,
  hardness, scale, cos/dot), its ``MatryoshkaLoss`` (emulated on embeddings with its own
  ``shrink`` and ``CachedLossDecorator``) and fastcl's ST classes;
* pytorch-metric-learning 2.9 ``SupConLoss`` (labels form, ``ref_emb``, views) and
  ``NTXentLoss`` in the layout fastcl's benchmarks use;
* plain ``mnrl_loss`` / ``infonce_loss`` with ``[B, d]`` and ``[B, Q, d]`` hard negatives,
  float64 and float32, contiguous or not.

Values and gradients with respect to the embeddings; float64 to 1e-9, float32 to 1e-5.
Where fastcl follows docs/contracts.md rather than a peer's shortcut (pytorch-metric-learning's zero
loss for a batch without negatives, and the others in docs/losses.md, "Where pytorch-metric-
learning differs"), the difference is pinned in tests/losses/test_supcon_labels.py.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

st = pytest.importorskip("sentence_transformers")
pml = pytest.importorskip("pytorch_metric_learning")

from pytorch_metric_learning.distances import DotProductSimilarity  # noqa: E402
from pytorch_metric_learning.losses import NTXentLoss as PmlNTXent  # noqa: E402
from pytorch_metric_learning.losses import SupConLoss as PmlSupCon  # noqa: E402
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

try:  # sentence-transformers 6.2's module layout; the Matryoshka tests skip without it
    from sentence_transformers.sentence_transformer.losses.matryoshka import CachedLossDecorator, shrink
except ImportError:
    CachedLossDecorator = shrink = None
from sentence_transformers.util import cos_sim, dot_score  # noqa: E402

import fastcl.losses as L  # noqa: E402
from fastcl.integrations import sentence_transformers as fst  # noqa: E402
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _quiet_st_warnings():
    """ST warns when a hardness mode comes with strength 0; not what these tests are about."""
    logger = logging.getLogger("sentence_transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


BACKENDS = ["reference", "torch", "cpp"]
# Peers compute the same sums in other orders: round-off of the dtype (fastcl.testing.roundoff,
# tests/helpers/roundoff.py) over the largest problem here (B = 64 rows of d = 64, 3 columns:
# d + N + B terms), with logits of size 1/tau for cosine (tau >= 0.05). The float64 cases also
# take dot products of rows with norms up to ~10 (100 / tau); the float32 ones are cosine.
TERMS = 64 + 3 * 64 + 64
LOGIT_SCALE = {torch.float64: 100 / 0.05, torch.float32: 1 / 0.05}
GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def _value_and_grads(fn, tensors):
    """``fn(leaves)`` and its gradients; the leaves keep the inputs' strides."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    value = fn(leaves)
    return value.detach(), torch.autograd.grad(value, leaves)


def _assert_same(ours, ref, what: str = ""):
    (v, grads), (v_ref, grads_ref) = ours, ref
    dt = v.dtype if torch.finfo(v.dtype).eps >= torch.finfo(v_ref.dtype).eps else v_ref.dtype
    kw = dict(terms=TERMS, logit_scale=LOGIT_SCALE[dt])
    assert_loss_roundoff(v.to(v_ref.dtype), v_ref, dt, msg=f"{what} value", **kw)
    assert len(grads) == len(grads_ref)
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
        # a row's gradient terms are (1/tau) / (B |row|), |row| ~ sqrt(d) for these randn rows:
        # their size bounds a gradient that cancels (B = 1: one candidate, the gradient is 0)
        term = 1 / (g.shape[0] * g.shape[-1] ** 0.5)
        assert_grad_roundoff(g.to(g_ref.dtype), g_ref, dt, term_size=term, msg=f"{what} grad {i}", **kw)


def _randn(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- ST MNRL options


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "directions,partition_mode,hardness_mode",
    [
        (("query_to_doc",), "joint", None),
        (("doc_to_doc", "query_to_doc", "query_to_query"), "joint", "in_batch_negatives"),
        (GTE, "joint", "hard_negatives"),
        (GTE, "joint", "all_negatives"),
        (("query_to_doc", "doc_to_query"), "per_direction", "all_negatives"),
        (("query_to_doc", "doc_to_query"), "per_direction", "hard_negatives"),
    ],
)
@pytest.mark.parametrize("similarity", [cos_sim, dot_score])
@pytest.mark.parametrize("B,Q", [(1, 0), (1, 2), (6, 0), (5, 3)])
def test_st_mnrl_options_equal_sentence_transformers(
    backend, directions, partition_mode, hardness_mode, similarity, B, Q
):
    d = 7
    scale = 20.0 if similarity is cos_sim else 1.3
    opts = dict(
        scale=scale,
        similarity_fct=similarity,
        directions=directions,
        partition_mode=partition_mode,
        hardness_mode=hardness_mode,
        hardness_strength=0.0 if hardness_mode is None else 3.0,
    )
    columns = [_randn(B, d, seed=i) for i in range(2 + Q)]
    ref_loss = st_losses.MultipleNegativesRankingLoss(None, **opts)
    ours_loss = fst.MultipleNegativesRankingLoss(None, backend=backend, **opts)
    ref = _value_and_grads(lambda t: ref_loss.compute_loss_from_embeddings(t, None), columns)
    _assert_same(_value_and_grads(ours_loss.compute_loss_from_embeddings, columns), ref)
    if Q:  # the function, negatives as one [B, Q, d] tensor
        fn_opts = dict(
            temperature=1 / scale,
            similarity="cos" if similarity is cos_sim else "dot",
            directions=directions,
            partition_mode=partition_mode,
            hardness_mode=hardness_mode,
            hardness_strength=opts["hardness_strength"],
            backend=backend,
        )
        ours = _value_and_grads(lambda t: L.mnrl_loss(t[0], t[1], torch.stack(t[2:], 1), **fn_opts), columns)
        _assert_same(ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mnrl_directions_with_2d_negatives_equal_sentence_transformers(backend):
    columns = [_randn(5, 12, seed=10 + i) for i in range(3)]
    opts = dict(directions=("query_to_doc", "doc_to_doc", "query_to_query"), hardness_mode="hard_negatives")
    ref_loss = st_losses.MultipleNegativesRankingLoss(None, hardness_strength=4.0, **opts)
    ref = _value_and_grads(lambda t: ref_loss.compute_loss_from_embeddings(t, None), columns)
    ours = _value_and_grads(
        lambda t: L.mnrl_loss(*t, temperature=0.05, hardness_strength=4.0, backend=backend, **opts), columns
    )
    _assert_same(ours, ref)


def test_st_mnrl_accepts_what_sentence_transformers_accepts():
    """Integer scale and strength, a list of directions, a repeated direction, a strength without mode."""
    columns = [_randn(4, 8, dtype=torch.float32, seed=20 + i) for i in range(3)]
    for kw in (
        dict(scale=20),
        dict(scale=np.float32(20)),
        dict(scale=torch.tensor(20.0)),
        dict(hardness_mode="in_batch_negatives", hardness_strength=2),
        dict(hardness_mode="in_batch_negatives", hardness_strength=np.float32(2)),
        dict(directions=["query_to_doc", "doc_to_query"]),
        dict(directions=("query_to_doc", "query_to_doc")),
        dict(hardness_strength=5.0),
    ):
        ref = st_losses.MultipleNegativesRankingLoss(None, **kw).compute_loss_from_embeddings(columns, None)
        ours = fst.MultipleNegativesRankingLoss(None, **kw).compute_loss_from_embeddings(columns)
        assert_loss_roundoff(ours, ref, torch.float32, terms=TERMS, logit_scale=1 / 0.05, msg=str(kw))


# --------------------------------------------------------------------------- plain mnrl / infonce


@pytest.mark.parametrize("backend", BACKENDS)
def test_mnrl_loss_2d_and_3d_negatives_and_infonce_equal_st(backend):
    a, p, n = _randn(5, 8, seed=30), _randn(5, 8, seed=31), _randn(5, 2, 8, seed=32)
    mnrl = st_losses.MultipleNegativesRankingLoss(None)  # scale 20 = temperature 0.05

    def st_value(t):
        return mnrl.compute_loss_from_embeddings(t, None)

    cases = [
        ([a, p, n[:, 0]], lambda t: L.mnrl_loss(t[0], t[1], t[2], temperature=0.05, backend=backend), st_value),
        (
            [a, p, n],
            lambda t: L.mnrl_loss(t[0], t[1], t[2], temperature=0.05, backend=backend),
            lambda t: st_value([t[0], t[1], t[2][:, 0], t[2][:, 1]]),
        ),
        ([a, p], lambda t: L.infonce_loss(t[0], t[1], temperature=0.05, backend=backend), st_value),
    ]
    for columns, ours_fn, ref_fn in cases:
        _assert_same(_value_and_grads(ours_fn, columns), _value_and_grads(ref_fn, columns))

    sym = st_losses.MultipleNegativesRankingLoss(
        None, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
    )
    ref = _value_and_grads(lambda t: sym.compute_loss_from_embeddings(t, None), [a, p])
    ours = _value_and_grads(lambda t: L.infonce_loss(*t, temperature=0.05, symmetric=True, backend=backend), [a, p])
    _assert_same(ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mnrl_non_contiguous_and_expanded_inputs(backend, dtype):
    B, d = 5, 8
    big = _randn(3 * d, 2 * B, dtype=dtype, seed=40)
    a, p, n = big[:d].t()[::2], big[d : 2 * d].t()[1::2], big[2 * d :].t()[::2]
    assert not a.is_contiguous()
    mnrl = st_losses.MultipleNegativesRankingLoss(None)
    ref = _value_and_grads(lambda t: mnrl.compute_loss_from_embeddings(t, None), [x.contiguous() for x in (a, p, n)])
    ours = _value_and_grads(lambda t: L.mnrl_loss(*t, temperature=0.05, backend=backend), [a, p, n])
    _assert_same(ours, ref)
    e = _randn(1, d, dtype=dtype, seed=41).expand(B, d)  # stride 0
    ref = _value_and_grads(lambda t: mnrl.compute_loss_from_embeddings(t, None), [a.contiguous(), e.contiguous()])
    ours = _value_and_grads(lambda t: L.mnrl_loss(*t, temperature=0.05, backend=backend), [a, e])
    _assert_same(ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mnrl_float32_b64_matches_st_float32(backend):
    columns = [_randn(64, 64, dtype=torch.float32, seed=50 + i) for i in range(3)]
    mnrl = st_losses.MultipleNegativesRankingLoss(None)
    ref = _value_and_grads(lambda t: mnrl.compute_loss_from_embeddings(t, None), columns)
    ours = _value_and_grads(lambda t: L.mnrl_loss(*t, temperature=0.05, backend=backend), columns)
    _assert_same(ours, ref)


# --------------------------------------------------------------------------- Matryoshka


def _needs_st_matryoshka():
    if shrink is None:
        pytest.skip("sentence-transformers without sentence_transformer.losses.matryoshka (6.2's layout)")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "directions,partition_mode,hardness_mode",
    [
        (("query_to_doc",), "joint", None),
        (GTE, "joint", "in_batch_negatives"),
        (("query_to_doc", "doc_to_query"), "per_direction", "all_negatives"),
        (("query_to_doc",), "joint", "hard_negatives"),
    ],
)
@pytest.mark.parametrize("similarity", [cos_sim, dot_score])
def test_st_matryoshka_dims_equal_st_matryoshka(backend, directions, partition_mode, hardness_mode, similarity):
    """Unsorted dims with weights: ``sum_k w_k * ST-MNRL(shrink(x, m_k))``, as ``MatryoshkaLoss`` computes it."""
    _needs_st_matryoshka()
    columns = [_randn(6, 16, seed=60 + i) for i in range(4)]
    dims, weights = (4, 16, 8), (0.5, 1.0, 2.0)
    opts = dict(
        scale=7.0,
        similarity_fct=similarity,
        directions=directions,
        partition_mode=partition_mode,
        hardness_mode=hardness_mode,
        hardness_strength=0.0 if hardness_mode is None else 2.0,
    )
    inner = st_losses.MultipleNegativesRankingLoss(None, **opts)
    ref = _value_and_grads(
        lambda t: sum(
            w * inner.compute_loss_from_embeddings([shrink(x, m) for x in t], None) for m, w in zip(dims, weights)
        ),
        columns,
    )
    ours_loss = fst.MultipleNegativesRankingLoss(
        None, matryoshka_dims=dims, matryoshka_weights=weights, backend=backend, **opts
    )
    _assert_same(_value_and_grads(ours_loss.compute_loss_from_embeddings, columns), ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_st_infonce_symmetric_matryoshka_equals_st(backend):
    _needs_st_matryoshka()
    columns = [_randn(6, 16, seed=70 + i) for i in range(2)]
    dims, weights = (16, 8, 4), (1.0, 0.5, 0.25)
    inner = st_losses.MultipleNegativesRankingLoss(
        None, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
    )
    ref = _value_and_grads(
        lambda t: sum(
            w * inner.compute_loss_from_embeddings([shrink(x, m) for x in t], None) for m, w in zip(dims, weights)
        ),
        columns,
    )
    ours_loss = fst.InfoNCELoss(None, symmetric=True, matryoshka_dims=dims, matryoshka_weights=weights, backend=backend)
    _assert_same(_value_and_grads(ours_loss.compute_loss_from_embeddings, columns), ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_n_dims_per_step_draws_the_dims_st_draws(seed):
    """fastcl's ``n_dims_per_step`` draws with ``random`` as ST's ``CachedLossDecorator``: same dims, same result."""
    _needs_st_matryoshka()
    columns = [_randn(5, 12, seed=80 + i) for i in range(3)]
    dims = (12, 8, 4, 2)
    inner = st_losses.MultipleNegativesRankingLoss(None)

    def calculate_loss(reps, labels=None, **_):
        value = inner.compute_loss_from_embeddings([torch.cat(chunks) for chunks in reps], None)
        value.backward()
        return value.detach()

    decorated = CachedLossDecorator(calculate_loss, dims, (1, 1, 1, 1), n_dims_per_step=2)
    leaves = [c.clone().requires_grad_() for c in columns]
    random.seed(seed)
    value_ref = decorated([[x] for x in leaves])
    ref = (torch.as_tensor(value_ref).detach(), [x.grad for x in leaves])
    ours_loss = fst.MultipleNegativesRankingLoss(None, matryoshka_dims=dims, n_dims_per_step=2, backend="cpp")
    random.seed(seed)
    _assert_same(_value_and_grads(ours_loss.compute_loss_from_embeddings, columns), ref)


# --------------------------------------------------------------------------- PML SupCon / NTXent


def _pml_supcon(temperature, *, dot=False):
    kw = {"distance": DotProductSimilarity(normalize_embeddings=False)} if dot else {}
    return PmlSupCon(temperature=temperature, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "labels",
    [
        [0, 1, 2, 0, 1, 2, 0, 3, 3, 1],  # random classes
        [0, 0, 1, 1, 2, 3, 3, 4],  # singleton classes: anchors without a positive
        [0, 0, 1, 2, 3, 4, 5],  # one positive pair
        [1, 1, 2],
        [1, 1],  # each anchor's only candidate is its positive: loss 0 on both sides
    ],
)
@pytest.mark.parametrize("temperature", [0.1, 0.05])
@pytest.mark.parametrize("dot", [False, True])
def test_supcon_labels_equals_pml(backend, labels, temperature, dot):
    y = torch.tensor(labels)
    x = _randn(len(labels), 6, seed=len(labels)) * (0.3 if dot else 1.0)
    ref = _value_and_grads(lambda t: _pml_supcon(temperature, dot=dot)(t[0], y), [x])
    sim = "dot" if dot else "cos"
    ours = _value_and_grads(
        lambda t: L.supcon_loss(t[0], labels=y, temperature=temperature, similarity=sim, backend=backend), [x]
    )
    _assert_same(ours, ref)
    # labels second, positionally, as PML takes them
    ours = _value_and_grads(
        lambda t: L.supcon_loss(t[0], y, temperature=temperature, similarity=sim, backend=backend), [x]
    )
    _assert_same(ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_labels_form_default_temperature_is_pml_default(backend):
    """``SupConLoss()(x, y)`` and every labels-form entry point without a temperature use
    PML's default (0.1), as ``supcon_labels_loss`` does; the structured form keeps 0.05."""
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 3, 3, 1])
    x = _randn(len(y), 6, seed=5)
    ref = _value_and_grads(lambda t: PmlSupCon()(t[0], y), [x])
    for name, fn in {
        "SupConLoss()(x, y)": lambda t: L.SupConLoss(backend=backend)(t[0], y),
        "SupConLoss()(x, labels=y)": lambda t: L.SupConLoss(backend=backend)(t[0], labels=y),
        "supcon_loss(x, y)": lambda t: L.supcon_loss(t[0], y, backend=backend),
        "supcon_loss(x, labels=y)": lambda t: L.supcon_loss(t[0], labels=y, backend=backend),
        "supcon_labels_loss(x, y)": lambda t: L.supcon_labels_loss(t[0], y, backend=backend),
    }.items():
        value, grads = _value_and_grads(fn, [x])
        _assert_same((value, grads), (ref[0], ref[1]), name)
    a, p = _randn(4, 6, seed=6), _randn(4, 2, 6, seed=7)
    structured = L.supcon_loss(a, p, backend=backend)
    kw = dict(terms=TERMS, logit_scale=LOGIT_SCALE[torch.float64])
    assert_loss_roundoff(structured, L.supcon_loss(a, p, temperature=0.05, backend=backend), torch.float64, **kw)
    assert_loss_roundoff(L.SupConLoss(backend=backend)(a, p), structured, torch.float64, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "labels,ref_labels",
    [
        ([0, 1, 2, 0], [0, 0, 1, 2, 2, 3]),
        ([0], [0, 1, 2]),  # one anchor, one positive, two negatives
        ([0, 9], [0, 1, 2]),  # an anchor without a positive in the reference set
        ([0, 1], [0, 0]),  # an anchor whose reference set is all positives
    ],
)
def test_supcon_labels_with_reference_set_equals_pml(backend, labels, ref_labels):
    y, ry = torch.tensor(labels), torch.tensor(ref_labels)
    x, r = _randn(len(labels), 6, seed=90), _randn(len(ref_labels), 6, seed=91)
    ref = _value_and_grads(lambda t: PmlSupCon(0.1)(t[0], y, ref_emb=t[1], ref_labels=ry), [x, r])
    ours = _value_and_grads(
        lambda t: L.supcon_loss(t[0], labels=y, ref_emb=t[1], ref_labels=ry, temperature=0.1, backend=backend), [x, r]
    )
    _assert_same(ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_supcon_labels_non_contiguous_equals_pml(backend, dtype):
    d = 8
    big = _randn(2 * d, 10, dtype=dtype, seed=100)
    x, r = big[:d].t()[::2], big[d:].t()[1::2]
    assert not x.is_contiguous()
    y = torch.tensor([0, 1, 0, 1, 2])
    ref = _value_and_grads(lambda t: PmlSupCon(0.1)(t[0], y), [x.contiguous()])
    _assert_same(_value_and_grads(lambda t: L.supcon_loss(t[0], labels=y, temperature=0.1, backend=backend), [x]), ref)
    ref = _value_and_grads(
        lambda t: PmlSupCon(0.1)(t[0], y, ref_emb=t[1], ref_labels=y.clone()), [x.contiguous(), r.contiguous()]
    )
    ours = _value_and_grads(
        lambda t: L.supcon_loss(t[0], labels=y, ref_emb=t[1], ref_labels=y, temperature=0.1, backend=backend), [x, r]
    )
    _assert_same(ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_supcon_views_equal_pml_on_view_major_rows(backend):
    x = _randn(6, 3, 8, seed=110)
    y = torch.tensor([0, 1, 0, 2, 3, 3])
    ref = _value_and_grads(lambda t: PmlSupCon(0.1)(torch.cat(torch.unbind(t[0], 1)), y.repeat(3)), [x])
    _assert_same(_value_and_grads(lambda t: L.supcon_loss(t[0], y, temperature=0.1, backend=backend), [x]), ref)
    # the ST class: each text column is one view
    cols = [x[:, v] for v in range(3)]
    loss = fst.SupConLabelsLoss(None, temperature=0.1, backend=backend)
    ours = _value_and_grads(lambda t: loss.compute_loss_from_embeddings(t, y), cols)
    ref = _value_and_grads(lambda t: PmlSupCon(0.1)(torch.cat(t), y.repeat(3)), cols)
    _assert_same(ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_supcon_labels_float32_b64_matches_pml_float32(backend):
    x = _randn(64, 64, dtype=torch.float32, seed=120)
    y = torch.randint(0, 8, (64,), generator=torch.Generator().manual_seed(121))
    ref = _value_and_grads(lambda t: PmlSupCon(0.1)(t[0], y), [x])
    ours = _value_and_grads(lambda t: L.supcon_labels_loss(t[0], y, temperature=0.1, backend=backend), [x])
    _assert_same(ours, ref)


def _bench_layout(anchor, blocks, P):
    """benchmarks.harness.peers' PML layout: anchor labels 0..B-1, own positives labelled by owner."""
    B = anchor.shape[0]
    cands = torch.cat(blocks)
    others = torch.arange(B, B + cands.shape[0] - B * P)
    return anchor, torch.arange(B), cands, torch.cat([torch.arange(B).repeat_interleave(P), others])


@pytest.mark.parametrize("backend", BACKENDS)
def test_pml_ntxent_and_supcon_equal_structured_losses(backend):
    B, P, Q, d = 5, 3, 2, 8
    a, p, n = _randn(B, d, seed=130), _randn(B, P, d, seed=131), _randn(B, Q, d, seed=132)

    def pml(cls, t, P):
        anchor, y, cands, ry = _bench_layout(t[0], [t[1].reshape(-1, d), t[2].reshape(-1, d)], P)
        return cls(0.05)(anchor, y, ref_emb=cands, ref_labels=ry)

    ref = _value_and_grads(lambda t: pml(PmlNTXent, t, P), [a, p, n])
    _assert_same(_value_and_grads(lambda t: L.supmpn_loss(*t, temperature=0.05, backend=backend), [a, p, n]), ref)
    ref = _value_and_grads(lambda t: pml(PmlSupCon, t, P), [a, p, n])
    _assert_same(_value_and_grads(lambda t: L.supcon_loss(*t, temperature=0.05, backend=backend), [a, p, n]), ref)
    p1 = p[:, 0]
    ref = _value_and_grads(lambda t: pml(PmlNTXent, [t[0], t[1][:, None], t[2]], 1), [a, p1, n])
    _assert_same(_value_and_grads(lambda t: L.mnrl_loss(*t, temperature=0.05, backend=backend), [a, p1, n]), ref)
