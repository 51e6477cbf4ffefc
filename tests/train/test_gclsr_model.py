"""GCLSR network pieces: word-importance attention, TextCNN, projector/predictor, encoders."""

from __future__ import annotations

import math

import pytest
import torch

from fastcl.gclsr import AveragedWordVectors, GCLSREncoder, GCLSRModel, TextCNN, WordVectors, word_importance
from fastcl.gclsr.model import PADDING_SCORE
from fastcl.testing import assert_roundoff


def _batch(B=3, L=7, d=5, lengths=(7, 3, 0), dtype=torch.float64):
    x = torch.randn(B, L, d, dtype=dtype)
    mask = torch.arange(L).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return x * mask.unsqueeze(-1), mask


def _attention_loop(x, mask):
    """Entry by entry, as the paper describes it."""
    B, L, d = x.shape
    out = torch.empty_like(x)
    for b in range(B):
        for i in range(L):
            s = 0.0
            for j in range(L):
                s += float(x[b, i] @ x[b, j]) / math.sqrt(d) if mask[b, i] and mask[b, j] else PADDING_SCORE
            out[b, i] = s * x[b, i]
    return out


def _assert_attention_close(got, want, x, msg: str | None = None) -> None:
    """Word-importance outputs in two orders: a word's score sums its L x d products
    x_ik x_jk / sqrt(d) (which may cancel), then scales x_i."""
    L, d = x.shape[1:]
    size = x.abs().max().item()
    assert_roundoff(got, want, torch.float64, terms=L * d, magnitude=size**3 / math.sqrt(d), msg=msg)


def test_attention_matches_loop_and_shapes():
    x, mask = _batch(lengths=(7, 3, 0))
    out = word_importance(x, mask)
    assert out.shape == x.shape and out.dtype == x.dtype
    _assert_attention_close(out, _attention_loop(x, mask), x)


def test_attention_padding_is_masked():
    x, mask = _batch(lengths=(7, 3, 1))
    out = word_importance(x, mask)
    # garbage in the padding slots changes nothing for the real words
    noisy = x + torch.randn_like(x) * (~mask).unsqueeze(-1)
    out_noisy = word_importance(noisy, mask)
    _assert_attention_close(out_noisy[mask], out[mask], x)
    # a padding row's score is L * 1e-9 (every entry of its row is the fill value)
    L = x.shape[1]
    want = noisy[~mask] * (L * PADDING_SCORE)
    assert_roundoff(out_noisy[~mask], want, torch.float64, terms=L)  # L fill values summed, not multiplied


def test_attention_rejects_bad_mask():
    x, mask = _batch()
    with pytest.raises(ValueError):
        word_importance(x, mask.long())
    with pytest.raises(ValueError):
        word_importance(x, mask[:, :3])


def test_textcnn_matches_manual_conv():
    torch.manual_seed(0)
    cnn = TextCNN(4, region_sizes=(1, 2, 5), filters=3).double()
    x, mask = _batch(B=1, L=6, d=4, lengths=(6,))
    out = cnn(x, mask)
    assert out.shape == (1, 9)
    expect = []
    for k, conv in zip(cnn.region_sizes, cnn.convs):
        w, b = conv.weight, conv.bias  # [F, d, k]
        windows = [torch.relu((w * x[0, t : t + k].T).sum((1, 2)) + b) for t in range(6 - k + 1)]
        expect.append(torch.stack(windows).amax(0))
    # a window's k x d products (k <= 5, d = 4) plus the bias, of the size of the largest |w x|
    size = max((c.weight.abs().amax() * x.abs().max()).item() for c in cnn.convs)
    assert_roundoff(out[0], torch.cat(expect), torch.float64, terms=5 * 4 + 1, magnitude=size)


def test_textcnn_ignores_padding_amount():
    """A sentence's embedding is the same alone, in a batch with longer sentences, and
    when shorter than the largest region (padded up to it)."""
    torch.manual_seed(0)
    cnn = TextCNN(6, region_sizes=(1, 1, 3, 8), filters=4).double()
    x, mask = _batch(B=3, L=12, d=6, lengths=(12, 5, 2))
    together = cnn(x, mask)
    for i, n in enumerate((12, 5, 2)):
        alone = cnn(x[i : i + 1, :n], mask[i : i + 1, :n])
        torch.testing.assert_close(together[i : i + 1], alone)


def test_heads_shapes_and_layers():
    model = GCLSRModel(8, region_sizes=(1, 2), filters=5, proj_dim=32, pred_hidden=8)
    kinds = [type(m).__name__ for m in model.projector]
    assert kinds == ["Linear", "BatchNorm1d", "ReLU", "Linear", "BatchNorm1d", "ReLU", "Linear", "BatchNorm1d"]
    assert [type(m).__name__ for m in model.predictor] == ["Linear", "BatchNorm1d", "ReLU", "Linear"]
    x, mask = _batch(B=4, L=6, d=8, lengths=(6, 4, 2, 1), dtype=torch.float32)
    h1, z1, h2, z2 = model(x, x.clone(), mask)
    assert h1.shape == z1.shape == (4, 32)
    assert model.encode(x, mask).shape == (4, 10)


def test_default_architecture_is_the_papers():
    model = GCLSRModel(300)
    assert model.backbone.region_sizes == (1, 1, 1, 6, 15, 20)
    assert all(c.out_channels == 300 for c in model.backbone.convs)
    assert model.backbone.out_dim == 1800
    assert model.projector[0].in_features == 1800 and model.projector[-2].out_features == 4096
    assert model.predictor[0].out_features == 1024 and model.predictor[-1].out_features == 4096


def _toy_vectors():
    words = ["a", "man", "plays", "guitar", "someone", "music", "the", "cat"]
    return WordVectors(words, torch.randn(len(words), 6))


def test_encoder_order_and_batching():
    torch.manual_seed(0)
    wv = _toy_vectors()
    model = GCLSRModel(6, region_sizes=(1, 3), filters=4, proj_dim=16, pred_hidden=4).train()
    sents = ["A man plays a guitar.", "the cat", "", "Someone plays music, the man plays!", "cat"]
    big = GCLSREncoder(model, wv, batch_size=8, progress=False).encode(sents)
    small = GCLSREncoder(model, wv, batch_size=2, progress=False).encode(sents)
    torch.testing.assert_close(big, small)
    x, mask = wv.embed(sents[3:4])
    torch.testing.assert_close(big[3:4], model.eval().encode(x, mask))
    assert model.training is False  # we switched it; the encoder restored what it found
    model.train()
    GCLSREncoder(model, wv, progress=False).encode(sents)
    assert model.training


def test_averaged_baseline():
    wv = _toy_vectors()
    emb = AveragedWordVectors(wv, batch_size=2).encode(["the cat", "A MAN", "!!"])
    m = wv.matrix
    torch.testing.assert_close(emb[0], (m[wv.vocab["the"]] + m[wv.vocab["cat"]]) / 2)
    torch.testing.assert_close(emb[1], (m[wv.vocab["a"]] + m[wv.vocab["man"]]) / 2)
    assert torch.equal(emb[2], torch.zeros(6))
    with pytest.raises(TypeError):
        AveragedWordVectors(wv).encode("one string")
