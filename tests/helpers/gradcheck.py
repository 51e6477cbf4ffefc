"""One float64 gradcheck of ``contrastive_loss`` on a small masked problem, for any backend.

Anchors 0..3 with P = 2 positives (one anchor with none, so it contributes nothing) and
Q = 3 negatives with random padding; gradients are checked for the anchor, both blocks
and the temperature (gradcheck's fast mode: a random projection of the Jacobian).
"""

from __future__ import annotations

import torch

from fastcl.ops.contract import OwnPositives, structured_tags
from fastcl.ops.contrastive import LossSpec, contrastive_loss
from fastcl.ops.head import reduction_weights
from fastcl.ops.positive_logits import positive_logits


def gradcheck_contrastive(
    backend: str,
    *,
    kind: str,
    reduction: str = "mean",
    cosine: bool = True,
    folded: bool = True,
    zero_logit: bool = False,
    strategy: str = "auto",
) -> None:
    """``folded``: the backend adds the positives' gradient itself (``OwnPositives``);
    otherwise precomputed differentiable positive logits (shared positives)."""
    B, P, Q, d = 4, 2, 3, 5
    a = torch.randn(B, d, dtype=torch.float64, requires_grad=True)
    pos = torch.randn(B, P, d, dtype=torch.float64, requires_grad=True)
    neg = torch.randn(B, Q, d, dtype=torch.float64, requires_grad=True)
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    pos_mask = torch.tensor([[True, False], [True, True], [False, False], [False, True]])
    neg_mask = torch.rand(B, Q) > 0.3
    tags = (
        structured_tags(B, P, pos_mask, device=a.device, exclude_owner=kind == "softplus"),
        structured_tags(B, Q, neg_mask, device=a.device, exclude_owner=False),
    )
    weights = reduction_weights(pos_mask.any(1), reduction, torch.float64)
    log_extra = (pos_mask.sum(1) - 1).clamp_min(0).double().log() if zero_logit else None

    def f(a, pos, neg, tau):
        pl = None if folded else positive_logits(a, pos, tau, cosine=cosine, eps=1e-8)
        spec = LossSpec(
            kind,
            tags,
            reduction,
            weights,
            cosine=cosine,
            eps=1e-8,
            positives=OwnPositives(0, P) if folded else None,
            pos_mask=pos_mask,
            log_extra=log_extra,
            strategy=strategy,
            backend=backend,
        )
        return contrastive_loss(a, (pos.reshape(B * P, d), neg.reshape(B * Q, d)), tau, spec, pl)

    # fast_mode compares u^T J v for random u, v with the finite differences along v: any wrong
    # Jacobian entry moves it (with probability 1), at two evaluations instead of one per input
    # element (121 here: ~3 s per case on a 2-core machine, ~60 s over the suite's cases)
    assert torch.autograd.gradcheck(f, (a, pos, neg, tau), fast_mode=True)
