"""The one interface every backend of the masked-LSE primitive implements (docs/design.md),
and :func:`input_reasons`, the input checks the compiled backends share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from .contract import FLOAT_DTYPES, FusedResult, LSEProblem
from .head import HeadInputs


class HeadSaved(NamedTuple):
    """What :meth:`HeadStep.forward` keeps for its backward, in the compute dtype."""

    d_pos: Tensor  # [B, P] dLoss_i/d l_ik before the weights: the given pos_logits' gradient
    w_row: Tensor  # [B]: the temperature's gradient is -sum_i s_i w_row_i / tau (s: weights x upstream)
    state: tuple[Tensor, ...]  # the backend's own (the Triton step: lse, dlse, the row scales)


class HeadStep(Protocol):
    """The third strategy (docs/design.md, "Three strategies"): the recompute strategy's whole
    loss step with the loss head fused into the backend's kernels, so that no PyTorch op runs
    between them. ``ContrastiveLSE`` asks ``takes`` first and runs ``forward`` and
    ``backward`` in place of ``Backend.forward``, :func:`~fastcl.ops.head.head_rows` and
    ``Backend.backward``; the temperature's (and given positives') gradients come from the
    :class:`HeadSaved` fields. The one implementation: ``fastcl/ops/_triton.py``'s
    ``TritonHeadStep``."""

    def takes(self, problem: LSEProblem, head: HeadInputs, own_count: int) -> bool:
        """Whether the step runs this call: ``head`` (``weights [B]`` the reduction's) on
        ``problem`` with ``own_count`` positives per anchor (folded from block 0 when
        ``head.pos_logits`` is None, else ``head.pos_logits [B, own_count]``). Metadata only."""

    def forward(self, problem: LSEProblem, tau: Tensor, head: HeadInputs, per_row: bool) -> tuple[Tensor, HeadSaved]:
        """``(loss, saved)``: the reduced loss ``sum_i weights_i loss_i`` (0-d, input dtype), or
        with ``per_row`` the rows ``[B]`` (compute dtype), and what :meth:`backward` needs."""

    def backward(
        self, problem: LSEProblem, tau: Tensor, saved: HeadSaved, weights: Tensor, grad_out: Tensor
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """``(d anchor, (d block0, d block1))`` in the compute dtype for the upstream
        ``grad_out`` (0-d; ``[B]`` for rows) and the reduction's ``weights [B]``, which the
        kernels apply themselves (no host read); own positives folded as ``Backend.backward``'s."""


class Backend(Protocol):
    """The interface; its defaults are those of a backend that runs wherever torch does and
    takes every problem."""

    name: str
    # True: ``backward`` is made of differentiable torch ops, so a second backward
    # (create_graph=True) is exact. False: differentiating its gradients raises.
    double_backward: bool = False
    # Gradient in forward for mean/sum reductions (three GEMM passes), or None.
    fused: Callable[[LSEProblem, Tensor, HeadInputs], FusedResult] | None
    # Joint rows in one sweep (``fastcl/ops/joint.py``): ``fused_joint(q, e, tau, head)`` is
    # ``fused(q, ...)`` with ``e``'s candidates (anchored by ``e``'s anchors) in every row's
    # denominator, ``FusedResult.joint_grads`` ``e``'s gradients; None: JointLSE composes it.
    fused_joint: Callable[[LSEProblem, LSEProblem, Tensor, HeadInputs], FusedResult] | None = None
    # True: ``fused`` also takes Matryoshka ``problem.dims`` (head weights ``[K, B]``, outputs
    # per prefix: ``lse``, ``mean_logit``, ``loss_rows`` ``[K, B]``, ``d_pos`` ``[K, B, P]``).
    fused_takes_dims: bool = False
    # True: ``fused`` also takes ``head.pos_logits=None`` when ``problem.positives`` is set, and
    # then forms the own-positive logits from its own dot products (``FusedResult.pos_logits``).
    forms_own_logits: bool = False
    # The primitive's extensions the backend computes (contract.Filter, contract.Sigmoid); a
    # problem with one it lacks gets a reason from extension_reasons (dispatch adds it).
    takes_filter: bool = False
    takes_sigmoid: bool = False
    takes_columns: bool = False  # contract: LSEProblem.columns (CLIP's symmetric step)
    # The head step (:class:`HeadStep`: the recompute strategy's loss step with the head fused
    # into the backend's kernels), or None: ``ContrastiveLSE`` then runs ``forward``, the
    # PyTorch head and ``backward``.
    head_step: HeadStep | None = None

    def unavailable(self) -> str | None:
        """Why the backend cannot run in this process at all (not installed, build failed), or None."""
        return None

    def unsupported(self, problem: LSEProblem) -> list[str]:
        """Every reason it cannot run these inputs (metadata only: no host sync)."""
        return []

    def forward(self, problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor]:
        """``(lse [B], mean_logit [B])`` in the compute dtype; ``[K, B]`` each when
        ``problem.dims`` is set (row ``k``: the plain problem ``problem.prefix(k)``)."""

    def backward(
        self, problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """``(d anchor, (d block0, d block1))`` in the compute dtype from ``g = dLoss/dlse``
        ``[B]``; ``d_pos [B, P]``, the own-positive logits' gradient, is folded in when
        ``problem.positives`` is set (ignored otherwise). With ``problem.dims``: ``lse``/``g``
        ``[K, B]``, ``d_pos [K, B, P]``, and each gradient is the sum over ``k`` of prefix
        ``k``'s gradient, zero beyond its ``prefixes[k]`` coordinates."""


def input_reasons(problem: LSEProblem, *, backend: str, device_type: str, takes_dims: bool = False) -> list[str]:
    """Device, dtype and tag checks shared by the ``cpp`` and ``triton`` backends."""
    why = [] if takes_dims or problem.dims is None else [dims_reason(backend)]
    tensors = (problem.anchor, *problem.blocks, *problem.tags)
    if any(t.device != problem.device for t in tensors):
        why.append(f"the {backend} backend needs all inputs on one device")
    if problem.device.type != device_type:
        why.append(f"the {backend} backend runs on {device_type.upper()} tensors only, got {problem.device}")
    if problem.dtype not in FLOAT_DTYPES:
        why.append(f"the {backend} backend takes float16/bfloat16/float32/float64, got {problem.dtype}")
    if any(b.dtype != problem.dtype for b in problem.blocks):
        why.append(f"the {backend} backend needs candidate blocks of the anchor's dtype")
    if any(t.dtype != torch.int32 for t in problem.tags):
        why.append(f"the {backend} backend takes int32 tags")
    return why


def extension_reasons(impl: Backend, problem: LSEProblem) -> list[str]:
    """Why ``impl`` cannot run the extensions ``problem`` asks for (dispatch adds these to every
    backend's own reasons)."""
    why = []
    if problem.filter is not None and not impl.takes_filter:
        why.append(
            f"the {impl.name} backend does not take a false-negative filter (backends that do: reference, torch, cpp, triton)"
        )
    if problem.sigmoid is not None and not impl.takes_sigmoid:
        why.append(
            f"the {impl.name} backend does not compute the sigmoid reduction (backends that do: reference, torch, cpp, triton)"
        )
    if problem.columns and not impl.takes_columns:
        why.append(
            f"the {impl.name} backend does not compute column statistics (backends that do: reference, torch, cpp)"
        )
    if problem.columns and problem.dims is not None and impl.name != "reference":
        why.append(f"the {impl.name} backend does not compute column statistics with matryoshka dims")
    if problem.filter is not None and problem.filter.guide_anchor is not None:
        guides = (problem.filter.guide_anchor, *(problem.filter.guide_blocks or ()))
        if any(t.device != problem.device for t in guides):
            why.append(f"the {impl.name} backend needs the guide embeddings on the problem's device ({problem.device})")
    return why


# the backends whose kernels take ``matryoshka_dims`` (the others refuse with dims_reason)
MATRYOSHKA_BACKENDS = ("reference", "torch", "cpp", "triton")


def dims_reason(backend: str) -> str:
    return f"the {backend} backend does not take matryoshka dims (backends that do: {', '.join(MATRYOSHKA_BACKENDS)})"
