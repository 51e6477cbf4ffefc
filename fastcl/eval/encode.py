"""Encode sentences with any Hugging Face ``AutoModel``: batched, no grad, progress bar.

    enc = Encoder.from_pretrained("path/or/hub-id", pooling="mean")
    emb = enc.encode(["A man plays a guitar.", "Someone plays music."])   # (2, H) float32

or, with a model and tokenizer you already hold (e.g. inside a training loop, for a dev
evaluation; the model's train/eval mode is restored afterwards)::

    emb = encode(model, tokenizer, sentences, pooling="avg_first_last", max_length=32)

Sentences are de-duplicated and sorted by length before batching (less padding, same
result up to float rounding), then returned in the input order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from fastcl.pooling import check_pooling, needs_hidden_states, pool

# tokenizers with no known limit report model_max_length as a huge sentinel (1e30)
_NO_LIMIT = 1_000_000


def resolve_max_length(tokenizer, model, max_length: int | None) -> int:
    """``max_length`` if given, else the tokenizer's limit, else the model's positions."""
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2 (room for [CLS] and [SEP]), got {max_length!r}")
        return max_length
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < _NO_LIMIT:
        return limit
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        return positions
    raise ValueError("cannot infer max_length from the tokenizer or the model config; pass max_length")


def _check_sentences(sentences) -> list[str]:
    if isinstance(sentences, str):
        raise TypeError("sentences must be a sequence of strings, not one string")
    sentences = list(sentences)
    bad = [i for i, s in enumerate(sentences) if not isinstance(s, str)]
    if bad:
        raise TypeError(f"sentences must all be str; item {bad[0]} is {type(sentences[bad[0]]).__name__}")
    return sentences


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def encode(
    model,
    tokenizer,
    sentences: Sequence[str],
    pooling: str = "cls",
    batch_size: int = 64,
    max_length: int | None = None,
    device: str | torch.device | None = None,
    show_progress: bool = True,
    desc: str = "encode",
) -> Tensor:
    """Embed ``sentences`` with ``model`` and ``pooling``, without gradients.

    Args:
        model: a Hugging Face encoder (``AutoModel``); called as ``model(**batch)``.
        tokenizer: its tokenizer.
        sentences: N strings (duplicates are encoded once).
        pooling: one of :data:`fastcl.pooling.POOLINGS`.
        batch_size: sentences per forward pass.
        max_length: truncation length in tokens; None = the tokenizer's ``model_max_length``
            (or the model's ``max_position_embeddings`` when the tokenizer has no limit).
        device: where to run; None = where the model is. A different device moves the model.
        show_progress: tqdm bar over batches.

    Returns:
        ``(N, H)`` float32 CPU tensor, rows in the order of ``sentences``.
    """
    check_pooling(pooling)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    sentences = _check_sentences(sentences)
    max_length = resolve_max_length(tokenizer, model, max_length)
    if device is not None and torch.device(device) != _model_device(model):
        model.to(device)
    device = _model_device(model)

    unique = list(dict.fromkeys(sentences))
    # longest first: the largest batch runs first, so memory problems show at once
    order = sorted(range(len(unique)), key=lambda i: -len(unique[i]))
    hidden_states = needs_hidden_states(pooling)
    chunks: list[Tensor] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            starts = range(0, len(order), batch_size)
            for start in tqdm(starts, desc=desc, disable=not show_progress, unit="batch", leave=False):
                batch = [unique[i] for i in order[start : start + batch_size]]
                inputs = tokenizer(batch, padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(
                    device
                )
                kwargs = {"output_hidden_states": True} if hidden_states else {}
                outputs = model(**inputs, **kwargs, return_dict=True)
                chunks.append(pool(outputs, inputs["attention_mask"], pooling).float().cpu())
    finally:
        model.train(was_training)
    if not chunks:
        width = getattr(getattr(model, "config", None), "hidden_size", 0)
        return torch.empty(0, width)
    sorted_emb = torch.cat(chunks)
    unique_emb = torch.empty_like(sorted_emb)
    unique_emb[torch.tensor(order)] = sorted_emb
    index = {s: i for i, s in enumerate(unique)}
    return unique_emb[torch.tensor([index[s] for s in sentences], dtype=torch.long)]


class Encoder:
    """A model, its tokenizer and encoding settings, ready to embed sentences."""

    def __init__(
        self,
        model,
        tokenizer,
        pooling: str = "cls",
        batch_size: int = 64,
        max_length: int | None = None,
        device: str | torch.device | None = None,
        show_progress: bool = True,
    ):
        check_pooling(pooling)
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device
        self.show_progress = show_progress

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        pooling: str = "cls",
        batch_size: int = 64,
        max_length: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        show_progress: bool = True,
    ) -> Encoder:
        """Load ``AutoModel`` + ``AutoTokenizer`` from a local folder or hub id.

        ``device`` None = CUDA when available, else CPU. ``dtype`` None = as saved (float32
        for most checkpoints); bfloat16/float16 are for GPUs.
        """
        check_pooling(pooling)
        from transformers import AutoModel, AutoTokenizer

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        kwargs = {"dtype": dtype} if dtype is not None else {}
        model, info = AutoModel.from_pretrained(str(path), output_loading_info=True, **kwargs)
        missing_pooler = [k for k in info.get("missing_keys", []) if "pooler" in k]
        if pooling == "cls" and missing_pooler:
            # transformers would silently initialise the pooler at random
            raise ValueError(
                f"{path} has no trained pooler ({', '.join(sorted(missing_pooler))} missing), so "
                "pooling='cls' would use random weights; use 'cls_before_pooler' or another pooling"
            )
        model = model.to(device).eval()
        return cls(model, tokenizer, pooling, batch_size, max_length, device, show_progress)

    def encode(self, sentences: Sequence[str], desc: str = "encode") -> Tensor:
        """``(N, H)`` float32 CPU embeddings of ``sentences`` (see :func:`encode`)."""
        return encode(
            self.model,
            self.tokenizer,
            sentences,
            pooling=self.pooling,
            batch_size=self.batch_size,
            max_length=self.max_length,
            device=self.device,
            show_progress=self.show_progress,
            desc=desc,
        )

    def __repr__(self) -> str:
        name = getattr(getattr(self.model, "config", None), "_name_or_path", type(self.model).__name__)
        return f"Encoder({name!r}, pooling={self.pooling!r}, max_length={self.max_length})"
