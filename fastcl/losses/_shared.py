"""What every loss of :mod:`fastcl.losses` shares: option checks, the layout of the structured
losses, the one distributed scaling rule, and the base of the loss modules (the argument docs,
re-exported here: ``_docs``).

Each family module (``supmpn``, ``supcon``, ``mnrl``, ``infonce``, ``clip``, ``gist``, ...)
imports from here, so a reader follows any loss through two files: its family's, which lays
out the call (:func:`structured_call`: a :class:`FusedCall` with its ``LossSpec``, built once
by :meth:`Options.spec`), and this one's :func:`fused_loss`, which runs it; then
``fastcl.ops.contrastive`` (the autograd Function) and the backend (docs/design.md).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .. import _checks, distributed
from .. import matryoshka as _matryoshka
from ..ops.constants import constant
from ..ops.contract import EPS, OwnPositives, compute_dtype, empty_block, structured_tags
from ..ops.contrastive import ContrastiveLSE, LossSpec, ready
from ..ops.head import reduction_weights
from ..ops.ring import ring_contrastive_loss
from ._docs import ARG_DOCS, LSE_OPTIONS, document

# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Options:
    """The keyword arguments every LSE loss takes and passes on unchanged (see :data:`ARG_DOCS`)."""

    temperature: float | Tensor = 0.05
    reduction: str = "mean"
    backend: str = "auto"
    strategy: str = "auto"
    process_group: Any = None
    similarity: str = "cos"
    matryoshka_dims: Any = None
    matryoshka_weights: Any = None
    cross_device: str = "gather"

    def kwargs(self) -> dict[str, Any]:
        """As keyword arguments of a public loss function."""
        return {name: getattr(self, name) for name in LSE_OPTIONS}

    def spec(self, kind: str, tags: tuple[Tensor, Tensor], anchor: Tensor, matryoshka=None, **fields) -> LossSpec:
        """The call's description (``fastcl.ops.contrastive.LossSpec``) with these options: the
        one place they become the primitive's settings. ``matryoshka``: the checked
        ``(dims, weights)`` (``fastcl.matryoshka.check``) or None; ``fields``: the rest."""
        return LossSpec(
            kind, tags, self.reduction, cosine=self.similarity == "cos", eps=EPS,
            dims=None if matryoshka is None else matryoshka[0], dim_weights=_matryoshka.weight_tensor(matryoshka, anchor),
            strategy=self.strategy, backend=self.backend, **fields,
        )  # fmt: skip


CROSS_DEVICE = ("gather", "ring")


def check_options(reduction: str, similarity: str, strategy: str, cross_device: str = "gather") -> None:
    """The choices every LSE loss checks on every call, with or without grad."""
    _checks.check_choice("reduction", reduction, _checks.REDUCTIONS)
    _checks.check_choice("similarity", similarity, _checks.SIMILARITIES)
    _checks.check_choice("strategy", strategy, _checks.STRATEGIES)
    _checks.check_choice("cross_device", cross_device, CROSS_DEVICE)


def uses_ring(opts: Options) -> bool:
    """A process group whose candidates go round the ring (``cross_device="ring"``)."""
    return opts.process_group is not None and opts.cross_device == "ring"


def no_autocast(t: Tensor) -> AbstractContextManager[Any]:
    """Autocast off on ``t``'s device: the fused ops choose their own precision (float32
    accumulation), and autocast must not re-cast the matrix products inside them."""
    if torch.is_autocast_enabled(t.device.type):
        return torch.autocast(device_type=t.device.type, enabled=False)
    return nullcontext()


def check_matrix(name: str, t: Tensor, layout: str = "[B, d]") -> tuple[int, int]:
    """The shape of ``t``, checked to be a non-empty matrix."""
    _checks.check_rank(name, t, 2, layout)
    if 0 in t.shape:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(t.shape)}")
    return t.shape[0], t.shape[1]


def check_slots(name: str, t: Tensor, slot: str, B: int, d: int) -> int:
    """The slot count of ``t``, checked to be ``[B, slots, d]``."""
    _checks.check_rank(name, t, 3, f"[B, {slot}, d]")
    if t.shape[0] != B or t.shape[2] != d:
        raise ValueError(f"{name} must have shape [B={B}, {slot}, d={d}], got {tuple(t.shape)}")
    return t.shape[1]


def check_positives(anchor: Tensor, pos_mask: Tensor | None, process_group, temperature) -> Tensor:
    """Some anchor has a valid positive (with a group the check is global, in the gather: a rank
    may have none); returns the temperature as a 0-d tensor in the compute dtype."""
    if process_group is None:
        _checks.check_some_positive(pos_mask)
    else:
        distributed.check_group(process_group)
    return _checks.as_temperature(temperature, anchor)


def without_unused_anchors(anchor: Tensor, pos_mask: Tensor | None) -> Tensor:
    """``anchor`` with the rows of anchors that have no valid positive read as zeros: like a
    padded slot, whatever they hold (NaN, Inf) reaches no value and no gradient (docs/losses.md)."""
    if pos_mask is None:
        return anchor
    return torch.where(pos_mask.any(1, keepdim=True), anchor, anchor.new_zeros(()))


# --------------------------------------------------------------------------- scaling rule


def row_weights(
    has_pos: Tensor,
    reduction: str,
    dtype: torch.dtype,
    *,
    world: int = 1,
    valid_anchors: Tensor | None = None,
    maybe_empty: bool = True,
) -> Tensor:
    """``[B]`` weight of each anchor's loss row in the reduced loss: fastcl's one scaling rule.

    One process: 0 for an anchor without a valid positive, else 1 (``sum``) or ``1 / n``
    (``mean``, ``n`` anchors with a valid positive). With a process group of ``world`` ranks
    each rank returns ``L_r = world * sum_i w_i loss_i`` with ``mean``'s ``n`` counted over
    every rank (``valid_anchors``): then ``mean_r L_r`` is the loss of the concatenated global
    batch, and DDP, which averages the ranks' gradients, gives exactly its gradient.
    ``"none"`` rows are never scaled.
    """
    w = reduction_weights(has_pos, reduction, dtype, denominator=valid_anchors, maybe_empty=maybe_empty)
    return w * world if world > 1 and reduction != "none" else w


# --------------------------------------------------------------------------- the fused call


def _every_row(anchor: Tensor) -> Tensor:
    """``[B]`` all True: every anchor has a positive (no ``pos_mask``), made once per size."""
    B, dev = anchor.shape[0], anchor.device
    return constant(("every_row", B, str(dev)), lambda: torch.ones(B, dtype=torch.bool, device=dev))


class FusedCall(NamedTuple):
    """A fused loss call as a loss lays it out, before any gather: this rank's ``anchor [B, d]``,
    candidate ``blocks``, ``tau`` (0-d, compute dtype), the call's description ``spec``
    (:meth:`Options.spec`: this rank's tags, own positives in block 0 from its first row), the
    named ``sizes`` every rank must share, and the shared positives' differentiable
    ``pos_logits`` (None: own positives, folded from block 0)."""

    anchor: Tensor
    blocks: tuple[Tensor, Tensor]
    tau: Tensor
    spec: LossSpec
    sizes: dict[str, int]
    pos_logits: Tensor | None = None


def fused_loss(call: FusedCall, opts: Options) -> Tensor:
    """Run ``call``: gather the candidate set (this rank's, or every rank's:
    ``fastcl.distributed``), weigh the rows by :func:`row_weights` (from ``spec.pos_mask``)
    and run ``ContrastiveLSE``; or, with ``cross_device="ring"``, run it over the ring
    (``fastcl.ops.ring``: the same weights, from the global count). With a process group the
    candidates may hold padding (``padded``)."""
    anchor, blocks, tau, spec, sizes, pos_logits = call
    cd = compute_dtype(anchor.dtype)
    masked = spec.pos_mask is not None
    has_pos = _every_row(anchor) if spec.pos_mask is None else spec.pos_mask.any(1)
    if opts.process_group is not None:
        spec = replace(spec, padded=True)  # other ranks' candidates may carry padding
    with no_autocast(anchor):
        if uses_ring(opts):
            return ring_contrastive_loss(
                anchor, blocks, tau, spec, pos_logits, group=opts.process_group, has_pos=has_pos,
                check_positive=masked, sizes=sizes,
            )  # fmt: skip
        if opts.process_group is None and not masked:  # the same every step: made once
            key = ("row_weights", anchor.shape[0], opts.reduction, cd, str(anchor.device))
            weights = constant(key, lambda: row_weights(has_pos, opts.reduction, cd, maybe_empty=False))
            spec = replace(spec, weights=weights)
        elif opts.process_group is None:
            spec = replace(spec, weights=row_weights(has_pos, opts.reduction, cd))
        else:
            g = distributed.gather_candidates(
                blocks, spec.tags, has_pos, sizes=sizes, check_positive=masked, group=opts.process_group
            )
            pos = spec.positives
            own = None if pos is None else OwnPositives(g.offset + pos.offset, pos.count)
            weights = row_weights(has_pos, opts.reduction, cd, world=g.world, valid_anchors=g.valid_anchors.to(cd))
            blocks, spec = g.blocks, replace(spec, tags=g.tags, positives=own, weights=weights)
        anchor, (b0, b1), spec = ready(anchor, blocks, spec)
        return ContrastiveLSE.apply(anchor, b0, b1, pos_logits, tau, spec)


def structured_call(
    head: str,
    anchor: Tensor,
    positives: Tensor,
    negatives: Tensor | None,
    pos_mask: Tensor | None,
    neg_mask: Tensor | None,
    opts: Options,
    *,
    exclude_own: bool,
    zero_logit_own: bool = False,
    false_negative_margin: float | None = None,
) -> FusedCall:
    """The call (:func:`fused_loss` runs it) of SupMPN, SupCon, MNRL and InfoNCE, checked and
    laid out: every anchor's ``P`` own positives in
    block 0 (left out of the owner's denominator with ``exclude_own``), every negative in
    block 1. ``zero_logit_own``: each *other* own positive adds ``exp(0)`` to the
    denominator (SupMPN's released code). ``false_negative_margin``: the self-margin filter on
    the first positive (``fastcl.losses.gist.self_margin_filter``; MNRL and InfoNCE)."""
    check_options(opts.reduction, opts.similarity, opts.strategy, opts.cross_device)
    _checks.check_embeddings(anchor=anchor, positives=positives, negatives=negatives)
    B, d = check_matrix("anchor", anchor)
    matryoshka = _matryoshka.check(opts.matryoshka_dims, opts.matryoshka_weights, d, compute_dtype(anchor.dtype))
    P = check_slots("positives", positives, "P", B, d)
    if P == 0:
        raise ValueError("positives has P = 0: every anchor needs at least one positive slot")
    if negatives is None and neg_mask is not None:
        raise ValueError("neg_mask given without negatives")
    Q = 0 if negatives is None else check_slots("negatives", negatives, "Q", B, d)
    _checks.check_mask("pos_mask", pos_mask, (B, P), anchor.device)
    _checks.check_mask("neg_mask", neg_mask, (B, Q), anchor.device)
    tau = check_positives(anchor, pos_mask, opts.process_group, opts.temperature)
    dev = anchor.device

    with no_autocast(anchor):
        anchor = without_unused_anchors(anchor, pos_mask)
        pos_tags = structured_tags(B, P, pos_mask, device=dev, exclude_owner=exclude_own)
        if negatives is not None and Q:
            neg_block = negatives.reshape(B * Q, d)
            neg_tags = structured_tags(B, Q, neg_mask, device=dev, exclude_owner=False)
        else:
            neg_block, neg_tags = empty_block(anchor)
        log_extra = None
        if zero_logit_own:
            count = torch.full((B,), P, device=dev) if pos_mask is None else pos_mask.sum(1)
            log_extra = (count - 1).clamp_min(0).to(compute_dtype(anchor.dtype)).log()
        filt = None
        if false_negative_margin is not None:
            from .gist import self_margin_filter

            dims = None if matryoshka is None else matryoshka[0]
            filt = self_margin_filter(anchor, positives[:, 0], false_negative_margin, opts.similarity == "cos", dims)
        spec = opts.spec(
            head, (pos_tags, neg_tags), anchor, matryoshka, positives=OwnPositives(0, P), pos_mask=pos_mask,
            log_extra=log_extra, padded=pos_mask is not None or neg_mask is not None,  # no mask: no padding tag
            filter=filt,
        )  # fmt: skip
        blocks = (positives.reshape(B * P, d), neg_block)
        return FusedCall(anchor, blocks, tau, spec, {"B": B, "P": P, "Q": Q, "d": d})


# --------------------------------------------------------------------------- modules


class TemperatureLoss(nn.Module):
    """The state every LSE loss module shares: a fixed or learnable temperature and the options.

    A tensor ``temperature`` that requires grad is used as given (the caller trains it);
    ``learn_temperature=True`` keeps ``log(temperature)`` as a parameter (so it stays > 0).
    """

    def __init__(
        self,
        temperature: float | Tensor = 0.05,
        *,
        learn_temperature: bool = False,
        reduction: str = "mean",
        backend: str = "auto",
        strategy: str = "auto",
        process_group=None,
        similarity: str = "cos",
        matryoshka_dims=None,
        matryoshka_weights=None,
        cross_device: str = "gather",
    ):
        super().__init__()
        # the losses' rule (fastcl._checks.check_temperature) in float32; a float64 call
        # checks again in float64
        _checks.check_temperature(temperature)
        _checks.check_choice("reduction", reduction, _checks.REDUCTIONS)
        _checks.check_choice("similarity", similarity, _checks.SIMILARITIES)
        _checks.check_choice("cross_device", cross_device, CROSS_DEVICE)
        _checks.check_choice("strategy", strategy, _checks.STRATEGIES)
        if isinstance(temperature, Tensor) and (learn_temperature or not temperature.requires_grad):
            temperature = float(temperature.detach())  # a value to start from / a constant
        elif not isinstance(temperature, Tensor):
            temperature = float(temperature)  # a NumPy scalar too
        if learn_temperature:
            self.log_temperature = nn.Parameter(torch.tensor(math.log(temperature)))
        else:
            # a float, or a tensor that requires grad: a temperature the caller trains
            self._fixed_temperature: float | Tensor | None = temperature
        self.learn_temperature = learn_temperature
        self.options: dict[str, Any] = dict(
            reduction=reduction,
            backend=backend,
            strategy=strategy,
            process_group=process_group,
            similarity=similarity,
            cross_device=cross_device,
        )
        # d and the compute dtype are checked per call; keep the checked tuples (the
        # arguments may be generators, spent by the check)
        checked = _matryoshka.check(matryoshka_dims, matryoshka_weights)
        if checked is not None:
            self.options.update(matryoshka_dims=checked[0], matryoshka_weights=checked[1])

    @property
    def temperature(self) -> float | Tensor | None:
        return self.log_temperature.exp() if self.learn_temperature else self._fixed_temperature

    def _kw(self) -> dict[str, Any]:
        """The loss function's keyword arguments: the temperature and the options."""
        return dict(temperature=self.temperature, **self.options)

    def _temperature_repr(self) -> str:
        return "learnable" if self.learn_temperature else str(self._fixed_temperature)

    def extra_repr(self) -> str:
        t = self._temperature_repr()
        return f"temperature={t}, reduction={self.options['reduction']!r}, backend={self.options['backend']!r}"


__all__ = [
    "ARG_DOCS",
    "Options",
    "TemperatureLoss",
    "check_matrix",
    "check_options",
    "check_positives",
    "check_slots",
    "CROSS_DEVICE",
    "document",
    "FusedCall",
    "fused_loss",
    "no_autocast",
    "row_weights",
    "structured_call",
    "uses_ring",
    "without_unused_anchors",
]
