"""Sentence encoders over word vectors, with the ``encode(sentences, desc=...)`` interface
that :func:`fastcl.eval.sts.evaluate_sts` expects.

``GCLSREncoder`` embeds with the trained TextCNN backbone (no attention, no augmentation);
``AveragedWordVectors`` is the averaged word-vector baseline GCLSR compares against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from fastcl.gclsr.model import GCLSRModel
from fastcl.gclsr.vectors import WordVectors


def _sentences(sentences) -> list[str]:
    if isinstance(sentences, str):
        raise TypeError("sentences must be a sequence of strings, not one string")
    sentences = list(sentences)
    if any(not isinstance(s, str) for s in sentences):
        raise TypeError("sentences must all be str")
    return sentences


class GCLSREncoder:
    """``encode(sentences) -> [N, backbone.out_dim]`` float32 CPU tensor, in input order.

    Sentences are sorted by word count before batching (less padding); the TextCNN's
    max over time ignores padding windows, so the result does not depend on batching.
    The model's train/eval mode is restored afterwards.
    """

    def __init__(
        self,
        model: GCLSRModel,
        vectors: WordVectors,
        *,
        max_words: int = 64,
        batch_size: int = 256,
        progress: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.vectors = model, vectors
        self.max_words, self.batch_size, self.progress = max_words, batch_size, progress

    @torch.no_grad()
    def encode(self, sentences: Sequence[str], desc: str = "encode") -> Tensor:
        sentences = _sentences(sentences)
        ids = self.vectors.index(sentences, self.max_words)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        device = next(self.model.parameters()).device
        out = torch.empty(len(ids), self.model.backbone.out_dim)
        was_training = self.model.training
        self.model.eval()
        try:
            starts = range(0, len(order), self.batch_size)
            for s in tqdm(starts, desc=desc, disable=not self.progress, leave=False):
                rows = order[s : s + self.batch_size]
                x, mask = self.vectors.lookup([ids[i] for i in rows])
                out[rows] = self.model.encode(x.to(device), mask.to(device)).float().cpu()
        finally:
            self.model.train(was_training)
        return out


class AveragedWordVectors:
    """The baseline: the mean of a sentence's word vectors (same tokenisation and table)."""

    def __init__(self, vectors: WordVectors, *, max_words: int = 64, batch_size: int = 1024):
        self.vectors, self.max_words, self.batch_size = vectors, max_words, batch_size

    def encode(self, sentences: Sequence[str], desc: str = "encode") -> Tensor:
        sentences = _sentences(sentences)
        parts = [
            self.vectors.average(sentences[s : s + self.batch_size], self.max_words)
            for s in range(0, len(sentences), self.batch_size)
        ]
        return torch.cat(parts) if parts else torch.empty(0, self.vectors.dim)
