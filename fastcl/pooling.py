"""Sentence pooling over Hugging Face encoder outputs, shared by evaluation and training.

``pool(outputs, attention_mask, method)`` turns a transformer's token states into one
vector per sentence. It is differentiable (trainers call it with grad enabled) and does no
host synchronisation. The methods follow SimCSE's evaluation code:

=====================  =====================================================================
``cls``                ``outputs.pooler_output``: the model's own pooler (BERT: Linear + tanh
                       on [CLS]). SimCSE stores its trained MLP there; models without a
                       pooler raise. Trainers that own a separate MLP use ``cls_before_pooler``
                       and apply their head themselves.
``cls_before_pooler``  ``last_hidden_state[:, 0]``: the raw [CLS] state.
``mean``               masked mean of ``last_hidden_state`` (sentence-transformers' "mean").
``mean_no_cls``        masked mean of ``last_hidden_state`` over the real tokens *except* the
                       first one of each row ([CLS]): Liao et al.'s pooling (their released
                       code drops [CLS] but divides by the padded length; this is the proper
                       masked mean). With left padding the first *real* token is dropped.
``avg_first_last``     masked mean of ``(hidden_states[1] + hidden_states[-1]) / 2``, where
                       ``hidden_states[1]`` is the *first transformer layer* (index 0 is the
                       embedding layer; SimCSE fixed this in 2022, SupMPN uses it).
``avg_top2``           masked mean of ``(hidden_states[-2] + hidden_states[-1]) / 2``.
=====================  =====================================================================

The last two need the model called with ``output_hidden_states=True`` (see
:func:`needs_hidden_states`). Masked means are reduced in float32 (float64 stays float64)
and returned in the states' dtype; a row whose mask is all zero pools to the zero vector.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from .ops.contract import compute_dtype

POOLINGS = ("cls", "cls_before_pooler", "mean", "mean_no_cls", "avg_first_last", "avg_top2")
_LAYER_POOLINGS = ("avg_first_last", "avg_top2")


def check_pooling(method: str) -> None:
    """Raise ``ValueError`` unless ``method`` is one of :data:`POOLINGS`."""
    if method not in POOLINGS:
        raise ValueError(f"pooling={method!r}; expected one of {POOLINGS}")


def needs_hidden_states(method: str) -> bool:
    """Whether ``method`` needs the model called with ``output_hidden_states=True``."""
    check_pooling(method)
    return method in _LAYER_POOLINGS


def _field(outputs: Any, name: str):
    if isinstance(outputs, Mapping):  # ModelOutput is a Mapping too, but skips None fields
        return outputs.get(name)
    return getattr(outputs, name, None)


def _masked_mean_acc(states: Tensor, attention_mask: Tensor) -> Tensor:
    mask = attention_mask.to(states.dtype).unsqueeze(-1)
    return (states * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)


def masked_mean(states: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean over the tokens where ``attention_mask`` is non-zero.

    states: ``(B, T, H)`` float; attention_mask: ``(B, T)`` of 0/1 (any int, bool or float
    dtype). Returns ``(B, H)`` in ``states.dtype``, reduced in float32 (float64 stays
    float64); all-zero mask rows give zeros.
    """
    acc = compute_dtype(states.dtype)
    return _masked_mean_acc(states.to(acc), attention_mask).to(states.dtype)


def without_first_token(attention_mask: Tensor) -> Tensor:
    """``attention_mask`` with each row's first real token (the [CLS]) set to 0, same dtype.
    Works for right and left padding; a row with one real token becomes all zero."""
    real = attention_mask != 0
    first = real & (real.cumsum(dim=1) == 1)
    return attention_mask.masked_fill(first, 0)


def pool(outputs: Any, attention_mask: Tensor, method: str = "cls") -> Tensor:
    """One embedding per sentence from encoder ``outputs``.

    Args:
        outputs: what a Hugging Face ``AutoModel`` returns (``BaseModelOutput...``) or a
            dict with ``last_hidden_state`` ``(B, T, H)``, optionally ``pooler_output``
            ``(B, H)`` and ``hidden_states`` (tuple of ``(B, T, H)``, embeddings first).
        attention_mask: ``(B, T)``, 1 for real tokens, 0 for padding.
        method: one of :data:`POOLINGS` (see the module docstring).

    Returns:
        ``(B, H)`` tensor in the model's dtype, on its device, with autograd intact.
    """
    check_pooling(method)
    last = _field(outputs, "last_hidden_state")
    if not isinstance(last, Tensor) or last.dim() != 3:
        raise ValueError("outputs must carry last_hidden_state of shape (B, T, H)")
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != tuple(last.shape[:2]):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but last_hidden_state "
            f"is {tuple(last.shape)}; expected (B, T) = {tuple(last.shape[:2])}"
        )
    if method == "cls":
        pooled = _field(outputs, "pooler_output")
        if pooled is None:
            raise ValueError(
                "pooling='cls' uses the model's pooler_output, which this model does not return; "
                "use 'cls_before_pooler' for the raw [CLS] state"
            )
        return pooled
    if method == "cls_before_pooler":
        return last[:, 0]
    if method == "mean":
        return masked_mean(last, attention_mask)
    if method == "mean_no_cls":
        return masked_mean(last, without_first_token(attention_mask))
    hidden = _field(outputs, "hidden_states")
    layers_needed = 2 if method == "avg_first_last" else 3  # embeddings + transformer layers
    if hidden is None or len(hidden) < layers_needed:
        raise ValueError(
            f"pooling={method!r} needs hidden_states (embeddings + {layers_needed - 1} transformer "
            "layer(s)): call the model with output_hidden_states=True"
        )
    first, second = (hidden[1], hidden[-1]) if method == "avg_first_last" else (hidden[-2], hidden[-1])
    # mean((a + b) / 2) == (mean(a) + mean(b)) / 2: average the layers first, one reduction.
    acc = compute_dtype(second.dtype)
    both = (first.to(acc) + second.to(acc)) / 2
    return _masked_mean_acc(both, attention_mask).to(second.dtype)
