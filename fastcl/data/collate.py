"""Collators: one tokenizer call per batch, plus the masks and indices the losses take.

Every collator puts all texts of a batch into one ``inputs`` dict (``input_ids``,
``attention_mask``, ...: ``[n, T]``), so the trainer runs the encoder once per step (or
once per chunk with gradient caching) and splits the ``[n, d]`` embeddings with the
layout fields. Padded (masked) slots are never tokenised or encoded.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from fastcl.data.nli import LABELS
from fastcl.data.recipes import liao_in_batch

LABEL_IDS = {name: i for i, name in enumerate(LABELS)}  # entailment 0, neutral 1, contradiction 2


def tokenize(tokenizer, texts: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
    """``tokenizer(texts)`` padded to the longest, truncated to ``max_length``: ``[n, T]`` tensors."""
    if not texts:
        raise ValueError("nothing to tokenize: the batch has no texts")
    return dict(tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"))


def collate_views(
    sentences: Sequence[str], tokenizer, max_length: int, views: int = 2, augment: Callable[[str], str] | None = None
) -> dict:
    """SimCSE-unsup / EdaCSE: ``views`` copies of the B sentences (dropout makes them differ),
    plus, with ``augment``, one augmented copy each. ``inputs`` rows: view 0 (B), view 1
    (B), ..., augmented (B)."""
    texts = list(sentences) * views
    if augment is not None:
        texts += [augment(s) for s in sentences]
    return {"inputs": tokenize(tokenizer, texts, max_length), "batch_size": len(sentences)}


def collate_triplets(examples: Sequence[dict], tokenizer, max_length: int) -> dict:
    """SimCSE-sup: ``inputs`` rows = anchors (B), positives (B), hard negatives (B)."""
    texts = [e["anchor"] for e in examples] + [e["positive"] for e in examples] + [e["negative"] for e in examples]
    return {"inputs": tokenize(tokenizer, texts, max_length), "batch_size": len(examples)}


def collate_groups(examples: Sequence[dict], tokenizer, max_length: int) -> dict:
    """SupMPN: ``inputs`` rows = anchors (B), then the *valid* positives row-major, then the
    valid negatives row-major; ``pos_mask [B, P]`` / ``neg_mask [B, Q]`` bool say where they go,
    and ``n_pos`` / ``n_neg`` (host ints) how many there are, so that the step never reads a
    device mask back to size its rows."""
    pos_mask = torch.tensor([e["pos_mask"] for e in examples], dtype=torch.bool)
    neg_mask = torch.tensor([e["neg_mask"] for e in examples], dtype=torch.bool)
    texts = [e["anchor"] for e in examples]
    texts += [t for e in examples for t, ok in zip(e["positives"], e["pos_mask"]) if ok]
    texts += [t for e in examples for t, ok in zip(e["negatives"], e["neg_mask"]) if ok]
    return {
        "inputs": tokenize(tokenizer, texts, max_length),
        "batch_size": len(examples),
        "pos_mask": pos_mask,
        "neg_mask": neg_mask,
        "n_pos": int(pos_mask.sum()),
        "n_neg": int(neg_mask.sum()),
    }


def _pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    index = torch.zeros(len(rows), max(width, 1), dtype=torch.long)
    mask = torch.zeros(len(rows), max(width, 1), dtype=torch.bool)
    for i, r in enumerate(rows):
        index[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = True
    return index, mask


def collate_liao(rows: Sequence[dict], tokenizer, max_length: int, cap: str, rng: random.Random) -> dict:
    """Liao: ``inputs`` rows = premises (B) then hypotheses (B); ``labels [B]`` (entailment 0,
    neutral 1, contradiction 2) for the CE head; anchors = premises of the entailment rows
    (``anchor_rows [A]``), candidates = the B hypotheses, ``pos_index/pos_mask [A, P]``,
    ``neg_index/neg_mask [A, Q]`` (see :func:`fastcl.data.recipes.liao_in_batch`)."""
    built = liao_in_batch(rows, cap, rng)
    texts = [r["premise"] for r in rows] + [r["hypothesis"] for r in rows]
    pos_index, pos_mask = _pad(built["pos_index"])
    neg_index, neg_mask = _pad(built["neg_index"])
    return {
        "inputs": tokenize(tokenizer, texts, max_length),
        "batch_size": len(rows),
        "labels": torch.tensor([LABEL_IDS[r["label"]] for r in rows], dtype=torch.long),
        "anchor_rows": torch.tensor(built["anchor_rows"], dtype=torch.long),
        "pos_index": pos_index,
        "pos_mask": pos_mask,
        "neg_index": neg_index,
        "neg_mask": neg_mask,
    }
