"""fastcl's sentence-transformers losses against sentence-transformers' own MNRL / cached MNRL.

On the same embeddings (float64, fresh random inputs, odd shapes) the fastcl losses must give
the value and the gradients of ``sentence_transformers``' ``MultipleNegativesRankingLoss``
where the two coincide (MNRL with and without hard negatives, any scale, cos or dot;
symmetric InfoNCE against ``directions=("query_to_doc", "doc_to_query")`` with
``partition_mode="per_direction"``); SupMPN / SupCon column layouts against the float64
oracles of ``fastcl.reference``; and, end to end through a tiny dropout-free BERT, the
plain and gradient-cached losses must give sentence-transformers' parameter gradients.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import pytest
import torch

st = pytest.importorskip("sentence_transformers")

from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402
from sentence_transformers.util import cos_sim, dot_score  # noqa: E402

from fastcl import reference as R  # noqa: E402
from fastcl.integrations import sentence_transformers as fst  # noqa: E402
from fastcl.testing import assert_roundoff  # noqa: E402
from tests.helpers import st as common  # noqa: E402
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DEFAULT = fst.DEFAULT_SCALE
# float64 against float64 here: logits of size at most ST's default scale 20 (1/0.07 ~ 14 for the
# SupCon / SupMPN layouts; dot products at scale 0.4 of |a| |c| ~ d <= 13 stay below it)
F64_LOGIT_SCALE = DEFAULT


def _columns(B: int, d: int, n: int, dtype=torch.float64) -> list[torch.Tensor]:
    return [torch.randn(B, d, dtype=dtype, requires_grad=True) for _ in range(n)]


def _value_and_grads(loss_fn, embs):
    value = loss_fn(embs)
    return value.detach(), torch.autograd.grad(value, embs)


def _assert_same(got, ref):
    """Values and column gradients in float64: the sums behind one number are a logit's d
    coordinates, a row's B x columns candidates and a column's B anchors."""
    (v, g), (rv, rg) = got, ref
    assert torch.isfinite(v)
    B, d = rg[0].shape
    terms = d + B * len(rg) + B
    kw = dict(terms=terms, logit_scale=F64_LOGIT_SCALE)
    assert_loss_roundoff(v, rv, torch.float64, **kw)
    assert len(g) == len(rg)
    for a, b in zip(g, rg):  # B = 1 cancels to ~0: terms of size d logit / d x ~ 1 per unit of logit
        assert_grad_roundoff(a, b, torch.float64, term_size=1.0, **kw)


# --------------------------------------------------------------------------- importing


def test_importing_fastcl_does_not_import_sentence_transformers():
    """fastcl imports without the extra; the integration, without it, names the extra."""
    code = (
        "import sys, fastcl, fastcl.losses, fastcl.gradcache, fastcl.integrations\n"
        "assert 'sentence_transformers' not in sys.modules, 'imported'\n"
        "sys.modules['sentence_transformers'] = None  # as if not installed\n"
        "try:\n    import fastcl.integrations.sentence_transformers\n"
        "except ImportError as e:\n    assert \"fastcl[st]\" in str(e), e\nelse:\n    raise SystemExit('no ImportError')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- vs ST's MNRL


@pytest.mark.parametrize("Q", [0, 1, 3])
@pytest.mark.parametrize("B,d", [(1, 5), (7, 13)])
def test_mnrl_equals_sentence_transformers(B, d, Q):
    embs = _columns(B, d, 2 + Q)
    ref = st_losses.MultipleNegativesRankingLoss(model=None)  # scale=20
    ours = fst.MultipleNegativesRankingLoss(torch.nn.Identity())
    _assert_same(
        _value_and_grads(ours.compute_loss_from_embeddings, embs),
        _value_and_grads(lambda e: ref.compute_loss_from_embeddings(e, None), embs),
    )


@pytest.mark.parametrize("similarity", ["cos", "dot"])
def test_mnrl_scale_and_similarity_match(similarity):
    fct, scale = (cos_sim, 7.3) if similarity == "cos" else (dot_score, 0.4)
    embs = _columns(6, 9, 3)
    ref = st_losses.MultipleNegativesRankingLoss(None, scale=scale, similarity_fct=fct)
    want = _value_and_grads(lambda e: ref.compute_loss_from_embeddings(e, None), embs)
    by_scale = fst.MultipleNegativesRankingLoss(torch.nn.Identity(), scale=scale, similarity_fct=fct)
    by_temperature = fst.MultipleNegativesRankingLoss(
        torch.nn.Identity(), temperature=1 / scale, similarity_fct=similarity
    )
    _assert_same(_value_and_grads(by_scale.compute_loss_from_embeddings, embs), want)
    _assert_same(_value_and_grads(by_temperature.compute_loss_from_embeddings, embs), want)


def test_supcon_with_one_positive_column_is_mnrl():
    embs = _columns(5, 8, 4)  # anchor, positive, 2 negatives
    ref = st_losses.MultipleNegativesRankingLoss(None, scale=11.0)
    ours = fst.SupConLoss(torch.nn.Identity(), scale=11.0)
    _assert_same(
        _value_and_grads(ours.compute_loss_from_embeddings, embs),
        _value_and_grads(lambda e: ref.compute_loss_from_embeddings(e, None), embs),
    )


@pytest.mark.parametrize("symmetric", [False, True])
def test_infonce_equals_sentence_transformers(symmetric):
    embs = _columns(9, 6, 2)
    kw = dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction") if symmetric else {}
    ref = st_losses.MultipleNegativesRankingLoss(None, **kw)
    ours = fst.InfoNCELoss(torch.nn.Identity(), symmetric=symmetric)
    _assert_same(
        _value_and_grads(ours.compute_loss_from_embeddings, embs),
        _value_and_grads(lambda e: ref.compute_loss_from_embeddings(e, None), embs),
    )


# --------------------------------------------------------------------------- multi-positive layouts


@pytest.mark.parametrize("P,Q", [(1, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("kind", ["supmpn", "supmpn_zero_logit", "supcon"])
def test_multi_positive_columns_match_reference(kind, P, Q):
    B, d, tau = 5, 7, 0.07
    embs = _columns(B, d, 1 + P + Q)

    def oracle(e):
        pos = torch.stack(e[1 : 1 + P], 1)
        neg = torch.stack(e[1 + P :], 1) if Q else None
        if kind == "supcon":
            return R.supcon(e[0], pos, neg, temperature=tau)
        own = "zero_logit" if kind == "supmpn_zero_logit" else "exclude"
        return R.supmpn(e[0], pos, neg, temperature=tau, own_positives=own)

    if kind == "supcon":
        loss = fst.SupConLoss(torch.nn.Identity(), temperature=tau, num_positives=P)
    else:
        own = "zero_logit" if kind == "supmpn_zero_logit" else "exclude"
        loss = fst.SupMPNLoss(torch.nn.Identity(), temperature=tau, num_positives=P, own_positives=own)
    _assert_same(_value_and_grads(loss.compute_loss_from_embeddings, embs), _value_and_grads(oracle, embs))


# --------------------------------------------------------------------------- end to end, cached


def _param_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _st_step(model, loss, features) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    value = loss([dict(f) for f in features], None)
    value.backward()
    return value.detach(), _param_grads(model)


@pytest.mark.parametrize("negatives", [0, 1])
def test_cached_and_plain_match_sentence_transformers_through_a_model(tmp_path, negatives):
    """Parameter gradients of a dropout-free tiny BERT: fastcl plain / cached vs ST plain / cached."""
    model = common.tiny_model(tmp_path, dropout=0.0).train()
    rows = common.sentences(11, seed=int(torch.randint(0, 2**31, ())))
    columns = [rows[i::3] for i in range(2 + negatives)]
    n = min(len(c) for c in columns)
    features = [model.preprocess(c[:n]) for c in columns]
    ref_value, ref_grads = _st_step(model, st_losses.MultipleNegativesRankingLoss(model), features)
    runs = {
        "fastcl": fst.MultipleNegativesRankingLoss(model),
        "fastcl cached": fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2),
        "ST cached": st_losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2),
    }
    assert ref_grads, "the model received no gradient"
    for name, loss in runs.items():
        value, grads = _st_step(model, loss, features)
        common.assert_value_close(value, ref_value, name)
        common.assert_grads_close(grads, ref_grads, name)


def test_cached_by_tokens_matches_sentence_transformers(tmp_path):
    """``mini_batch_num_tokens`` (chunks packed by tokens) as sentence-transformers' cached loss."""
    if "mini_batch_num_tokens" not in inspect.signature(st_losses.CachedMultipleNegativesRankingLoss).parameters:
        pytest.skip("this sentence-transformers has no mini_batch_num_tokens (6.2 added it)")
    model = common.tiny_model(tmp_path, dropout=0.0).train()
    rows = common.sentences(12, seed=11)
    features = [model.preprocess(rows[:6]), model.preprocess(rows[6:])]
    ref_value, ref_grads = _st_step(
        model, st_losses.CachedMultipleNegativesRankingLoss(model, mini_batch_num_tokens=12), features
    )
    loss = fst.CachedMultipleNegativesRankingLoss(model, mini_batch_num_tokens=12)
    assert loss.get_config_dict()["mini_batch_num_tokens"] == 12
    value, grads = _st_step(model, loss, features)
    common.assert_value_close(value, ref_value)
    common.assert_grads_close(grads, ref_grads, "fastcl cached by tokens")


@pytest.mark.parametrize("negatives", [0, 2])
def test_symmetric_classes_equal_sentence_transformers(negatives):
    """The (deprecated in ST 6) symmetric MNRL classes: the same values and gradients as ST's."""
    st_sym = getattr(st_losses, "MultipleNegativesSymmetricRankingLoss", None)
    if st_sym is None:
        pytest.skip("this sentence-transformers has no MultipleNegativesSymmetricRankingLoss")
    embs = _columns(5, 8, 2 + negatives)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ref_loss = st_sym(None, scale=10.0)
    ref = _value_and_grads(lambda e: ref_loss.compute_loss_from_embeddings(e, None), embs)
    got = _value_and_grads(
        fst.MultipleNegativesSymmetricRankingLoss(None, scale=10.0).compute_loss_from_embeddings, embs
    )
    _assert_same(got, ref)
    cached = fst.CachedMultipleNegativesSymmetricRankingLoss(None, scale=10.0)
    assert cached.mini_batch_size == 32 and cached.get_config_dict()["partition_mode"] == "per_direction"
    with pytest.raises(TypeError, match="fixes"):
        fst.MultipleNegativesSymmetricRankingLoss(None, directions=("query_to_doc",))


def test_cached_symmetric_matches_sentence_transformers_through_a_model(tmp_path):
    st_cached = getattr(st_losses, "CachedMultipleNegativesSymmetricRankingLoss", None)
    if st_cached is None:
        pytest.skip("this sentence-transformers has no CachedMultipleNegativesSymmetricRankingLoss")
    model = common.tiny_model(tmp_path, dropout=0.0).train()
    rows = common.sentences(10, seed=12)
    features = [model.preprocess(rows[:5]), model.preprocess(rows[5:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ref_value, ref_grads = _st_step(model, st_cached(model, mini_batch_size=2), features)
    value, grads = _st_step(model, fst.CachedMultipleNegativesSymmetricRankingLoss(model, mini_batch_size=2), features)
    common.assert_value_close(value, ref_value)
    common.assert_grads_close(grads, ref_grads, "fastcl cached symmetric")


def test_cached_loss_under_no_grad_is_the_plain_value(tmp_path):
    model = common.tiny_model(tmp_path, dropout=0.0).eval()
    rows = common.sentences(8, seed=3)
    features = [model.preprocess(rows[:4]), model.preprocess(rows[4:])]
    with torch.no_grad():
        cached = fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)([dict(f) for f in features])
        plain = fst.MultipleNegativesRankingLoss(model)([dict(f) for f in features])
    common.assert_value_close(cached, plain)


# --------------------------------------------------------------------------- conventions and errors


def test_cross_device_option():
    m = torch.nn.Identity()
    ring = fst.MultipleNegativesRankingLoss(m, cross_device="ring")
    assert ring.get_config_dict()["cross_device"] == "ring" and ring._options()["cross_device"] == "ring"
    assert "cross_device" not in fst.MultipleNegativesRankingLoss(m).get_config_dict()  # the default: unchanged cards
    with pytest.raises(ValueError, match="cross_device"):
        fst.MultipleNegativesRankingLoss(m, cross_device="all_to_all")
    # without a process group the option changes nothing
    cols = _columns(4, 6, 3)
    torch.testing.assert_close(
        ring.compute_loss_from_embeddings(cols), fst.MultipleNegativesRankingLoss(m).compute_loss_from_embeddings(cols)
    )


def test_scale_is_one_over_temperature():
    m = torch.nn.Identity()
    assert fst.MultipleNegativesRankingLoss(m).temperature == pytest.approx(0.05)  # ST's scale=20
    loss = fst.SupMPNLoss(m, temperature=0.1, num_positives=2)
    assert loss.scale == pytest.approx(10.0)
    loss.scale = 40.0
    assert loss.temperature == pytest.approx(0.025)
    cfg = loss.get_config_dict()
    assert cfg["scale"] == pytest.approx(40.0) and cfg["num_positives"] == 2 and cfg["similarity_fct"] == "cos_sim"
    assert fst.CachedMultipleNegativesRankingLoss(m).mini_batch_size == 32
    assert fst.InfoNCELoss(None, scale=DEFAULT).temperature == pytest.approx(1 / DEFAULT)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda m: fst.MultipleNegativesRankingLoss(m, scale=20.0, temperature=0.05), "not both"),
        (lambda m: fst.MultipleNegativesRankingLoss(m, scale=0.0), "scale"),
        (lambda m: fst.InfoNCELoss(m, temperature=float("nan")), "temperature"),
        (lambda m: fst.MultipleNegativesRankingLoss(m, similarity_fct=lambda a, b: a @ b.T), "similarity_fct"),
        (lambda m: fst.MultipleNegativesRankingLoss(m, mini_batch_size=0), "mini_batch_size"),
        (lambda m: fst.CachedMultipleNegativesRankingLoss(m, mini_batch_size=None), "mini_batch_size"),
        (lambda m: fst.CachedMultipleNegativesRankingLoss(m, mini_batch_num_tokens=0), "mini_batch_num_tokens"),
        (lambda m: fst.MultipleNegativesRankingLoss(m, mini_batch_num_tokens=64), "give mini_batch_size"),
        (lambda m: fst.MultipleNegativesRankingLoss(m, scale=torch.tensor(20.0, requires_grad=True)), "requires grad"),
        (lambda m: fst.SupMPNLoss(m, num_positives=0), "num_positives"),
        (lambda m: fst.SupMPNLoss(m, own_positives="keep"), "own_positives"),
        (lambda m: fst.SupConLoss(m, backend="fast"), "backend"),
    ],
)
def test_bad_arguments_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make(torch.nn.Identity())


@pytest.mark.parametrize(
    "loss, n",
    [
        (fst.MultipleNegativesRankingLoss(torch.nn.Identity()), 1),
        (fst.InfoNCELoss(torch.nn.Identity()), 3),
        (fst.SupMPNLoss(torch.nn.Identity(), num_positives=2), 2),
    ],
)
def test_wrong_number_of_columns_raises(loss, n):
    with pytest.raises(ValueError, match="columns"):
        loss.compute_loss_from_embeddings(_columns(4, 3, n))


@pytest.mark.parametrize(
    "loss, shapes, names",
    [
        (fst.MultipleNegativesRankingLoss(None), [(4, 3), (3, 3)], r"column 1 \(positive\) is \[3, 3\]"),
        (fst.MultipleNegativesRankingLoss(None), [(4, 3), (4, 3), (4, 2)], r"column 2 \(negative_1\) is \[4, 2\]"),
        (fst.InfoNCELoss(None), [(4, 3), (5, 3)], r"column 1 \(positive\) is \[5, 3\]"),
        (fst.SupMPNLoss(None, num_positives=2), [(4, 3), (4, 3), (2, 3)], r"column 2 \(positive_2\)"),
        (
            fst.SupConLoss(None, num_positives=1),
            [(4, 3), (4, 3), (4, 3), (6, 3)],
            r"column 3 \(negative_2\) is \[6, 3\]",
        ),
    ],
)
def test_mismatched_columns_are_named(loss, shapes, names):
    """Columns of different batch sizes or widths are reported by column, with the first
    column's shape, instead of blaming an internal tensor ("positives [B, P, d]")."""
    embs = [torch.randn(*s, dtype=torch.float64) for s in shapes]
    with pytest.raises(ValueError, match=names) as err:
        loss.compute_loss_from_embeddings(embs)
    assert "column 0 (anchor) is [4, 3]" in str(err.value)


def test_mismatched_label_views_are_named():
    loss = fst.SupConLabelsLoss(None)
    with pytest.raises(ValueError, match=r"column 0 \(view_1\) is \[4, 3\], column 1 \(view_2\) is \[3, 3\]"):
        loss.compute_loss_from_embeddings([torch.randn(4, 3), torch.randn(3, 3)], torch.arange(4))


def test_gather_without_process_group_is_single_process():
    embs = _columns(4, 5, 2)
    gathered = fst.MultipleNegativesRankingLoss(torch.nn.Identity(), gather_across_devices=True)
    plain = fst.MultipleNegativesRankingLoss(torch.nn.Identity())
    assert gathered._group() is None
    _assert_same(
        _value_and_grads(gathered.compute_loss_from_embeddings, embs),
        _value_and_grads(plain.compute_loss_from_embeddings, embs),
    )


def test_matryoshka_wraps_the_plain_loss(tmp_path):
    """MatryoshkaLoss around fastcl's MNRL gives the gradients of MatryoshkaLoss around ST's."""
    model = common.tiny_model(tmp_path, dropout=0.0)
    rows = common.sentences(10, seed=5)
    features = [model.preprocess(rows[:5]), model.preprocess(rows[5:])]
    dims = [common.HIDDEN, common.HIDDEN // 2]
    ref_value, ref_grads = _st_step(
        model, st_losses.MatryoshkaLoss(model, st_losses.MultipleNegativesRankingLoss(model), dims), features
    )
    value, grads = _st_step(
        model, st_losses.MatryoshkaLoss(model, fst.MultipleNegativesRankingLoss(model), dims), features
    )
    common.assert_value_close(value, ref_value)
    common.assert_grads_close(grads, ref_grads, "matryoshka")
    # The cached form follows sentence-transformers' gradient-cache protocol (MatryoshkaLoss
    # wraps its calculate_loss): same gradients (more cases in tests/integrations/test_st_api.py).
    cached = st_losses.MatryoshkaLoss(model, fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2), dims)
    value, grads = _st_step(model, cached, features)
    common.assert_value_close(value, ref_value)
    common.assert_grads_close(grads, ref_grads, "cached matryoshka")


def test_cached_chunks_drop_unused_padding(tmp_path):
    """A chunk of short sentences is encoded at its own width (and to the same embeddings)."""
    model = common.tiny_model(tmp_path, dropout=0.0).eval()
    short, long = ["the cat sat"] * 2, ["a big red dog ran fast under the blue sky today"] * 2
    features = model.preprocess(short + long)
    widths = []
    encode = fst._SentenceEmbedding(model)
    original = model.forward
    model.forward = lambda f, **kw: (widths.append(f["input_ids"].shape[1]), original(f, **kw))[1]
    try:
        chunks = [encode(**{k: v[i : i + 2] if torch.is_tensor(v) else v for k, v in features.items()}) for i in (0, 2)]
    finally:
        del model.forward
    assert widths == [5, features["input_ids"].shape[1]]  # [CLS] the cat sat [SEP]
    want = model(dict(features))["sentence_embedding"]
    # the same embeddings from narrower padding: the model's sums (no loss) in another order, of
    # terms of the size of the largest embedding coordinate
    assert_roundoff(torch.cat(chunks), want, terms=common.MODEL_TERMS)
