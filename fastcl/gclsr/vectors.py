"""Frozen word vectors for GCLSR: word2vec/GloVe text files or an AutoModel's input embeddings.

    wv = WordVectors.from_text("glove.6B.300d.txt")               # or word2vec .txt(.gz)
    wv = WordVectors.from_automodel(path_to_minilm)                # offline, 384-d
    ids = wv.index(["A man plays a guitar."], max_words=64)      # list of id lists
    x, mask = wv.lookup(ids)                                      # [B, L, d] float32, [B, L] bool

Tokenisation follows the GCLSR recipe: lowercase, letters only (``[a-z]+``), at most
``max_words`` words. A word missing from the table gets a vector once and keeps it:

* text files: a random vector, seeded by the word itself (the same word always gets the
  same vector, whatever the order it is met in), uniform with the table's per-feature
  standard deviation, as GCLSR's "random vector per OOV word";
* AutoModel: the mean of the input embeddings of the word's sub-word pieces, so no word is
  out of vocabulary. (The model's contextual layers are not used: these are static vectors.)
"""

from __future__ import annotations

import gzip
import math
import os
import re
import zlib
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

_WORD = re.compile(r"[a-z]+")


def tokenize(sentence: str) -> list[str]:
    """GCLSR tokenisation: lowercase, runs of the letters a-z; everything else separates words."""
    if not isinstance(sentence, str):
        raise TypeError(f"sentence must be str, got {type(sentence).__name__}")
    return _WORD.findall(sentence.lower())


class WordVectors:
    """A growing table ``word -> row`` of a float32 matrix ``[V, d]`` (see module docstring).

    ``compose(word) -> Tensor[d] | None`` builds a vector for an unseen word; when it is
    ``None`` (or returns ``None``) the word gets a seeded random vector (``oov="random"``) or
    zeros (``oov="zero"``). Row 0 is reserved for padding and is all zeros.
    """

    PAD = 0

    def __init__(
        self,
        words: Sequence[str],
        vectors: Tensor,
        *,
        compose: Callable[[str], Tensor | None] | None = None,
        oov: str = "random",
        seed: int = 0,
    ):
        if not isinstance(vectors, Tensor) or vectors.dim() != 2:
            raise ValueError(f"vectors must be a [V, d] tensor, got {getattr(vectors, 'shape', type(vectors))}")
        if len(words) != vectors.shape[0]:
            raise ValueError(f"{len(words)} words but {vectors.shape[0]} vectors")
        if vectors.shape[1] < 1:
            raise ValueError("vectors must have at least one feature")
        if oov not in ("random", "zero"):
            raise ValueError(f"oov={oov!r}; expected 'random' or 'zero'")
        self.dim = int(vectors.shape[1])
        self.oov, self.seed, self._compose = oov, int(seed), compose
        self._rows: list[Tensor] = [torch.zeros(1, self.dim), vectors.detach().to("cpu", torch.float32)]
        self._matrix: Tensor | None = None
        self.vocab: dict[str, int] = {}
        first_rows = []
        for i, w in enumerate(words):  # duplicate words (e.g. casings after lowercasing): first row wins
            if w not in self.vocab:
                self.vocab[w] = len(self.vocab) + 1
                first_rows.append(i)
        if len(first_rows) != len(words):
            self._rows[1] = self._rows[1][torch.tensor(first_rows, dtype=torch.long)]
        std = self._rows[1].std(0) if len(first_rows) > 1 else torch.full((self.dim,), 0.1)
        # uniform(-a, a) has std a / sqrt(3): match the table's per-feature spread
        self._oov_scale = (std * math.sqrt(3.0)).clamp_min(1e-6)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_text(
        cls, path: str | os.PathLike, *, limit: int | None = None, lowercase: bool = True, **kw
    ) -> WordVectors:
        """Read a word2vec or GloVe *text* file (optionally ``.gz``): ``word v1 ... vd`` per
        line; word2vec's ``V d`` header line is recognised and skipped. ``limit`` keeps the
        first ``limit`` words (files are frequency-sorted). With ``lowercase`` the first
        (most frequent) casing of each word wins, matching the lowercase tokeniser."""
        opener = gzip.open if str(path).endswith(".gz") else open
        words: list[str] = []
        rows: list[list[float]] = []
        dim = None
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f):
                parts = line.rstrip().split(" ")
                if lineno == 0 and len(parts) == 2 and all(p.isdigit() for p in parts):
                    continue  # word2vec header "V d"
                if len(parts) < 2:
                    continue
                if dim is None:
                    dim = len(parts) - 1
                if len(parts) - 1 != dim:
                    raise ValueError(f"{path}:{lineno + 1}: {len(parts) - 1} values, expected {dim}")
                words.append(parts[0].lower() if lowercase else parts[0])
                rows.append([float(v) for v in parts[1:]])
                if limit is not None and len(words) >= limit:
                    break
        if not words:
            raise ValueError(f"no vectors found in {path}")
        return cls(words, torch.tensor(rows, dtype=torch.float32), **kw)

    @classmethod
    def from_automodel(cls, model, tokenizer=None, **kw) -> WordVectors:
        """Static word vectors from a Hugging Face model's input-embedding matrix.

        ``model`` is a path / hub id (loaded with ``AutoModel``; offline works for local
        paths) or a loaded model, in which case pass its ``tokenizer``. A word's vector is
        the mean of the embeddings of its sub-word pieces (``add_special_tokens=False``).
        """
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModel, AutoTokenizer

            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = AutoModel.from_pretrained(model)
        if tokenizer is None:
            raise TypeError("pass the tokenizer together with a loaded model")
        table = model.get_input_embeddings().weight.detach().to("cpu", torch.float32)

        def compose(word: str) -> Tensor | None:
            ids = tokenizer(word, add_special_tokens=False)["input_ids"]
            return table[ids].mean(0) if ids else None

        # the table's spread (for the rare word with no pieces) comes from the whole matrix
        wv = cls([], torch.empty(0, table.shape[1]), compose=compose, **kw)
        wv._oov_scale = (table.std(0) * math.sqrt(3.0)).clamp_min(1e-6)
        return wv

    # ------------------------------------------------------------------ lookup

    def __len__(self) -> int:
        return len(self.vocab)

    def _random_vector(self, word: str) -> Tensor:
        g = torch.Generator().manual_seed((zlib.crc32(word.encode("utf-8")) + 7919 * self.seed) % (2**63))
        return (torch.rand(self.dim, generator=g) * 2 - 1) * self._oov_scale

    def _add(self, word: str) -> int:
        vec = self._compose(word) if self._compose is not None else None
        if vec is None:
            vec = self._random_vector(word) if self.oov == "random" else torch.zeros(self.dim)
        self._rows.append(vec.reshape(1, self.dim).to(torch.float32))
        self._matrix = None
        self.vocab[word] = len(self.vocab) + 1
        return self.vocab[word]

    def word_ids(self, words: Iterable[str]) -> list[int]:
        """Row ids of ``words``; unseen words are added (see class docstring)."""
        return [self.vocab.get(w) or self._add(w) for w in words]

    def index(self, sentences: Sequence[str], max_words: int = 64) -> list[list[int]]:
        """Tokenise and map each sentence to at most ``max_words`` row ids (maybe empty)."""
        if isinstance(sentences, str):
            raise TypeError("sentences must be a sequence of strings, not one string")
        if isinstance(max_words, bool) or not isinstance(max_words, int) or max_words < 1:
            raise ValueError(f"max_words must be a positive int, got {max_words!r}")
        return [self.word_ids(tokenize(s)[:max_words]) for s in sentences]

    @property
    def matrix(self) -> Tensor:
        """``[1 + V, d]`` float32; row 0 is padding (zeros)."""
        if self._matrix is None:
            self._matrix = torch.cat(self._rows)
            self._rows = [self._matrix]
        return self._matrix

    def lookup(self, ids: Sequence[Sequence[int]], min_length: int = 1) -> tuple[Tensor, Tensor]:
        """Pad id lists to ``L = max(longest, min_length)``: returns ``x [B, L, d]`` float32
        (zeros at padding) and ``mask [B, L]`` bool (``True`` = real word)."""
        L = max([len(s) for s in ids] + [min_length, 1])
        padded = torch.zeros(len(ids), L, dtype=torch.long)
        for i, s in enumerate(ids):
            padded[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        return self.matrix[padded], padded != self.PAD

    def embed(self, sentences: Sequence[str], max_words: int = 64, min_length: int = 1) -> tuple[Tensor, Tensor]:
        """``lookup(index(sentences, max_words), min_length)``."""
        return self.lookup(self.index(sentences, max_words), min_length)

    def average(self, sentences: Sequence[str], max_words: int = 64) -> Tensor:
        """The averaged word-vector baseline: masked mean of each sentence's vectors ``[B, d]``
        (zeros for a sentence with no words)."""
        x, mask = self.embed(sentences, max_words)
        m = mask.unsqueeze(-1).to(x.dtype)
        return (x * m).sum(1) / m.sum(1).clamp_min(1.0)
