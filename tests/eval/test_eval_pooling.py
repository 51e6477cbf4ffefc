"""fastcl.pooling and fastcl.eval.encode on a tiny random BERT: shapes, masking, layers, grads."""

from __future__ import annotations

import pytest
import torch

from fastcl.pooling import POOLINGS, masked_mean, needs_hidden_states, pool
from fastcl.testing import assert_roundoff
from tests.helpers.eval import MINILM_TERMS, TINY_BERT_TERMS, minilm_path, tiny_bert


def _batch(seed=0, B=5, T=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 2000, (B, T), generator=g)
    lengths = torch.tensor([T, 1, 4, T - 2, 2])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return ids * mask, mask  # pad id 0 after each row's length


def _reference(outputs, mask, method):
    """float64 loops: the definition, token by token."""
    m = mask.double()

    def mmean(states):
        s = states.double()
        return torch.stack([(s[i] * m[i, :, None]).sum(0) / m[i].sum().clamp_min(1) for i in range(len(s))])

    if method == "cls":
        return outputs.pooler_output.double()
    if method == "cls_before_pooler":
        return outputs.last_hidden_state[:, 0].double()
    if method == "mean":
        return mmean(outputs.last_hidden_state)
    if method == "mean_no_cls":  # Liao: every real token but the first ([CLS])
        s = outputs.last_hidden_state.double()
        return torch.stack(
            [s[i, 1 : int(mask[i].sum())].sum(0) / max(1, int(mask[i].sum()) - 1) for i in range(len(s))]
        )
    hs = outputs.hidden_states
    if method == "avg_first_last":
        return (mmean(hs[1]) + mmean(hs[-1])) / 2
    return (mmean(hs[-2]) + mmean(hs[-1])) / 2


@pytest.mark.parametrize("method", POOLINGS)
def test_pool_matches_float64_definition(method):
    model = tiny_bert()
    ids, mask = _batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    got = pool(out, mask, method)
    assert got.shape == (ids.shape[0], model.config.hidden_size) and got.dtype == torch.float32
    # float32 sums of at most 2 x 9 tokens' hidden states against float64: terms of their size
    size = max(h.abs().max().item() for h in out.hidden_states)
    assert_roundoff(got.double(), _reference(out, mask, method), torch.float32, terms=2 * 9, magnitude=size)


@pytest.mark.parametrize("method", ["mean", "mean_no_cls", "avg_first_last", "avg_top2", "cls_before_pooler", "cls"])
def test_padding_does_not_change_the_embedding(method):
    model = tiny_bert()
    ids, mask = _batch()
    pad = torch.zeros(ids.shape[0], 6, dtype=ids.dtype)
    with torch.no_grad():
        a = pool(model(input_ids=ids, attention_mask=mask, output_hidden_states=True), mask, method)
        ids2, mask2 = torch.cat([ids, pad], 1), torch.cat([mask, pad], 1)
        b = pool(model(input_ids=ids2, attention_mask=mask2, output_hidden_states=True), mask2, method)
    assert_roundoff(a, b, terms=TINY_BERT_TERMS)  # the model's sums at another width


def test_avg_first_last_uses_the_first_transformer_layer_not_the_embeddings():
    B, T, H = 2, 3, 4
    mask = torch.ones(B, T)
    hs = tuple(torch.full((B, T, H), float(v)) for v in (100.0, 1.0, 2.0, 3.0))  # emb, L1, L2, L3
    out = {"last_hidden_state": hs[-1], "hidden_states": hs}
    assert torch.allclose(pool(out, mask, "avg_first_last"), torch.full((B, H), 2.0))  # (1 + 3) / 2
    assert torch.allclose(pool(out, mask, "avg_top2"), torch.full((B, H), 2.5))  # (2 + 3) / 2


def test_empty_mask_row_pools_to_zero_and_bf16_stays_bf16():
    states = torch.randn(3, 4, 8, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = masked_mean(states, mask)
    assert torch.equal(out[1], torch.zeros(8, dtype=torch.float64))
    ref = (states[0, :2].mean(0), states[2].mean(0))
    torch.testing.assert_close(out[0], ref[0])
    low = masked_mean(states.bfloat16(), mask)
    assert low.dtype == torch.bfloat16
    # reduced in float32: error no worse than rounding the exact result to bf16
    err = (low.double() - out).abs().max()
    assert err <= 2 * (out.bfloat16().double() - out).abs().max() + 1e-2


@pytest.mark.parametrize("method", ["mean", "avg_first_last", "cls"])
def test_pool_is_differentiable(method):
    model = tiny_bert().train()
    ids, mask = _batch()
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=needs_hidden_states(method))
    pool(out, mask, method).square().sum().backward()
    grads = [p.grad for p in model.encoder.layer[0].parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_pool_errors_are_clear():
    model = tiny_bert(pooler=False)
    ids, mask = _batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="pooling='max'"):
        pool(out, mask, "max")
    with pytest.raises(ValueError, match="pooler_output"):
        pool(out, mask, "cls")
    with pytest.raises(ValueError, match="output_hidden_states=True"):
        pool(out, mask, "avg_first_last")
    with pytest.raises(ValueError, match="attention_mask has shape"):
        pool(out, mask[:, :-1], "mean")
    with pytest.raises(TypeError, match="attention_mask"):
        pool(out, mask.tolist(), "mean")
    assert needs_hidden_states("avg_top2") and not needs_hidden_states("mean")


def test_encode_order_duplicates_batching_and_mode():
    from transformers import AutoTokenizer

    from fastcl.eval.encode import Encoder, encode

    tok = AutoTokenizer.from_pretrained(minilm_path())
    model = tiny_bert().train()  # encode must switch to eval and back
    sentences = ["a b c d e f g", "short", "a man plays a guitar .", "short", "x " * 40, ""]
    one_by_one = torch.cat([encode(model, tok, [s], "avg_first_last", show_progress=False) for s in sentences])
    batched = encode(model, tok, sentences, "avg_first_last", batch_size=4, show_progress=False)
    assert model.training
    assert batched.shape == (6, 32) and batched.dtype == torch.float32
    assert_roundoff(batched, one_by_one, terms=TINY_BERT_TERMS)  # the model's sums at other widths
    assert torch.equal(batched[1], batched[3])
    truncated = encode(model, tok, sentences, "mean", max_length=8, show_progress=False)
    assert not torch.allclose(truncated[4], encode(model, tok, sentences[4:5], "mean", show_progress=False)[0])
    enc = Encoder(model, tok, pooling="mean", batch_size=2, show_progress=False)
    assert enc.encode([]).shape == (0, 32)
    with pytest.raises(TypeError, match="not one string"):
        enc.encode("one sentence")
    with pytest.raises(ValueError, match="max_length"):
        encode(model, tok, ["x"], "mean", max_length=1)


def test_encode_matches_sentence_transformers_on_minilm():
    """Mean pooling through fastcl == sentence-transformers' own encode (the model's recipe)."""
    st = pytest.importorskip("sentence_transformers")
    from fastcl.eval.encode import Encoder

    path = minilm_path()
    sentences = ["A man is playing a guitar.", "Someone plays music on stage.", "The cat sleeps.", "A"]
    ours = Encoder.from_pretrained(path, pooling="mean", max_length=256, device="cpu", show_progress=False)
    ref = st.SentenceTransformer(str(path), device="cpu").encode(sentences, convert_to_tensor=True)
    got = torch.nn.functional.normalize(ours.encode(sentences), dim=-1)
    # unit vectors: the model's sums (MINILM_TERMS) in another order, of terms of size ~1 relative to the norm
    want = torch.nn.functional.normalize(ref.float(), dim=-1)
    assert_roundoff(got, want, terms=MINILM_TERMS, magnitude=1.0)


def test_from_pretrained_refuses_cls_with_an_untrained_pooler(tmp_path):
    from transformers import AutoTokenizer

    from fastcl.eval.encode import Encoder

    tiny_bert(pooler=False).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no trained pooler"):
        Encoder.from_pretrained(tmp_path, pooling="cls", device="cpu")
    assert Encoder.from_pretrained(tmp_path, pooling="cls_before_pooler", device="cpu").encode(["hi"]).shape == (1, 32)
