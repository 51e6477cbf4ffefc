"""The contract of fastcl's one fused primitive: the masked log-sum-exp of contrastive logits.

Every LSE loss of fastcl (SupMPN, SupCon, MNRL/SimCSE-sup, InfoNCE/SimCSE-unsup, EdaCSE)
is a thin composition over this primitive, and every backend (``torch``, ``cpp``,
``triton``, ``cuda``) implements exactly this contract. Read this file first.

Problem
-------
``anchor``   ``[B, d]`` raw embeddings (fp16, bf16, fp32 or fp64).
``blocks``   two candidate blocks ``[N0, d]`` and ``[N1, d]`` of the same dtype and device
             (the second may have zero rows). The *candidate set* is their concatenation,
             ``N = N0 + N1`` columns. The losses put every anchor's positives (``[B*P, d]``,
             anchor-major) in block 0 and every negative (``[B*Q, d]``) in block 1, so no
             candidate is ever copied.
``tags``     one ``int32`` vector per block, ``[N0]`` and ``[N1]``, the *structural mask*:

             ==========  ====================================================================
             tag         meaning for candidate ``c``
             ==========  ====================================================================
             ``-2``      padding (``TAG_PADDING``): in no row, gets exactly zero gradient
             ``-1``      valid (``TAG_ALL``): in every row's LSE
             ``i >= 0``  valid, but left out of row ``i`` only (an own positive of anchor ``i``
                         when the loss excludes own positives from its denominator, SupMPN)
             ==========  ====================================================================
``positives`` optional :class:`OwnPositives`: anchor ``i``'s own positive ``k`` is row
             ``offset + i * count + k`` of block 0 (the losses' layout). Backends with
             ``folds_positives = True`` then also take the gradient of the own-positive
             logits (``d_pos [B, P]``) and add it to their float32 accumulators *before*
             rounding to the input dtype: ``d anchor`` is a small difference of two large
             terms once the softmax concentrates on the positive, and rounding each term
             to bf16 separately would lose it.
``cosine``   ``True``: logits ``l_ic = cos(a_i, c) / tau`` with norms clamped at ``eps``;
             ``False`` (``similarity="dot"``): ``l_ic = <a_i, c> / tau``.
``tau``      0-d float32 tensor on the problem's device (no host sync to read it).

Outputs (every backend)
-----------------------
All float outputs are float32 (float64 when the inputs are float64: the oracle's dtype).

``lse``          ``[B]``, ``log sum_{c in S_i} exp(l_ic)``; ``-inf`` when ``S_i`` is empty.
``mean_logit``   ``[B]``, ``sum_c softmax_i(c) * l_ic`` (0 for an empty row): the
                 temperature gradient of the LSE part is ``-(1/tau) * sum_i g_i * mean_logit_i``.
Backward, given ``g = dLoss/dlse`` (``[B]``) and, for folding backends, ``d_pos``:
``d anchor`` and ``d blocks`` with respect to the *raw* embeddings, in the input dtype;
padded candidates get exactly zero.

Extra memory allowed beyond inputs, outputs and their gradients: O((B + N) * d) plus a
bounded working set (a block of rows times N is fine, B x N never is).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

TAG_PADDING = -2
TAG_ALL = -1

EPS = 1e-8


@dataclass(frozen=True)
class OwnPositives:
    """Anchor ``i``'s own positive ``k`` is row ``offset + i * count + k`` of block 0."""

    offset: int
    count: int

    def rows(self, r0: int, r1: int) -> slice:
        """Block-0 rows holding the own positives of anchors ``r0 .. r1 - 1``."""
        return slice(self.offset + r0 * self.count, self.offset + r1 * self.count)


@dataclass(frozen=True)
class LSEProblem:
    """Inputs of the masked-LSE primitive (see the module docstring for the semantics)."""

    anchor: Tensor  # [B, d]
    blocks: tuple[Tensor, Tensor]  # [N0, d], [N1, d]
    tags: tuple[Tensor, Tensor]  # int32 [N0], [N1]
    cosine: bool = True
    eps: float = EPS
    positives: OwnPositives | None = None

    def __post_init__(self):
        # a wrong layout would fold gradients into the wrong rows: refuse it (shapes only, no sync)
        pos = self.positives
        if pos is not None and not (pos.offset >= 0 and pos.count >= 1
                                    and pos.offset + self.anchor.shape[0] * pos.count <= self.blocks[0].shape[0]):
            raise ValueError(
                f"own positives (offset {pos.offset}, {pos.count} per anchor, {self.anchor.shape[0]} anchors) "
                f"do not fit in block 0 ({self.blocks[0].shape[0]} rows)"
            )

    @property
    def num_anchors(self) -> int:
        return self.anchor.shape[0]

    @property
    def num_candidates(self) -> int:
        return self.blocks[0].shape[0] + self.blocks[1].shape[0]

    @property
    def dim(self) -> int:
        return self.anchor.shape[1]

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype


def structured_tags(
    batch: int,
    slots: int,
    mask: Tensor | None,
    *,
    device: torch.device,
    exclude_owner: bool,
    owner_offset: int = 0,
) -> Tensor:
    """Tags of a ``[batch, slots]`` candidate grid laid out anchor-major (``[batch*slots]``).

    Slot ``(j, k)`` belongs to anchor ``owner_offset + j``. With ``exclude_owner`` the slot is
    left out of its owner's row (tag = owner), else it is in every row (``TAG_ALL``).
    ``mask`` (``[batch, slots]`` bool, ``False`` = padding) turns slots into ``TAG_PADDING``.
    """
    if exclude_owner:
        owner = torch.arange(owner_offset, owner_offset + batch, device=device, dtype=torch.int32)
        tags = owner[:, None].expand(batch, slots)
    else:
        tags = torch.full((batch, slots), TAG_ALL, device=device, dtype=torch.int32)
    if mask is not None:
        tags = torch.where(mask, tags, torch.full_like(tags, TAG_PADDING))
    return tags.reshape(batch * slots).contiguous()


def pool_tags(num: int, mask: Tensor | None, *, device: torch.device) -> Tensor:
    """Tags of a shared candidate pool ``[num]``: every valid candidate is in every row."""
    tags = torch.full((num,), TAG_ALL, device=device, dtype=torch.int32)
    if mask is not None:
        tags = torch.where(mask, tags, torch.full_like(tags, TAG_PADDING))
    return tags


def excluded(tags: Tensor, rows: Tensor) -> Tensor:
    """``[R, N]`` bool: candidate left out of row (padding, or tagged with that row).

    The one definition of the structural mask for PyTorch code; kernels apply the same
    rule ``tag == TAG_PADDING or tag == row`` on their tiles.
    """
    t = tags[None, :]
    return (t == TAG_PADDING) | (t == rows[:, None].to(tags.dtype))


_POISON = False


@contextlib.contextmanager
def poison_outputs():
    """Inside this context :func:`new_output` fills outputs with NaN (or -1 for integers).

    Tests run every backend under it: an element a kernel forgets to write stays poisoned
    and fails the comparison with the reference.
    """
    global _POISON
    before, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = before


def new_output(shape, *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Allocate a tensor the backend promises to overwrite completely (see ``poison_outputs``)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not _POISON:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else -1
    return torch.full(shape, fill, dtype=dtype, device=device)


def empty_block(like: Tensor) -> tuple[Tensor, Tensor]:
    """A zero-row candidate block and its tags, for problems with one block."""
    return like.new_empty((0, like.shape[-1])), torch.empty(0, dtype=torch.int32, device=like.device)
