"""The contract every backend implements: the masked log-sum-exp of contrastive logits.

Problem, tag table, outputs and the memory rule: docs/design.md, "The primitive".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

TAG_PADDING = -2
TAG_ALL = -1

EPS = 1e-8

# The input dtypes every backend takes; outputs and accumulators use compute_dtype().
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation and output dtype: float64 stays float64, everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    """Inputs of the masked-LSE primitive (semantics: docs/design.md)."""

    anchor: Tensor  # [B, d]
    blocks: tuple[Tensor, Tensor]  # [N0, d], [N1, d]
    tags: tuple[Tensor, Tensor]  # int32 [N0], [N1]
    cosine: bool = True
    eps: float = EPS
    positives: OwnPositives | None = None
    # Matryoshka: K prefix lengths (distinct, each in 1..d, in the caller's order). Set, the
    # problem is K plain problems on the first dims[k] coordinates (``prefix(k)``): forward
    # gives [K, B] outputs and backward sums the K gradients (docs/design.md, "Matryoshka").
    dims: tuple[int, ...] | None = None
    # False: the caller knows no tag is TAG_PADDING (no masks were given), so backends may
    # read every candidate row without masking (the Triton GEMMs then pipeline fully)
    padded: bool = True

    def __post_init__(self):
        if self.dims is not None:
            d, dims = self.anchor.shape[-1], self.dims
            if not dims or len(set(dims)) != len(dims) or any(not 0 < m <= d for m in dims):
                raise ValueError(f"matryoshka dims must be distinct integers in 1..{d}, got {dims}")
        # a wrong layout would fold gradients into the wrong rows: refuse it (shapes only, no sync)
        pos = self.positives
        if pos is not None and not (
            pos.offset >= 0
            and pos.count >= 1
            and pos.offset + self.anchor.shape[0] * pos.count <= self.blocks[0].shape[0]
        ):
            raise ValueError(
                f"own positives (offset {pos.offset}, {pos.count} per anchor, {self.anchor.shape[0]} anchors) "
                f"do not fit in block 0 ({self.blocks[0].shape[0]} rows)"
            )

    @property
    def num_anchors(self) -> int:
        return self.anchor.shape[0]

    @property
    def dim(self) -> int:
        return self.anchor.shape[1]

    @property
    def prefixes(self) -> tuple[int, ...]:
        """The prefix lengths whose LSEs the problem asks for: ``dims``, or the full ``(d,)``."""
        return (self.dim,) if self.dims is None else tuple(self.dims)

    @property
    def num_prefixes(self) -> int:
        return len(self.prefixes)

    def prefix(self, k: int) -> LSEProblem:
        """The plain problem on the first ``prefixes[k]`` coordinates (views, no copy): what
        prefix ``k`` of a Matryoshka problem means."""
        m = self.prefixes[k]
        blocks = (self.blocks[0][:, :m], self.blocks[1][:, :m])
        return LSEProblem(
            self.anchor[:, :m], blocks, self.tags, self.cosine, self.eps, self.positives, padded=self.padded
        )

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype


def prefix_order(dims) -> tuple[list[int], list[int]]:
    """``(order, inverse)`` of Matryoshka dims: ``dims[order[j]]`` ascend (a sweep over d meets
    the prefixes shortest first); outputs in that order go back to the caller's as ``out[inverse]``."""
    order = sorted(range(len(dims)), key=dims.__getitem__)
    inverse = sorted(range(len(dims)), key=order.__getitem__)
    return order, inverse


@dataclass
class FusedResult:
    """What a gradient-in-forward sweep (``Backend.fused``) returns, in the compute dtype:
    ``loss_rows [B]``, the head's per-row loss, and ``d_pos [B, P]``, its gradient w.r.t. the
    own-positive logits (already folded into ``d_anchor``/``d_blocks`` when the problem has
    ``positives``), besides the primitive's outputs; ``g_dot_mean_logit = sum_i g_i * mean_logit_i``;
    ``pos_logits [B, P]``, the own-positive logits when the sweep formed them (``forms_own_logits``).
    With Matryoshka dims (``Backend.fused_takes_dims``) the per-row outputs are per prefix:
    ``lse``, ``mean_logit``, ``loss_rows`` ``[K, B]``, ``d_pos`` and ``pos_logits`` ``[K, B, P]``."""

    lse: Tensor
    mean_logit: Tensor
    d_anchor: Tensor | None = None
    d_blocks: tuple[Tensor, Tensor] | None = None
    g_dot_mean_logit: Tensor | None = None
    loss_rows: Tensor | None = None
    d_pos: Tensor | None = None
    pos_logits: Tensor | None = None

    def sweep_outputs(self) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor, Tensor, Tensor]:
        """``(d_anchor, d_blocks, g_dot_mean_logit, loss_rows, d_pos)``: what every
        gradient-in-forward sweep must set (a backend that leaves one unset fails here)."""
        if (
            self.d_anchor is None
            or self.d_blocks is None
            or self.g_dot_mean_logit is None
            or self.loss_rows is None
            or self.d_pos is None
        ):
            raise RuntimeError("fastcl: a fused backend returned a FusedResult without its gradients")
        return self.d_anchor, self.d_blocks, self.g_dot_mean_logit, self.loss_rows, self.d_pos


def structured_tags(
    batch: int, slots: int, mask: Tensor | None, *, device: torch.device, exclude_owner: bool
) -> Tensor:
    """Tags of a ``[batch, slots]`` candidate grid laid out anchor-major: slot ``(j, k)`` is left
    out of its owner ``j``'s row with ``exclude_owner`` (tag ``j``), else in every row
    (``TAG_ALL``); ``mask`` (``False`` = padding) turns slots into ``TAG_PADDING``."""
    if exclude_owner:
        tags = torch.arange(batch, device=device, dtype=torch.int32)[:, None].expand(batch, slots)
    else:
        tags = torch.full((batch, slots), TAG_ALL, device=device, dtype=torch.int32)
    if mask is not None:
        tags = torch.where(mask, tags, torch.full_like(tags, TAG_PADDING))
    return tags.reshape(batch * slots).contiguous()


def pool_tags(num: int, mask: Tensor | None, *, device: torch.device) -> Tensor:
    """Tags of a shared candidate pool ``[num]``: every valid candidate is in every row."""
    grid_mask = None if mask is None else mask[None]
    return structured_tags(1, num, grid_mask, device=device, exclude_owner=False)


def excluded(tags: Tensor, rows: Tensor) -> Tensor:
    """``[R, N]`` bool: candidate left out of row (padding, or tagged with that row); the one
    definition of the structural mask for PyTorch code (kernels apply the same rule)."""
    t = tags[None, :]
    return (t == TAG_PADDING) | (t == rows[:, None].to(tags.dtype))


_POISON = False


@contextlib.contextmanager
def poison_outputs():
    """Inside this context :func:`new_output` fills outputs with NaN (or -1 for integers), so
    that an element a kernel forgets to write fails the tests' comparison with the reference."""
    global _POISON
    before, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = before


def poisoning() -> bool:
    """Whether :func:`poison_outputs` is active (backends refill cached scratch with NaN then)."""
    return _POISON


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
