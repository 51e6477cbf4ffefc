"""The contract every backend implements: the masked log-sum-exp of contrastive logits, and
its two extensions, the sigmoid reduction (SigLIP) and the false-negative filter (GIST).

Problem, tag table, outputs and the memory rule: docs/design.md, "The primitive"; the
extensions: docs/design.md, "Sigmoid reduction" and "Filters".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from .constants import constant

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
class Filter:
    """False negatives left out of the rows, decided tile by tile and never stored: candidate
    ``c`` leaves row ``i`` when ``sim(i, c) > threshold[i]`` (strictly: a tie stays), unless
    it is one of ``i``'s own positives (``LSEProblem.positives``), which never leave.

    * guide (``guide_anchor`` and ``guide_blocks`` given): ``sim`` is the cosine of a guide
      model's embeddings (any width ``g``, any float dtype, no gradient; norms clamped at the
      problem's ``eps``), the same decision for every Matryoshka prefix;
    * self (both None): ``sim`` is the model's own similarity ``s_ic`` (the cosine, or the
      dot product with ``cosine=False``: the logit times ``tau``) of the prefix in question.

    ``threshold``: ``[B]`` in the compute dtype; with Matryoshka dims a self filter may give
    ``[K, B]``, one row per prefix. A NaN threshold or similarity drops nothing. A dropped
    candidate reaches neither the row's value nor its gradients, not even as a NaN: with a
    filter, backends read a non-finite input row as zeros in every product and add NaN to
    every logit it takes part in instead (a row that keeps it is NaN, as without a filter).
    """

    threshold: Tensor
    guide_anchor: Tensor | None = None  # [B, g]
    guide_blocks: tuple[Tensor, Tensor] | None = None  # [N0, g], [N1, g]

    @property
    def guided(self) -> bool:
        return self.guide_anchor is not None

    def for_prefix(self, k: int) -> Filter:
        """The filter of Matryoshka prefix ``k`` (a per-prefix threshold's row ``k``)."""
        if self.threshold.dim() == 1:
            return self
        return Filter(self.threshold[k], self.guide_anchor, self.guide_blocks)


@dataclass(frozen=True)
class Sigmoid:
    """SigLIP's pairwise reduction in place of the log-sum-exp: the row value is
    ``v_i = sum_{c in S_i} softplus(-z_ic * (l_ic + bias))`` with ``z_ic = +1`` for ``i``'s own
    positives (``LSEProblem.positives``; none: every ``z = -1``) and ``-1`` for every other
    candidate of the row's set ``S_i`` (tags and filter as for the LSE; an empty row gives 0).
    With ``sigma_ic = dv_i/dl_ic = -z_ic * sigmoid(-z_ic * (l_ic + bias))`` the forward's row
    statistics are ``(sum_c sigma_ic * l_ic, sum_c sigma_ic)`` (``l`` without the bias): the
    temperature's and the bias's gradients. ``bias``: 0-d, compute dtype, problem's device."""

    bias: Tensor


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
    # False-negative filter (GIST's guide, or a self-margin), or None: every tagged candidate
    filter: Filter | None = None
    # Set: the sigmoid reduction (SigLIP) instead of the LSE (outputs: docs/design.md)
    sigmoid: Sigmoid | None = None
    # True: the LSE of every column too (over the rows whose set holds it): outputs and row
    # gradients are [B + N], rows then columns (docs/design.md, "Column statistics")
    columns: bool = False

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
        if self.filter is not None:
            self._check_filter(self.filter)
        if self.columns and (self.filter is not None or self.sigmoid is not None):
            raise ValueError("column statistics are an LSE extension without a filter")

    def _check_filter(self, f: Filter) -> None:
        """Shapes only (no sync): a wrong one would compare against another row's threshold."""
        B, K = self.anchor.shape[0], len(self.prefixes)
        shapes = [(B,)] + ([(K, B)] if self.dims is not None and not f.guided else [])
        if tuple(f.threshold.shape) not in shapes:
            raise ValueError(f"filter threshold has shape {tuple(f.threshold.shape)}; expected one of {shapes}")
        if (f.guide_anchor is None) != (f.guide_blocks is None):
            raise ValueError("a guide filter needs guide_anchor and guide_blocks (a self filter: neither)")
        if f.guide_anchor is not None and f.guide_blocks is not None:
            g = f.guide_anchor.shape[-1]
            rows = (B, *(b.shape[0] for b in self.blocks))
            got = (f.guide_anchor, *f.guide_blocks)
            if any(t.dim() != 2 or t.shape[0] != n or t.shape[1] != g for t, n in zip(got, rows)):
                raise ValueError(
                    f"guide embeddings must be [B, g], [N0, g], [N1, g] = {[(n, g) for n in rows]}, "
                    f"got {[tuple(t.shape) for t in got]}"
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
    def num_columns(self) -> int:
        return self.blocks[0].shape[0] + self.blocks[1].shape[0]

    @property
    def num_rows(self) -> int:
        """Rows of the per-row outputs: ``B``, or ``B + N`` with column statistics."""
        return self.num_anchors + (self.num_columns if self.columns else 0)

    @property
    def num_prefixes(self) -> int:
        return len(self.prefixes)

    def prefix(self, k: int) -> LSEProblem:
        """The plain problem on the first ``prefixes[k]`` coordinates (views, no copy): what
        prefix ``k`` of a Matryoshka problem means."""
        m = self.prefixes[k]
        blocks = (self.blocks[0][:, :m], self.blocks[1][:, :m])
        filt = None if self.filter is None else self.filter.for_prefix(k)
        return LSEProblem(
            self.anchor[:, :m], blocks, self.tags, self.cosine, self.eps, self.positives,
            padded=self.padded, filter=filt, sigmoid=self.sigmoid, columns=self.columns,
        )  # fmt: skip

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
    # joint rows (``Backend.fused_joint``): the extra problem's ``(d anchor, (d block0, d block1))``
    joint_grads: tuple[Tensor, tuple[Tensor, Tensor]] | None = None

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
    if mask is None:  # the same every step: made once (fastcl.ops.constants)
        key = ("structured_tags", batch, slots, exclude_owner, str(torch.device(device)))
        return constant(
            key, lambda: _grid_tags(batch, slots, device, exclude_owner).reshape(batch * slots).contiguous()
        )
    tags = _grid_tags(batch, slots, device, exclude_owner)
    tags = torch.where(mask, tags, torch.full_like(tags, TAG_PADDING))
    return tags.reshape(batch * slots).contiguous()


def _grid_tags(batch: int, slots: int, device, exclude_owner: bool) -> Tensor:
    if exclude_owner:
        return torch.arange(batch, device=device, dtype=torch.int32)[:, None].expand(batch, slots)
    return torch.full((batch, slots), TAG_ALL, device=device, dtype=torch.int32)


def pool_tags(num: int, mask: Tensor | None, *, device: torch.device) -> Tensor:
    """Tags of a shared candidate pool ``[num]``: every valid candidate is in every row."""
    grid_mask = None if mask is None else mask[None]
    return structured_tags(1, num, grid_mask, device=device, exclude_owner=False)


def excluded(tags: Tensor, rows: Tensor) -> Tensor:
    """``[R, N]`` bool: candidate left out of row (padding, or tagged with that row); the one
    definition of the structural mask for PyTorch code (kernels apply the same rule)."""
    t = tags[None, :]
    return (t == TAG_PADDING) | (t == rows[:, None].to(tags.dtype))


def own_positive_columns(positives: OwnPositives | None, rows: Tensor, num_columns: int) -> Tensor:
    """``[R, N]`` bool: column ``c`` (of the two blocks side by side) is an own positive of row
    ``rows[r]`` (``offset + i * count <= c < offset + (i + 1) * count``); all False without
    ``positives``. What the sigmoid reduction's ``z = +1`` and the filter's exemption read."""
    cols = torch.arange(num_columns, device=rows.device)[None, :]
    if positives is None:
        return torch.zeros((rows.shape[0], num_columns), dtype=torch.bool, device=rows.device)
    first = positives.offset + rows[:, None].to(torch.int64) * positives.count
    return (cols >= first) & (cols < first + positives.count)


def filtered(sim: Tensor, threshold: Tensor, own_positive: Tensor) -> Tensor:
    """``[R, N]`` bool: the filter drops the candidate (``sim > threshold`` per row, never an own
    positive; a NaN on either side drops nothing); the one definition for PyTorch code."""
    return (sim > threshold[:, None].to(sim.dtype)) & ~own_positive


def finite_or_zero(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(x with non-finite rows read as zeros, poison [rows])``: ``poison`` is NaN for a row that
    held a NaN or an Inf, else 0. Filtered problems compute on the first and add ``poison`` to
    every logit of the row (docs/design.md, "Filters"): a dropped logit is masked by selection,
    so the NaN reaches exactly the rows that keep it, in values and gradients."""
    bad = ~torch.isfinite(x).all(dim=-1)
    clean = torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=x.dtype, device=x.device), x)
    poison = torch.where(bad, float("nan"), 0.0).to(compute_dtype(x.dtype))
    return clean, poison


def sigmoid_terms(logits: Tensor, z: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """``(softplus(-z (l + b)), sigma = -z sigmoid(-z (l + b)))`` elementwise: the sigmoid
    reduction's term and its derivative, for PyTorch code (``z`` is +1 or -1)."""
    u = -z * (logits + bias)
    # softplus(u) = logaddexp(u, 0), exact for every u (F.softplus switches to u above 20)
    return torch.logaddexp(u, torch.zeros_like(u)), -z * torch.sigmoid(u)


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
