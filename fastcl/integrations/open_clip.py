"""open_clip's ``ClipLoss`` and ``SigLipLoss`` on fastcl's fused kernels: change one import.

::

    # was: from open_clip.loss import ClipLoss, SigLipLoss
    from fastcl.integrations.open_clip import ClipLoss, SigLipLoss

    loss_fn = SigLipLoss(rank=rank, world_size=world_size)
    loss = loss_fn(image_features, text_features, logit_scale.exp(), logit_bias)

Both take open-clip-torch 3.3's constructor arguments and ``forward(image_features,
text_features, logit_scale, logit_bias=None, output_dict=False)`` and return what it returns
(the loss, or ``{"contrastive_loss": loss}``), with the same per-rank values and gradients on
the same ranks; the ``[B, N]`` logits are never built (``fastcl.losses.clip_loss`` /
``siglip_loss``, ``similarity="dot"``: open_clip's features arrive normalised).

Several processes use the default ``torch.distributed`` group (or ``process_group=``), which
must have ``world_size`` ranks with this one at ``rank``. ``ClipLoss``: ``local_loss`` and
``gather_with_grad`` keep open_clip's meaning (``local_loss=False``: every rank computes the
global batch's loss; ``gather_with_grad=False``: the other ranks' features are constants).
``SigLipLoss``: every ``dist_impl`` gives the same numbers; ``"bidir"`` (the default) and
``"shift"`` run fastcl's ring (the texts travel rank to rank, per-rank memory constant in the
world size), ``"gather"`` and ``"reduce"`` its all-gather. ``cross_device=`` overrides that
choice (``ClipLoss``: ``"gather"`` by default; ``"ring"`` needs ``local_loss=True,
gather_with_grad=True``, the mode whose gradients travel). ``use_horovod=True`` is refused:
fastcl runs on ``torch.distributed``. ``cache_labels`` is accepted and has no effect
(fastcl builds no label tensor). docs/clip.md has the details and the measurements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import distributed
from ..losses.clip import _pairs, clip_loss, siglip_loss
from ..losses.clip import _scalar as _check_scalar
from ..ops.contract import TAG_ALL, OwnPositives, compute_dtype, empty_block
from ..ops.contrastive import LossSpec, contrastive_loss

DIST_IMPLS = ("bidir", "shift", "reduce", "gather")


def _group(rank: int, world_size: int, process_group):
    """The process group of a multi-rank loss, checked against open_clip's ``rank``/``world_size``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"world_size={world_size} needs an initialised torch.distributed process group (init_process_group)"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) != world_size or dist.get_rank(group) != rank:
        raise ValueError(
            f"rank={rank}, world_size={world_size} do not match the process group "
            f"(rank {dist.get_rank(group)} of {dist.get_world_size(group)})"
        )
    return group


def _result(loss: Tensor, output_dict: bool):
    return {"contrastive_loss": loss} if output_dict else loss


class ClipLoss(nn.Module):
    """open_clip's ``ClipLoss`` (symmetric InfoNCE over ``logit_scale * image @ text.T``).

    Args:
        local_loss: each rank's rows only (against every rank's columns), labels offset by
            ``rank * B``; False: every rank computes the whole global batch's loss.
        gather_with_grad: gradients flow through the other ranks' features (summed home);
            False: they are constants (this rank's own slot keeps its gradient when not
            ``local_loss``, as in open_clip).
        cache_labels: accepted; no effect (no label tensor exists).
        rank, world_size: this process's place; ``world_size > 1`` needs torch.distributed.
        use_horovod: refused (``ValueError``).
        backend, process_group, cross_device: fastcl's (module docstring).
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        backend: str = "auto",
        process_group=None,
        cross_device: str = "gather",
    ):
        super().__init__()
        if use_horovod:
            raise ValueError("use_horovod=True: fastcl's losses run on torch.distributed only (no Horovod)")
        if cross_device not in ("gather", "ring"):
            raise ValueError(f"cross_device={cross_device!r}; expected 'gather' or 'ring'")
        if cross_device == "ring" and not (local_loss and gather_with_grad):
            raise ValueError("cross_device='ring' needs local_loss=True and gather_with_grad=True")
        self.local_loss, self.gather_with_grad, self.cache_labels = local_loss, gather_with_grad, cache_labels
        self.rank, self.world_size = rank, world_size
        self.backend, self.process_group, self.cross_device = backend, process_group, cross_device

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, output_dict=False):
        kw = dict(similarity="dot", backend=self.backend)
        if self.world_size <= 1:
            return _result(clip_loss(image_features, text_features, logit_scale, logit_bias, **kw), output_dict)
        group = _group(self.rank, self.world_size, self.process_group)
        if self.local_loss and self.gather_with_grad:
            loss = clip_loss(
                image_features, text_features, logit_scale, logit_bias, process_group=group,
                cross_device=self.cross_device, **kw,
            )  # fmt: skip
        elif self.local_loss:
            loss = _local_constant_candidates(
                image_features, text_features, logit_scale, logit_bias, group, self.backend
            )
        else:  # every rank: the global batch's loss
            images, texts = (_gather(x, group, self.gather_with_grad) for x in (image_features, text_features))
            loss = clip_loss(images, texts, logit_scale, logit_bias, **kw)
        return _result(loss, output_dict)


def _gather(x: Tensor, group, with_grad: bool) -> Tensor:
    """Every rank's ``x``, rank-major: differentiable (gradients summed home), or constants
    except this rank's own slot (open_clip's ``gather_with_grad=False``)."""
    distributed.check_same_sizes(group, {"clip_B": x.shape[0], "d": x.shape[1]}, x.dtype)
    if with_grad:
        return distributed.all_gather_with_grad(x, group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    distributed.all_gather_into(out, x.detach().contiguous(), group)
    parts = list(out.chunk(world))
    parts[rank] = x
    return torch.cat(parts)


def _local_constant_candidates(image, text, logit_scale, logit_bias, group, backend) -> Tensor:
    """``local_loss=True, gather_with_grad=False``: this rank's rows against every rank's
    features as constants (its own slot included, as open_clip gathers without grad)."""
    B, d = _pairs(image, text, None)
    cd = compute_dtype(image.dtype)
    scale = _check_scalar("logit_scale", logit_scale, image, positive=True)
    tau = 1.0 / scale
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    distributed.check_same_sizes(group, {"clip_B": B, "d": d}, image.dtype)
    rows = []
    for x, y in ((image, text), (text, image)):
        every = x.new_empty((world * B, d))
        distributed.all_gather_into(every, y.detach().contiguous(), group)
        empty, empty_tags = empty_block(every)
        tags = torch.full((world * B,), TAG_ALL, dtype=torch.int32, device=x.device)
        weights = torch.full((B,), 1.0 / B, dtype=cd, device=x.device)
        spec = LossSpec(
            "cross_entropy", (tags, empty_tags), "mean", weights, cosine=False, positives=OwnPositives(rank * B, 1),
            padded=False, backend=backend,
        )  # fmt: skip
        rows.append(contrastive_loss(x.contiguous(), (every, empty), tau, spec))
    loss = 0.5 * (rows[0] + rows[1])
    if logit_bias is not None:
        loss = loss + 0 * _check_scalar("logit_bias", logit_bias, image, positive=False).to(loss.dtype)
    return loss


class SigLipLoss(nn.Module):
    """open_clip's ``SigLipLoss``: ``-(1/B) sum_ij log sigmoid(z_ij (logit_scale * <x_i, y_j> +
    logit_bias))``, the other ranks' texts all negatives.

    Args:
        cache_labels: accepted; no effect.
        rank, world_size: this process's place; ``world_size > 1`` needs torch.distributed.
        dist_impl: ``"bidir"`` (default), ``"shift"``, ``"reduce"`` or ``"gather"``: the same
            values and gradients; the first two run fastcl's ring, the others its all-gather.
        backend, process_group, cross_device: fastcl's (module docstring).
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: str | None = None,
        *,
        backend: str = "auto",
        process_group=None,
        cross_device: str | None = None,
    ):
        super().__init__()
        self.dist_impl = dist_impl or "bidir"
        if self.dist_impl not in DIST_IMPLS:
            raise ValueError(f"dist_impl={dist_impl!r}; expected one of {DIST_IMPLS}")
        chosen = cross_device or ("ring" if self.dist_impl in ("bidir", "shift") else "gather")
        if chosen not in ("gather", "ring"):
            raise ValueError(f"cross_device={cross_device!r}; expected 'gather' or 'ring'")
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.backend, self.process_group, self.cross_device = backend, process_group, chosen

    def forward(self, image_features, text_features, logit_scale, logit_bias, output_dict=False):
        if logit_bias is None:
            raise ValueError("SigLipLoss needs logit_bias (open_clip's forward takes it; pass 0.0 for none)")
        group = None if self.world_size <= 1 else _group(self.rank, self.world_size, self.process_group)
        loss = siglip_loss(
            image_features, text_features, logit_scale, logit_bias, similarity="dot", backend=self.backend,
            process_group=group, cross_device=self.cross_device,
        )  # fmt: skip
        return _result(loss, output_dict)
