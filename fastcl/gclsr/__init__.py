"""GCLSR (Wang et al. 2023): a TextCNN over frozen word vectors, trained SimSiam-style with
the grouped cosine loss (:func:`fastcl.losses.gclsr_loss`) on two PWVA views.

    wv = WordVectors.from_automodel(path)                 # or WordVectors.from_text(glove)
    model = GCLSRModel(wv.dim)
    x, mask = wv.embed(sentences, max_words=64)
    loss = two_view_loss(model, x, mask, PWVA(p=0.5, seed=0))
    emb = GCLSREncoder(model, wv).encode(sentences)        # backbone output [N, 1800]

Training with the shared loop: ``python -m fastcl train gclsr`` (see docs/gclsr.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastcl.gclsr.augment import PWVA
from fastcl.gclsr.encode import AveragedWordVectors, GCLSREncoder
from fastcl.gclsr.model import GCLSRModel, TextCNN, predictor, projector, word_importance
from fastcl.gclsr.vectors import WordVectors, tokenize
from fastcl.losses import gclsr_loss


def two_view_loss(
    model: GCLSRModel,
    x: Tensor,
    mask: Tensor,
    pwva: PWVA,
    *,
    group_size: int = 16,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One GCLSR training loss: two independent PWVA views of ``x [B, L, d]`` (``mask
    [B, L]``), the model's ``(h1, z1, h2, z2)`` and the symmetric grouped cosine loss with
    stop-gradient on ``z`` (a scalar in ``[-1, 1]``)."""
    x1, x2 = pwva(x, mask, generator), pwva(x, mask, generator)
    h1, z1, h2, z2 = model(x1, x2, mask)
    return gclsr_loss(h1, z1, h2, z2, group_size=group_size)


__all__ = [
    "PWVA",
    "AveragedWordVectors",
    "GCLSREncoder",
    "GCLSRModel",
    "TextCNN",
    "WordVectors",
    "predictor",
    "projector",
    "tokenize",
    "two_view_loss",
    "word_importance",
]
