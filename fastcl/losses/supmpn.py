"""SupMPN: several positives and hard negatives per anchor (Dehghan & Amasyali 2022, eq. 7).

``loss_i = mean_k [-l_ik + log(exp(l_ik) + R_i)]`` over anchor ``i``'s valid own positives
``k``, ``R_i`` the sum of ``exp(l_ic)`` over every valid candidate of the batch except ``i``'s
own positives: the primitive's LSE with the own positives tagged out of their owner's row,
and the softplus head (``softplus(r_i - l_ik)``). Formulas: docs/losses.md, "SupMPN".
"""

from __future__ import annotations

from torch import Tensor

from .. import _checks, distributed
from ._shared import LSE_OPTIONS, Options, TemperatureLoss, document, fused_loss, structured_call

__all__ = ["supmpn_loss", "SupMPNLoss", "OWN_POSITIVES"]

# "exclude": eq. 7. "zero_logit": the authors' released code, which keeps the anchor's other
# own positives in its denominator with logit 0.
OWN_POSITIVES = ("exclude", "zero_logit")


@distributed.agree_on_errors
@document("pos_mask", "neg_mask", *LSE_OPTIONS)
def supmpn_loss(
    anchor: Tensor,
    positives: Tensor,
    negatives: Tensor | None = None,
    *,
    pos_mask: Tensor | None = None,
    neg_mask: Tensor | None = None,
    temperature: float | Tensor = 0.05,
    reduction: str = "mean",
    backend: str = "auto",
    strategy: str = "auto",
    process_group=None,
    similarity: str = "cos",
    matryoshka_dims=None,
    matryoshka_weights=None,
    cross_device: str = "gather",
    own_positives: str = "exclude",
) -> Tensor:
    """SupMPN (Dehghan & Amasyali 2022, eq. 7): several positives and hard negatives per anchor.

    ``loss_i = mean_k [-l_ik + log(exp(l_ik) + R_i)]`` over the valid own positives ``k`` of
    anchor ``i``, where ``l = similarity / temperature`` and ``R_i`` sums ``exp(l_ic)`` over
    every valid candidate of the batch (every anchor's positives and negatives) except
    ``i``'s own positives. ``R_i`` empty (``B = 1``, no negatives): the term is 0.

    Args:
        anchor: ``[B, d]`` float16, bfloat16, float32 or float64 (raw embeddings; every
            embedding of a call shares one dtype and device).
        positives: ``[B, P, d]``, ``P >= 1`` own positives per anchor.
        negatives: ``[B, Q, d]`` hard negatives, or None (``Q = 0``).
        {shared}
        own_positives: ``"exclude"`` (eq. 7) or ``"zero_logit"``: the authors' released code,
            which keeps the anchor's *other* own positives in ``R_i`` with logit 0 (adds
            ``P_i - 1``).

    Returns:
        {returns}

    Example:
        >>> import torch
        >>> from fastcl.losses import supmpn_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> a, p, n = (torch.randn(8, *s, 32, generator=g) for s in ((), (5,), (5,)))
        >>> loss = supmpn_loss(a, p, n, temperature=0.05)
        >>> loss.shape, loss.dtype
        (torch.Size([]), torch.float32)
        >>> torch.allclose(loss, supmpn_loss(a, p, n, backend="reference"), atol=1e-5)
        True
        >>> supmpn_loss(a, p, n, reduction="none").shape
        torch.Size([8])
    """
    _checks.check_choice("own_positives", own_positives, OWN_POSITIVES)
    opts = Options(
        temperature,
        reduction,
        backend,
        strategy,
        process_group,
        similarity,
        matryoshka_dims,
        matryoshka_weights,
        cross_device,
    )
    zero_logit = own_positives == "zero_logit"
    call = structured_call(
        "softplus", anchor, positives, negatives, pos_mask, neg_mask, opts, exclude_own=True, zero_logit_own=zero_logit
    )
    return fused_loss(call, opts)


@document("learn_temperature", *LSE_OPTIONS)
class SupMPNLoss(TemperatureLoss):
    """Module form of :func:`supmpn_loss`:
    ``forward(anchor [B, d], positives [B, P, d], negatives=None [B, Q, d], pos_mask=None, neg_mask=None)``.

    Args:
        {shared}
        own_positives: ``"exclude"`` (eq. 7) or ``"zero_logit"`` (the released code).
    """

    def __init__(self, temperature: float | Tensor = 0.05, *, own_positives: str = "exclude", **kw):
        super().__init__(temperature, **kw)
        _checks.check_choice("own_positives", own_positives, OWN_POSITIVES)
        self.own_positives = own_positives

    def forward(self, anchor, positives, negatives=None, pos_mask=None, neg_mask=None) -> Tensor:
        kw = self._kw()
        return supmpn_loss(
            anchor, positives, negatives, pos_mask=pos_mask, neg_mask=neg_mask, own_positives=self.own_positives, **kw
        )
