"""fastcl's ``GISTEmbedLoss`` / ``CachedGISTEmbedLoss`` against sentence-transformers 6.2's.

* Every option, float64: sentence-transformers' own ``GISTEmbedLoss`` and
  ``CachedGISTEmbedLoss`` run on a stand-in model whose embeddings are a parameter table
  (``tests.helpers.st.lookup_model``), with a guide table that groups the texts into
  meanings: margin strategy x margin (0, 0.1, 0.3) x contrast_anchors x contrast_positives x
  temperature (0.01, 0.05), with 0, 1 and 2 negative columns (2: against the cached loss, the
  uncached one takes at most one). Values and the table's gradient within float64 round-off.
* Through real models, float32: a tiny random BERT trained with all-MiniLM-L6-v2 as the guide,
  once with another tokenizer (the texts are decoded and re-tokenized for the guide) and
  once with MiniLM's own; dropout on, seeded. Plain against plain and cached against cached,
  over a pairwise cover of the options; the loss value and every parameter's gradient within
  float32 bounds (``fastcl.testing``).
* The arguments, checks and ``get_config_dict`` of sentence-transformers; bad input.
"""

from __future__ import annotations

import itertools

import pytest
import torch

st = pytest.importorskip("sentence_transformers")

from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

from fastcl import testing as T  # noqa: E402
from fastcl.integrations import sentence_transformers as fst  # noqa: E402
from fastcl.losses import gist_loss  # noqa: E402
from tests.helpers import st as common  # noqa: E402
from tests.helpers.gradcache import one_thread  # noqa: E402, F401  (the fixture)
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff  # noqa: E402

# tiny models: one intra-op thread (two stall each other on a busy 2-core machine: 4x slower)
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_thread")]

B, D, G = 5, 6, 4  # an odd batch: cached chunks of 2 leave a chunk of 1
# float64 sums behind a value or gradient entry: a logit's D coordinates, a row's candidates
# (up to 4 columns and the anchors, 5 x B) and a column's B anchors
F64_TERMS = D + 5 * B + B
ST_TEMPERATURE = 0.01  # sentence-transformers' default
CHUNK = 2
MARGINS = [(s, m) for s in ("absolute", "relative") for m in (0.0, 0.1, 0.3)]
FLAGS = list(itertools.product([True, False], [True, False], [0.01, 0.05]))  # anchors, positives, temperature


# --------------------------------------------------------------------------- float64, every option


def _tables(columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Model and guide embeddings of ``columns x B`` texts (row ``c * B + i``). The guide sees
    three meanings: an anchor and its positive share one, other rows repeat them, so the guide
    finds some in-batch candidates closer than the positive; the model's table is unrelated."""
    g = torch.Generator().manual_seed(seed)
    n = columns * B
    meanings = torch.randn(3, G, generator=g, dtype=torch.float64)
    of = torch.randint(0, 3, (n,), generator=g)
    of[B : 2 * B] = of[:B]  # positive i means what anchor i means
    guide = meanings[of] + 0.6 * torch.randn(n, G, generator=g, dtype=torch.float64)
    return torch.randn(n, D, generator=g, dtype=torch.float64), guide


def _features(columns: int) -> list[dict]:
    return [common.row_features(range(c * B, (c + 1) * B)) for c in range(columns)]


def _run(loss, model, features) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad()
    value = loss([dict(f) for f in features], None)
    value.backward()
    return value.detach(), model.table.grad.clone()


def _assert_same(got, want, what: str, temperature: float = ST_TEMPERATURE, weight: float = 1.0) -> None:
    """Float64 round-off of :data:`F64_TERMS` sums, logits of size ``1/temperature`` (times
    ``weight``, the sum of the losses' weights)."""
    (v, g), (rv, rg) = got, want
    assert torch.isfinite(v), what
    kw = dict(terms=F64_TERMS, logit_scale=weight / temperature)
    assert_loss_roundoff(v, rv, torch.float64, **kw, msg=f"{what}: value")
    assert_grad_roundoff(g, rg, torch.float64, **kw, msg=f"{what}: gradient")


def _dropped(guide: torch.Tensor, columns: int, strategy: str, margin: float) -> tuple[int, int]:
    """How many anchor-row candidates the guide drops, of how many (the own positive excluded)."""
    ga, gp = guide[:B], guide[B : 2 * B]
    cos = torch.nn.functional.cosine_similarity
    g = cos(ga, gp)[:, None]
    thr = g - margin if strategy == "absolute" else g - g.abs() * margin
    cands = torch.cat([gp, ga, *[guide[c * B : (c + 1) * B] for c in range(2, columns)]])
    drop = cos(ga[:, None], cands[None], dim=-1) > thr
    drop[torch.arange(B), torch.arange(B)] = False  # the own positive
    return int(drop.sum()), drop.numel() - B


@pytest.mark.parametrize("negatives", [0, 1, 2])
@pytest.mark.parametrize("strategy, margin", MARGINS)
def test_every_option_equals_sentence_transformers(strategy, margin, negatives):
    columns = 2 + negatives
    model_table, guide_table = _tables(columns, seed=17 * negatives + int(margin * 10))
    model = common.lookup_model(model_table)
    guide = common.lookup_model(guide_table, tokenizer=model.tokenizer, trainable=False)
    features = _features(columns)
    dropped, total = _dropped(guide_table, columns, strategy, margin)
    assert 0 < dropped < total, f"the guide drops {dropped} of {total}: the filter is not exercised"
    for anchors, positives, temperature in FLAGS:
        opts = dict(
            temperature=temperature,
            margin_strategy=strategy,
            margin=margin,
            contrast_anchors=anchors,
            contrast_positives=positives,
        )
        what = f"{opts}, {negatives} negative column(s)"
        st_cached = _run(st_losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=CHUNK, **opts), model, features)
        if negatives <= 1:
            want = _run(st_losses.GISTEmbedLoss(model, guide, **opts), model, features)
            _assert_same(st_cached, want, f"ST cached vs ST ({what})", temperature)  # the oracle agrees with itself
        else:
            want = st_cached
        _assert_same(
            _run(fst.GISTEmbedLoss(model, guide, **opts), model, features), want, f"fastcl, {what}", temperature
        )
        cached = fst.CachedGISTEmbedLoss(model, guide, mini_batch_size=CHUNK, **opts)
        _assert_same(_run(cached, model, features), st_cached, f"fastcl cached, {what}", temperature)


def test_compute_loss_from_embeddings_and_no_grad():
    """The embeddings entry point (no model) and a forward under no_grad give the same value."""
    model_table, guide_table = _tables(3, seed=5)
    model = common.lookup_model(model_table)
    guide = common.lookup_model(guide_table, tokenizer=model.tokenizer, trainable=False)
    want = st_losses.GISTEmbedLoss(model, guide, margin=0.1)([dict(f) for f in _features(3)], None)
    cols = [model_table[c * B : (c + 1) * B] for c in range(3)]
    gcols = [guide_table[c * B : (c + 1) * B] for c in range(3)]
    got = fst.GISTEmbedLoss(None, None, margin=0.1).compute_loss_from_embeddings(cols, gcols)
    kw = dict(terms=F64_TERMS, logit_scale=1 / ST_TEMPERATURE)
    assert_loss_roundoff(got, want.detach(), torch.float64, **kw)
    with torch.no_grad():
        for loss in (
            fst.GISTEmbedLoss(model, guide, margin=0.1),
            fst.CachedGISTEmbedLoss(model, guide, 0.01, 2, margin=0.1),
        ):
            assert_loss_roundoff(loss([dict(f) for f in _features(3)]), want.detach(), torch.float64, **kw)


@pytest.mark.parametrize("cached", [False, True])
def test_inside_matryoshka_loss_and_fused_dims(cached):
    """sentence-transformers' MatryoshkaLoss around the fastcl loss (its gradient-cache protocol,
    ``calculate_loss(reps, reps_guided)``, for the cached one) equals it around its own, and so
    does fastcl's fused ``matryoshka_dims`` (the guide's decisions shared by every prefix)."""
    model_table, guide_table = _tables(3, seed=7)
    model = common.lookup_model(model_table)
    model.get_embedding_dimension = lambda: D
    guide = common.lookup_model(guide_table, tokenizer=model.tokenizer, trainable=False)
    features, dims = _features(3), [D, 4, 2]
    make_st = (
        (lambda: st_losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=CHUNK, margin=0.1))
        if cached
        else (lambda: st_losses.GISTEmbedLoss(model, guide, margin=0.1))
    )
    make = (
        (lambda **kw: fst.CachedGISTEmbedLoss(model, guide, mini_batch_size=CHUNK, margin=0.1, **kw))
        if cached
        else (lambda **kw: fst.GISTEmbedLoss(model, guide, margin=0.1, **kw))
    )
    want = _run(st_losses.MatryoshkaLoss(model, make_st(), dims), model, features)
    # three dims' losses, each of weight 1
    _assert_same(_run(st_losses.MatryoshkaLoss(model, make(), dims), model, features), want, "wrapped", weight=3.0)
    _assert_same(_run(make(matryoshka_dims=dims), model, features), want, "fused dims", weight=3.0)


# --------------------------------------------------------------------------- real models, float32

# A pairwise cover: every two of (strategy, margin, contrast_anchors, contrast_positives, a
# negative column, temperature) take every pair of their values in some row; row 0 is the default.
COVER = [
    ("absolute", 0.0, True, True, True, 0.01),
    ("relative", 0.0, False, True, False, 0.05),
    ("relative", 0.1, False, True, True, 0.05),
    ("absolute", 0.1, False, False, True, 0.05),
    ("absolute", 0.3, False, True, True, 0.01),
    ("relative", 0.3, True, False, False, 0.05),
    ("relative", 0.0, True, False, True, 0.01),
    ("absolute", 0.1, True, False, False, 0.01),
]

# (anchor, positive, negative) from the toy vocabulary (tests.helpers.st.WORDS): paraphrase
# pairs whose topics repeat across rows, so MiniLM finds other rows closer than some positives
TRIPLETS = [
    ("the cat sat on the mat", "a cat sat on a mat today", "the dog ran under the tree"),
    ("a small dog ran fast", "the small dog ran fast yesterday", "a big bird flew slow"),
    ("the bird flew over the tree", "a bird flew over a green tree", "the man sat on the road"),
    ("one cat sat under the red tree", "a cat sat under one red tree today", "the woman ate"),
    ("the big dog ran on the road", "a big dog ran on a road", "a blue bird sat on the mat"),
    ("a woman saw the child", "the woman saw a child today", "the child flew over the sky"),
]


def _param_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _model_step(model, loss, features, seed: int = 0) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    torch.manual_seed(seed)  # dropout: the same masks for every loss
    value = loss([dict(f) for f in features], None)
    value.backward()
    return value.detach(), _param_grads(model)


def _assert_model_close(got, want, temperature: float, what: str) -> None:
    """float32 through the tiny model: the sums behind a value and a parameter gradient are
    ``common.MODEL_TERMS`` long, the logits of size ``1 / temperature`` (an absolute error of the
    value, a relative one of the gradients: ``fastcl.testing.assert_close``); a gradient whose
    true value cancels (attention key biases) has terms of the model's largest RMS gradient."""
    (v, g), (rv, rg) = got, want
    scale = 1 / temperature
    T.assert_close(f"{what}: value", v, rv, torch.float32, terms=common.MODEL_TERMS, magnitude=scale)
    assert g.keys() == rg.keys(), what
    assert any(t.abs().max() > 0 for t in rg.values()), f"{what}: the model received no gradient"
    size = max(r.double().norm().item() / max(r.numel(), 1) ** 0.5 for r in rg.values())
    for k in rg:
        kw = dict(terms=common.MODEL_TERMS, magnitude=size * scale, logit_scale=scale)
        T.assert_close(f"{what}: {k}", g[k], rg[k], torch.float32, **kw)


@pytest.fixture(scope="module")
def minilm():
    from sentence_transformers import SentenceTransformer

    from tests.helpers.eval import minilm_path

    # deterministic (eval mode), so each distinct guide batch is encoded once for all the losses
    return common.memoized(SentenceTransformer(str(minilm_path()), device="cpu").eval())


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    """A tiny BERT with a 40-word vocabulary: MiniLM must re-tokenize its texts."""
    return common.tiny_model(tmp_path_factory.mktemp("gist_toy"), dropout=0.1).train()


@pytest.fixture(scope="module")
def minilm_vocab_model(tmp_path_factory, minilm):
    """A tiny random BERT with MiniLM's tokenizer: the guide reads the model's own features."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("gist_same_vocab")
    config = BertConfig(
        vocab_size=minilm.tokenizer.vocab_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng():
        torch.manual_seed(3)
        BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    minilm.tokenizer.save_pretrained(folder)
    transformer = Transformer(str(folder), max_seq_length=32, model_kwargs={"add_pooling_layer": False})
    return SentenceTransformer(modules=[transformer, Pooling(16, "mean")], device="cpu").train()


def _pair(request, which: str):
    return request.getfixturevalue("toy_model" if which == "retokenize" else "minilm_vocab_model")


@pytest.mark.parametrize("which", ["retokenize", "same_tokenizer"])
def test_through_models_equals_sentence_transformers(request, minilm, which):
    model = _pair(request, which)
    features = [model.preprocess([t[c] for t in TRIPLETS]) for c in range(3)]
    # built once (each compares the two vocabularies); the options are plain attributes of
    # both implementations, read at every call
    losses = {
        "plain": (st_losses.GISTEmbedLoss(model, minilm), fst.GISTEmbedLoss(model, minilm)),
        "cached": (
            st_losses.CachedGISTEmbedLoss(model, minilm, mini_batch_size=4),
            fst.CachedGISTEmbedLoss(model, minilm, mini_batch_size=4),
        ),
    }
    assert losses["plain"][0].must_retokenize == losses["plain"][1].must_retokenize == (which == "retokenize")
    for strategy, margin, anchors, positives, negative, temperature in COVER:
        opts = dict(
            temperature=temperature,
            margin_strategy=strategy,
            margin=margin,
            contrast_anchors=anchors,
            contrast_positives=positives,
        )
        cols = features[: 3 if negative else 2]
        for kind, (theirs, ours) in losses.items():
            for loss in (theirs, ours):
                for k, v in opts.items():
                    setattr(loss, k, v)
            want = _model_step(model, theirs, cols)
            _assert_model_close(
                _model_step(model, ours, cols), want, temperature, f"{kind}, {which}, {opts}, negative={negative}"
            )


def test_the_guide_filters_the_real_batch(minilm, toy_model):
    """The batch above exercises the filter: MiniLM drops some in-batch candidates, not all."""
    loss = fst.GISTEmbedLoss(toy_model, minilm)
    features = [toy_model.preprocess([t[c] for t in TRIPLETS]) for c in range(3)]
    with torch.no_grad():
        _, guide = loss._embed_with_guide([dict(f) for f in features])
    stacked = torch.cat(guide).double()
    n = len(TRIPLETS)
    ga, gp = stacked[:n], stacked[n : 2 * n]
    cos = torch.nn.functional.cosine_similarity
    drop = cos(ga[:, None], torch.cat([gp, ga, stacked[2 * n :]])[None], dim=-1) > cos(ga, gp)[:, None]
    drop[torch.arange(n), torch.arange(n)] = False
    assert 0 < int(drop.sum()) < drop.numel() - n


def test_cached_by_tokens_and_shorter_guide(minilm, minilm_vocab_model, toy_model):
    """``mini_batch_num_tokens``; a guide whose ``max_seq_length`` is shorter re-tokenizes."""
    features = [toy_model.preprocess([t[c] for t in TRIPLETS]) for c in range(2)]
    want = _model_step(toy_model, st_losses.CachedGISTEmbedLoss(toy_model, minilm, mini_batch_num_tokens=20), features)
    got = _model_step(toy_model, fst.CachedGISTEmbedLoss(toy_model, minilm, mini_batch_num_tokens=20), features)
    _assert_model_close(got, want, 0.01, "mini_batch_num_tokens")
    model, saved = minilm_vocab_model, minilm.max_seq_length
    minilm.max_seq_length = 8
    try:
        ours, theirs = fst.GISTEmbedLoss(model, minilm, margin=0.1), st_losses.GISTEmbedLoss(model, minilm, margin=0.1)
        assert ours.must_retokenize and theirs.must_retokenize
        features = [model.preprocess([t[c] for t in TRIPLETS]) for c in range(2)]
        _assert_model_close(
            _model_step(model, ours, features), _model_step(model, theirs, features), 0.01, "short guide"
        )
    finally:
        minilm.max_seq_length = saved


def test_cached_with_a_guide_built_like_the_model(toy_model, tmp_path):
    """A guide with the model's very parameter names (another tiny BERT of the same vocabulary):
    the gradient cache tracks the model's parameters only, and the guide is not re-encoded."""
    guide = common.tiny_model(tmp_path, dropout=0.0, seed=1).eval()
    features = [toy_model.preprocess([t[c] for t in TRIPLETS]) for c in range(3)]
    opts = dict(margin=0.1, temperature=0.05, mini_batch_size=4)
    want = _model_step(toy_model, st_losses.CachedGISTEmbedLoss(toy_model, guide, **opts), features)
    got = _model_step(toy_model, fst.CachedGISTEmbedLoss(toy_model, guide, **opts), features)
    _assert_model_close(got, want, 0.05, "guide built like the model")


# --------------------------------------------------------------------------- arguments and errors


def test_signatures_and_config_match_sentence_transformers(minilm, toy_model):
    import inspect

    for ours, theirs in (
        (fst.GISTEmbedLoss, st_losses.GISTEmbedLoss),
        (fst.CachedGISTEmbedLoss, st_losses.CachedGISTEmbedLoss),
    ):
        want = [(p.name, p.default) for p in inspect.signature(theirs).parameters.values()]
        got = [(p.name, p.default) for p in inspect.signature(ours).parameters.values() if p.name != "kw"]
        assert got == want, ours.__name__
    args = (toy_model, minilm, 0.05, "relative", 0.2, False, True, True)  # positionally, in ST's order
    ours, theirs = fst.GISTEmbedLoss(*args), st_losses.GISTEmbedLoss(*args)
    assert ours.get_config_dict() == theirs.get_config_dict()
    assert ours.citation == theirs.citation and ours.must_retokenize is True and ours.temperature == 0.05
    cargs = (toy_model, minilm, 0.02, 8, 40, False, "absolute", 0.1, True, False, False)
    ours, theirs = fst.CachedGISTEmbedLoss(*cargs), st_losses.CachedGISTEmbedLoss(*cargs)
    assert ours.get_config_dict() == theirs.get_config_dict()
    assert not hasattr(theirs, "citation") and "solatorio2024gistembed" in ours.citation and ours.uses_gradient_cache
    assert "guide=" not in repr(ours).split("\n")[0] and "margin=0.1" in repr(ours)
    assert fst.GISTEmbedLoss(toy_model, minilm, backend="torch").get_config_dict()["backend"] == "torch"


def _no_tokenizer_model():
    return torch.nn.Linear(2, 2)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda m, g: fst.GISTEmbedLoss(m, g, margin_strategy="cosine"), ValueError, "margin_strategy"),
        (lambda m, g: fst.CachedGISTEmbedLoss(m, g, margin_strategy="cosine"), ValueError, "margin_strategy"),
        (lambda m, g: fst.GISTEmbedLoss(m, g, margin_strategy="relative", margin=-0.1), ValueError, "margin >= 0"),
        (lambda m, g: fst.GISTEmbedLoss(m, g, margin=float("nan")), ValueError, "finite"),
        (lambda m, g: fst.GISTEmbedLoss(m, g, temperature=0.0), ValueError, "temperature"),
        (lambda m, g: fst.GISTEmbedLoss(_no_tokenizer_model(), g), ValueError, "tokenizer attribute"),
        (lambda m, g: fst.CachedGISTEmbedLoss(m, _no_tokenizer_model()), ValueError, "tokenizer attribute"),
        (lambda m, g: fst.GISTEmbedLoss(m, None), ValueError, "both model and guide"),
        (lambda m, g: fst.CachedGISTEmbedLoss(m, g, mini_batch_size=None), ValueError, "mini_batch_size"),
        (lambda m, g: fst.CachedGISTEmbedLoss(m, g, mini_batch_num_tokens=0), ValueError, "mini_batch_num_tokens"),
        (lambda m, g: fst.GISTEmbedLoss(m, g, scale=20.0), TypeError, "temperature"),
    ],
)
def test_bad_arguments_raise(make, error, match):
    model = common.lookup_model(torch.randn(4, 3, dtype=torch.float64))
    guide = common.lookup_model(torch.randn(4, 3, dtype=torch.float64), tokenizer=model.tokenizer, trainable=False)
    with pytest.raises(error, match=match):
        make(model, guide)


def test_tokenizer_checks_follow_sentence_transformers():
    """A tokenizer that is not a transformers one, and a StaticEmbedding model that would have to
    be re-tokenized (or chunked): refused, as sentence-transformers refuses them."""
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    model = common.lookup_model(torch.randn(4, 3, dtype=torch.float64))
    odd = common.lookup_model(torch.randn(4, 3, dtype=torch.float64), trainable=False)
    odd.tokenizer = object()
    for make in (fst.GISTEmbedLoss, st_losses.GISTEmbedLoss):
        with pytest.raises(ValueError, match="PreTrainedTokenizer"):
            make(model, odd)
    vocab = {w: i for i, w in enumerate(common.SPECIAL + common.WORDS)}
    static = st.SentenceTransformer(
        modules=[StaticEmbedding(Tokenizer(WordLevel(vocab, unk_token="[UNK]")), embedding_dim=4)], device="cpu"
    )
    for make in (fst.CachedGISTEmbedLoss, st_losses.CachedGISTEmbedLoss):
        with pytest.raises(ValueError, match="StaticEmbedding"):
            make(static, static)
    # re-tokenizing (another vocabulary) a StaticEmbedding model that has a transformers tokenizer
    static_tok = torch.nn.Sequential(static[0])
    static_tok.tokenizer, static_tok.max_seq_length = common.toy_tokenizer(), 16
    from transformers import BertTokenizerFast

    other = common.lookup_model(torch.randn(4, 3, dtype=torch.float64), trainable=False)
    other.tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(common.SPECIAL + ["cat", "dog"])})
    for make in (fst.GISTEmbedLoss, st_losses.GISTEmbedLoss):
        with pytest.raises(ValueError, match="must not be based on a StaticEmbedding"):
            make(static_tok, other)


def test_bad_guide_embeddings_raise_through_the_drop_in_and_gist_loss():
    g = torch.Generator().manual_seed(0)
    cols = [torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(3)]
    guide = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    loss = fst.GISTEmbedLoss(None, None)
    short = [guide[0], guide[1][:3], guide[2]]
    with pytest.raises(ValueError, match=r"column 1 \(positive\) have 3 rows, the model's embeddings 4"):
        loss.compute_loss_from_embeddings(cols, short)
    with pytest.raises(ValueError, match="guide_positive must be"):
        gist_loss(cols[0], cols[1], guide=(guide[0], guide[1][:3]))
    with pytest.raises(ValueError, match="guide_negatives must be"):
        gist_loss(cols[0], cols[1], cols[2], guide=(guide[0], guide[1], guide[2][:2]))
    grad = [guide[0].clone().requires_grad_(), guide[1], guide[2]]
    with pytest.raises(ValueError, match=r"column 0 \(anchor\) require grad"):
        loss.compute_loss_from_embeddings(cols, grad)
    with pytest.raises(ValueError, match="guide_anchor requires grad"):
        gist_loss(cols[0], cols[1], guide=(grad[0], guide[1]))
    with pytest.raises(ValueError, match="2 of guide embeddings"):
        loss.compute_loss_from_embeddings(cols, guide[:2])
    with pytest.raises(ValueError, match="guide_negatives exactly when"):
        gist_loss(cols[0], cols[1], guide=tuple(guide))
    with pytest.raises(ValueError, match="one guide, one width"):
        loss.compute_loss_from_embeddings(cols, [guide[0], guide[1], guide[2][:, :2]])
    with pytest.raises(ValueError, match="margin >= 0"):
        gist_loss(cols[0], cols[1], guide=tuple(guide[:2]), margin_strategy="relative", margin=-0.2)
    with pytest.raises(ValueError, match="columns"):
        loss.compute_loss_from_embeddings(cols[:1], guide[:1])
    with pytest.raises(ValueError, match="without a model"):
        loss([common.row_features(range(4))] * 2)
