"""The primitive on a candidate set split into blocks: partials that merge exactly.

``cross_device="ring"`` (``fastcl.ops.ring``) runs the backend's ``forward``/``backward`` once
per candidate block and combines the results here; nothing in this module communicates, so
the same code also runs a one-process "simulated ring" (tests, ``benchmarks.harness.ring_blocks``).

For anchor row ``i`` and blocks ``t = 0 .. T-1`` of the candidate set:

* forward: block ``t`` gives ``lse_t[i]`` and ``mean_logit_t[i]`` (its own softmax's mean
  logit). The set's ``lse = logaddexp_t lse_t`` and ``mean_logit = sum_t exp(lse_t - lse) *
  mean_logit_t``, merged online in a fixed order (:class:`Merged`), exactly like a kernel's
  split partials: one running max/sum per row.
* backward: the softmax of the whole set restricted to block ``t`` is block ``t``'s own
  softmax times ``exp(lse_t - lse)``, so ``dLoss/dlse`` of the set, ``g``, becomes
  ``g_t = g * exp(lse_t - lse)`` for the block (:func:`block_grad`) and the backend's
  ``backward(problem_t, tau, lse_t, g_t)`` gives block ``t``'s exact share of the gradients,
  whether the backend reads the ``lse`` it is given or recomputes it.

Shapes: ``[B]`` per row, ``[K, B]`` with Matryoshka dims (every operation is elementwise).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .contract import TAG_ALL


class Merged:
    """Running ``(lse, mean_logit)`` of the blocks seen so far (``-inf`` and 0 before any)."""

    def __init__(self) -> None:
        self.lse: Tensor | None = None
        self.mean_logit: Tensor | None = None

    def add(self, lse_t: Tensor, mean_logit_t: Tensor) -> None:
        """Merge one block's partial ``(lse_t, mean_logit_t)`` (a row empty in the block has
        ``lse_t = -inf``; NaN stays NaN: a non-finite input reaches every row that sees it)."""
        if self.lse is None:
            self.lse, self.mean_logit = lse_t.clone(), mean_logit_t.clone()
            return
        assert self.mean_logit is not None  # set with self.lse
        lse = torch.logaddexp(self.lse, lse_t)
        self.mean_logit = _weight(self.lse, lse) * self.mean_logit + _weight(lse_t, lse) * mean_logit_t
        self.lse = lse


def _weight(part: Tensor, total: Tensor) -> Tensor:
    """``exp(part - total)``, 0 where the part is empty (``-inf``: also when the total is)."""
    empty = part == float("-inf")
    return torch.where(empty, torch.zeros_like(part), torch.exp(part - torch.where(empty, 0.0, total)))


def block_grad(g: Tensor, lse: Tensor, lse_t: Tensor) -> Tensor:
    """``dLoss/dlse_t`` of block ``t`` from ``g = dLoss/dlse`` of the whole set: ``g *
    exp(lse_t - lse)`` (0 for rows the block leaves empty)."""
    return g * _weight(lse_t, lse).to(g.dtype)


def foreign_tags(tags: Tensor) -> Tensor:
    """Tags of another rank's candidates as seen here: an owner tag ``i >= 0`` names that
    rank's anchor ``i``, not ours, so it becomes ``TAG_ALL``; padding stays padding."""
    return torch.where(tags >= 0, torch.full_like(tags, TAG_ALL), tags)
