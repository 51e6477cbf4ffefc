"""Launchers of the masked-LSE kernels, registered as ``torch.library`` ops (``fastcl_triton::``).

Two pairs of ops:

* the primitive of the backend contract (``fastcl/ops/backend.py``): ``lse_forward`` /
  ``lse_backward``, for plain problems and (``dims``) Matryoshka prefixes alike: ``lse`` and
  the softmax-weighted mean logit, then gradients from ``g = dLoss/dlse`` and the own
  positives' ``d_pos``;
* the fused loss step the ``triton`` backend runs for the losses (``head_forward`` /
  ``head_backward``): the forward also forms the loss head and the reduced loss, and keeps
  the row scales for the backward, which takes the upstream gradient and the reduction
  weights as device tensors. A SupMPN step is then 4 forward launches and 3 per dS chunk
  (docs/triton.md, "Launches").

A plain problem is the one-prefix case of a Matryoshka one (its one segment is all of ``d``):
one planner (:class:`_Call`), one forward sweep and one chunked backward serve both, and the
kernels take ``PREFIXES`` as a constexpr, so the plain launches compile to the one-pass loops.

No launcher reads a device value on the host, and all scratch comes from the cached
``plan.scratch``: a warm step allocates only its outputs, makes no host synchronisation and
can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
from torch import Tensor

from fastcl.ops.contract import new_output, prefix_order

from . import configs, plan
from ._common import (
    FILTER_KINDS,
    ExtArgs,
    PrefixArgs,
    RowArgs,
    acc_dtype,
    arch_of,
    dot_precision,
    dtype_class,
    launch,
    num_sms,
    register_op,
)
from .head import HEAD, KINDS, MAX_OWN, SUM, HeadArgs
from .lse_bwd import DS, DsArgs, DsChunk
from .lse_fwd import FWD, MAX_PREFIXES, FwdArgs
from .matmul import MM, Product
from .norms import ROW_NORMS, NormsArgs


def prefix_reasons(dims) -> list[str]:
    if dims is not None and len(dims) > MAX_PREFIXES:
        return [f"the triton backend takes at most {MAX_PREFIXES} matryoshka dims, got {len(dims)}"]
    return []


def _check_layout(tensors) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("triton LSE kernels need contiguous inputs")


@dataclasses.dataclass(frozen=True, eq=False)
class Extensions:
    """The primitive's extensions (``contract.Filter``, ``contract.Sigmoid``) as one record, built
    once per call by the backend (``fastcl/ops/_triton.py``) and handed to every launcher: a
    filter's ``threshold`` (``[B]``, or ``[K, B]`` per prefix in the caller's dims order) and the
    guide embeddings ``guide`` (``[B, g]``, ``[N0, g]``, ``[N1, g]``; None: a self filter), the
    sigmoid's ``bias`` (0-d), and the own positives' layout in block 0 (``pos_offset``,
    ``pos_count``; 0: none), which the sigmoid's ``z``, the filter's exemption and the backward's
    ``d_pos`` fold read.

    ``torch.library`` ops take tensors and numbers, not records: the record crosses an op
    boundary as its fields (:meth:`op_args`, the ops' keywords ``EXT_PARAMS``) and is rebuilt
    on the other side (:meth:`of`)."""

    threshold: Tensor | None = None
    guide: tuple[Tensor, Tensor, Tensor] | None = None
    bias: Tensor | None = None
    pos_offset: int = 0
    pos_count: int = 0

    @classmethod
    def of(cls, threshold=None, guide_anchor=None, guide_block0=None, guide_block1=None, bias=None,
           pos_offset: int = 0, pos_count: int = 0) -> Extensions:  # fmt: skip
        """The record from an op's keywords (``EXT_PARAMS``)."""
        guide = None if guide_anchor is None else (guide_anchor, guide_block0, guide_block1)
        return cls(threshold, guide, bias, pos_offset, pos_count)

    def op_args(self) -> dict:
        """The op keywords that carry this record (:meth:`of` reads them back); none for a plain
        problem."""
        kw: dict = {}
        if self.threshold is not None:
            kw["threshold"] = self.threshold
        if self.guide is not None:
            kw.update(guide_anchor=self.guide[0], guide_block0=self.guide[1], guide_block1=self.guide[2])
        if self.bias is not None:
            kw["bias"] = self.bias
        if self.pos_count:
            kw.update(pos_offset=self.pos_offset, pos_count=self.pos_count)
        return kw

    def with_positives(self, offset: int, count: int) -> Extensions:
        return dataclasses.replace(self, pos_offset=offset if count else 0, pos_count=count)

    @functools.cached_property
    def filter(self) -> int:
        """The kernels' ``FILTER`` constexpr."""
        kind = "none" if self.threshold is None else "self" if self.guide is None else "guide"
        return FILTER_KINDS.index(kind)

    @functools.cached_property
    def sigmoid(self) -> bool:
        return self.bias is not None

    def role(self, sweep: str) -> str:
        """The config-table role of the sweep ``sweep`` (``fwd``, ``ds``, ``prefix_fwd``,
        ``prefix_ds``) with these extensions (``kernels/configs.py``)."""
        if self.filter == FILTER_KINDS.index("guide"):
            return sweep + "_guide"
        return sweep if self.filter == 0 and not self.sigmoid else sweep + "_ext"


PLAIN = Extensions()

EXT_PARAMS = """``threshold``, ``guide_anchor``, ``guide_block0``, ``guide_block1``: a filter
    (``contract.Filter``: the threshold ``[B]``, or ``[K, B]`` per prefix; the guide embeddings,
    or None for a self filter); ``bias``: the sigmoid reduction (``contract.Sigmoid``);
    ``pos_offset``/``pos_count``: the own positives in block 0 (their ``z = +1``, and the filter
    never drops them): the fields of :class:`Extensions`."""


class _Call:
    """What every launcher of one call shares: device, dtypes, arch, sizes and configs, the
    extensions, the Matryoshka ``dims`` (None: plain, the one-prefix case whose segment is all
    of ``d``) and (after :func:`_prepare`) the row scales and the extensions' device tensors."""

    def __init__(self, anchor: Tensor, block0: Tensor, block1: Tensor, tags0: Tensor, tags1: Tensor, tau: Tensor,
                 ext: Extensions = PLAIN, dims: list[int] | None = None):  # fmt: skip
        _check_layout((anchor, block0, block1, tags0, tags1))
        self.anchor, self.blocks, self.tags = anchor, (block0, block1), (tags0, tags1)
        self.dev, self.dt = anchor.device, anchor.dtype
        self.acc = acc_dtype(self.dt)
        (self.B, self.d), self.sizes = anchor.shape, (block0.shape[0], block1.shape[0])
        self.R = self.B + sum(self.sizes)  # rows of the norms layout: anchors, block 0, block 1
        self.arch = arch_of(self.dev)
        self.dclass = dtype_class(self.dt)
        self.sms = num_sms(self.dev, self.arch)
        self.tau = tau.to(self.acc).reshape(1)
        self.precision = dot_precision(self.dt)
        self._none: Tensor | None = None
        self.ext = ext
        pos = ext.pos_count > 0
        if pos and not (ext.pos_offset >= 0 and ext.pos_offset + self.B * ext.pos_count <= self.sizes[0]):
            raise ValueError(
                f"own positives (offset {ext.pos_offset}, {ext.pos_count} per anchor) do not fit in block 0"
            )
        # the prefixes, shortest first (the sweeps over d meet them in that order): the kernels'
        # segments [lo, hi) of d; outputs go back to the caller's order as out[inverse]
        self.prefixes = dims is not None
        self.K = 1 if dims is None else len(dims)
        if dims is None:
            self.order = self.inverse = None
            self.bounds: Tensor | None = None
            self.segments = [(0, self.d)]
        else:
            self.order, self.inverse = prefix_order(dims)
            ends = [dims[i] for i in self.order]
            self.bounds = plan.int_constant(tuple(ends), self.dev)
            self.segments = list(zip([0, *ends[:-1]], ends))
        # filled by _prepare (filters): the poison [K, R], the guide's row scales and rows
        self.poison: Tensor | None = None
        self.gnorms: Tensor | None = None
        self.guide: tuple[Tensor, Tensor, Tensor] | None = None
        self.thr: Tensor | None = None
        self.stride_thr = 0
        self.bias = None if ext.bias is None else ext.bias.to(self.acc).reshape(1)

    def config(self, sweep: str) -> configs.Config:
        """The config of ``sweep``: a logit-tile sweep (``fwd``, ``ds``) by the extensions' and
        the prefixes' role, any other role as named."""
        if sweep in ("fwd", "ds"):
            sweep = self.ext.role("prefix_" + sweep if self.prefixes else sweep)
        return configs.lookup(sweep, self.arch, self.dclass, self.d)

    @property
    def none(self) -> Tensor:
        """The device's placeholder for pointer arguments a specialisation never reads (one
        lookup per call)."""
        if self._none is None:
            self._none = plan.dummy(self.dev)
        return self._none

    def inputs(self, rows: tuple[Tensor, Tensor, Tensor] | None = None, d: int | None = None) -> RowArgs:
        """The row sets ``rows`` of width ``d`` as the pre-pass and the forward sweep take them
        (default: the call's anchors and blocks)."""
        a, c0, c1 = (self.anchor, *self.blocks) if rows is None else rows
        return RowArgs(a, c0, c1, *self.tags, self.B, *self.sizes, self.d if d is None else d)

    def prefix_args(self) -> PrefixArgs:
        """The sweeps' prefix arguments: the segments' ends, their count and the self filter's
        threshold stride (a plain problem reads none of them)."""
        return PrefixArgs(self.bounds, self.K, self.stride_thr, self.prefixes)

    def ext_args(self) -> ExtArgs:
        """The extensions' arguments both sweeps take (after :func:`_prepare`)."""
        guide, ext = self.guide, self.ext
        g = 0 if guide is None else guide[0].shape[1]
        ga = None if guide is None else guide[0]
        return ExtArgs(self.poison, self.thr, ga, self.gnorms, self.bias, g, ext.filter, ext.sigmoid)

    def guide_rows(self, block: int, c0: int = 0, c1: int | None = None) -> Tensor | None:
        """Rows ``[c0, c1)`` of the guide embeddings of candidate block ``block`` (None: no guide)."""
        if self.guide is None:
            return None
        rows = self.guide[1 + block]
        return rows if c1 is None else rows[c0:c1]

    def own_positives(self, block: int, c0: int, c1: int) -> tuple[int, int]:
        """``(pos_offset, P)`` of the own positives in the columns ``[c0, c1)`` of ``block``, the
        offset relative to ``c0``; ``(0, 0)`` where none fall there (outside block 0: none)."""
        ext = self.ext
        own = block == 0 and ext.pos_count > 0 and c0 < ext.pos_offset + self.B * ext.pos_count and ext.pos_offset < c1
        return (ext.pos_offset - c0, ext.pos_count) if own else (0, 0)

    def to_caller_order(self, x: Tensor, dim: int = 0) -> Tensor:
        """Per-prefix outputs (sorted order along ``dim``) in the caller's dims order."""
        if self.K == 1:
            return x
        inv = plan.int_constant(tuple(self.inverse), self.dev)
        return x.index_select(dim, inv).contiguous()

    def sorted_prefixes(self, x: Tensor) -> Tensor:
        """Per-prefix inputs ``[K, ...]`` in the caller's order, sorted as the kernels read them."""
        if self.K == 1:
            return x
        return x.index_select(0, plan.int_constant(tuple(self.order), self.dev))


# ---------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------


def _norms(call: _Call, rows, d: int, cosine: bool, eps: float, bounds: Tensor | None, out: Tensor,
           clean=(None, None, None), poison: Tensor | None = None) -> Tensor:  # fmt: skip
    """Row scales ``[2, K, R]`` of the row sets ``rows`` (anchors and both blocks, or the guide's)
    of width ``d`` (``norms.py``), one launch; ``clean`` (three outputs) and ``poison [K, R]``:
    the filtered problems' copies with non-finite entries read as zeros, and their poison."""
    cfg = call.config("rows")
    (n0, n1), br = call.sizes, cfg["BR"]
    grid = (plan.cdiv(call.B, br) + plan.cdiv(n0, br) + plan.cdiv(n1, br),)
    args = NormsArgs(call.inputs(rows, d), out, float(eps), cosine, bounds, *clean, poison)
    launch(ROW_NORMS, grid, cfg, **args.kwargs(call.none))
    return out


def _guide_rows(call: _Call) -> tuple[Tensor, Tensor, Tensor]:
    """The guide embeddings in one dtype the tiles can multiply: float64 beside float64 inputs,
    else their own (float32 when they differ or are float64), contiguous."""
    ga, g0, g1 = call.ext.guide
    kinds = {ga.dtype, g0.dtype, g1.dtype}
    if call.dt == torch.float64:
        gdt = torch.float64
    elif len(kinds) == 1 and torch.float64 not in kinds:
        gdt = ga.dtype
    else:
        gdt = torch.float32
    return tuple(t.to(gdt).contiguous() for t in (ga, g0, g1))


def _prepare(call: _Call, cosine: bool, eps: float, norms: Tensor) -> Tensor:
    """The row scales into ``norms [2, K, R]`` (one launch) and, with a filter, what the tiles
    read besides (``contract.Filter``): the inputs with non-finite entries read as zeros (the
    same launch; the call's inputs become these copies) and their poison ``[K, R]``, the guide's
    row scales (one more launch) and the thresholds in sorted prefix order. Returns ``norms``."""
    ext, bounds = call.ext, call.bounds
    if ext.filter == 0:
        return _norms(call, (call.anchor, *call.blocks), call.d, cosine, eps, bounds, norms)
    B, (n0, n1), d, dt, acc, K = call.B, call.sizes, call.d, call.dt, call.acc, call.K
    layout = {
        "clean_a": ((B, d), dt), "clean_0": ((n0, d), dt), "clean_1": ((n1, d), dt), "poison": ((K, call.R), acc),
    }  # fmt: skip
    guide = _guide_rows(call) if ext.guide is not None else None
    if guide is not None:
        layout["gnorms"] = ((2, 1, call.R), acc)
    ws = plan.scratch(call.dev, layout)
    clean = (ws["clean_a"], ws["clean_0"], ws["clean_1"])
    _norms(call, (call.anchor, *call.blocks), d, cosine, eps, bounds, norms, clean, ws["poison"])
    call.anchor, call.blocks, call.poison = clean[0], clean[1:], ws["poison"]
    if guide is not None:
        call.guide, call.gnorms = guide, _norms(call, guide, guide[0].shape[1], True, eps, None, ws["gnorms"])
    thr = ext.threshold.to(acc)
    if thr.dim() == 2:  # a self filter's threshold per prefix, in sorted order
        thr = call.sorted_prefixes(thr)
        call.stride_thr = B
    call.thr = thr.contiguous()
    return norms


def _norms_scratch(call: _Call) -> Tensor:
    """The cached ``[2, K, R]`` row scales of a call (the forward's and the backward's alike)."""
    return plan.scratch(call.dev, {"norms": ((2, call.K, call.R), call.acc)})["norms"]


def _sweep(call: _Call, norms: Tensor) -> tuple[Tensor, int]:
    """The split forward sweep into partials ``[3, slots, K * B]`` (scratch), one launch."""
    K = call.K
    cfg = call.config("fwd")
    (n0, n1), bn, bm = call.sizes, cfg["BN"], cfg["BM"]
    tiles0 = plan.cdiv(n0, bn)
    n_tiles = tiles0 + plan.cdiv(n1, bn)
    row_tiles = plan.cdiv(call.B, bm)
    splits, per = plan.forward_splits(row_tiles, n_tiles, call.sms * cfg.occupancy, call.arch)
    n_slots = max(splits, 1)
    parts = plan.scratch(call.dev, {"parts": ((3, n_slots, K * call.B), call.acc)})["parts"]
    if n_tiles == 0:  # no candidate: one empty slot (the combine gives lse = -inf, or 0 sums)
        parts[0].fill_(0.0 if call.ext.sigmoid else float("-inf"))
        parts[1:].zero_()
        return parts, n_slots
    # prefixes: tiles scaled after the product (one load scale cannot serve prefixes of
    # different norms) and segment ends anywhere
    on_load = plan.scale_on_load(call.dt) and not call.prefixes
    even_k = call.d % cfg["BK"] == 0 and not call.prefixes
    args = FwdArgs(
        call.inputs(),
        NORMS=norms,
        TAU=call.tau,
        PARTS=parts,
        tiles0=tiles0,
        n_tiles=n_tiles,
        tiles_per_split=per,
        n_slots=n_slots,
        SCALE_ON_LOAD=on_load,
        EVEN_K=even_k,
        PRECISION=call.precision,
        ext=call.ext_args(),
        prefix=call.prefix_args(),
        GC0=call.guide_rows(0),
        GC1=call.guide_rows(1),
        pos_offset=call.ext.pos_offset,
        P=call.ext.pos_count,
    )
    launch(FWD, (row_tiles, splits), cfg, **args.kwargs(call.none))
    return parts, n_slots


def _combine(call: _Call, parts: Tensor, n_slots: int, rows: int) -> tuple[Tensor, Tensor]:
    """``(lse, mean_logit)`` ``[rows]`` from the partials (the head kernel with its head off);
    the sigmoid reduction: ``(value [rows], stats [2, rows])``."""
    sigmoid = call.ext.sigmoid
    lse = new_output(rows, dtype=call.acc, device=call.dev)
    mean = new_output((2, rows) if sigmoid else rows, dtype=call.acc, device=call.dev)
    cfg = call.config("head")
    args = HeadArgs(
        parts, call.anchor, call.blocks[0], call.tau, lse, rows, n_slots, call.B, call.d, mean, SIGMOID=sigmoid
    )
    launch(HEAD, (plan.cdiv(rows, cfg["BR"]),), cfg, **args.kwargs(call.none))
    return lse, mean


def _lse_forward(
    anchor: Tensor,
    block0: Tensor,
    block1: Tensor,
    tags0: Tensor,
    tags1: Tensor,
    tau: Tensor,
    cosine: bool,
    eps: float,
    dims: list[int] | None = None,
    threshold: Tensor | None = None,
    guide_anchor: Tensor | None = None,
    guide_block0: Tensor | None = None,
    guide_block1: Tensor | None = None,
    bias: Tensor | None = None,
    pos_offset: int = 0,
    pos_count: int = 0,
) -> tuple[Tensor, Tensor]:
    """``(lse, mean_logit)`` ``[B]`` in the compute dtype, or ``[K, B]`` in ``dims`` order for
    Matryoshka prefixes (every prefix from one pass over ``d``); the sigmoid reduction: ``(value,
    stats [2, ...])``. Extensions: ``EXT_PARAMS``."""
    ext = Extensions.of(threshold, guide_anchor, guide_block0, guide_block1, bias, pos_offset, pos_count)
    call = _Call(anchor, block0, block1, tags0, tags1, tau, ext, dims)
    rows = (call.B,) if dims is None else (call.K, call.B)
    stats = (2, *rows) if ext.sigmoid else rows
    if call.B == 0:
        return new_output(rows, dtype=call.acc, device=call.dev), new_output(stats, dtype=call.acc, device=call.dev)
    norms = _prepare(call, cosine, eps, _norms_scratch(call))
    parts, n_slots = _sweep(call, norms)
    lse, mean = _combine(call, parts, n_slots, call.K * call.B)
    if dims is None:
        return lse, mean
    lse, mean = lse.view(rows), mean.view(stats)
    return call.to_caller_order(lse), call.to_caller_order(mean, 1 if ext.sigmoid else 0)


def _head_forward(
    anchor: Tensor,
    block0: Tensor,
    block1: Tensor,
    tags0: Tensor,
    tags1: Tensor,
    tau: Tensor,
    cosine: bool,
    eps: float,
    kind: str,
    pos_offset: int,
    pos_count: int,
    pos_logits: Tensor | None,
    pos_mask: Tensor | None,
    log_extra: Tensor | None,
    weights: Tensor,
    per_row: bool,
    threshold: Tensor | None = None,
    guide_anchor: Tensor | None = None,
    guide_block0: Tensor | None = None,
    guide_block1: Tensor | None = None,
    own_offset: int = 0,
    own_count: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The loss step's forward: ``(loss, lse, dlse, dpos, w_row, norms)``. A filter (``threshold``,
    the guide embeddings: ``EXT_PARAMS``) never drops the own positives ``own_offset``,
    ``own_count`` of block 0 (the folded ones when ``pos_logits`` is None).

    ``loss``: the reduced ``sum_i weights_i * loss_i`` (0-d, input dtype) or, ``per_row``, the
    rows ``[B]`` (compute dtype). Own positives are ``pos_count`` rows per anchor of block 0
    from ``pos_offset`` (``pos_logits`` None: their logits are formed here) or the given
    ``pos_logits [B, P]``; ``pos_mask [B, P]`` bool, ``log_extra [B]``, ``weights [B]``. Kept
    for :func:`_head_backward`: ``lse``, ``dlse [B]``, ``dpos [B, P]`` (dLoss/d own-positive
    logits before the weights), ``w_row [B]`` (the temperature gradient is
    ``-sum_i s_i w_row_i / tau``, ``s`` the weights times the upstream gradient) and the row
    scales ``norms [2, 1, R]``."""
    B, P, folded = anchor.shape[0], pos_count, pos_logits is None
    if kind not in KINDS:
        raise ValueError(f"unknown head {kind!r}; expected one of {sorted(KINDS)}")
    if not 1 <= P <= MAX_OWN:
        raise ValueError(f"the fused head takes 1..{MAX_OWN} positives per anchor, got {P}")
    if folded and not (pos_offset >= 0 and pos_offset + B * P <= block0.shape[0]):
        raise ValueError(f"own positives (offset {pos_offset}, {P} per anchor, {B} anchors) do not fit in block 0")
    own = (pos_offset, P) if folded else (own_offset, own_count)
    ext = Extensions.of(threshold, guide_anchor, guide_block0, guide_block1, None, *own)
    call = _Call(anchor, block0, block1, tags0, tags1, tau, ext)
    acc, dev = call.acc, call.dev
    norms = new_output((2, 1, call.R), dtype=acc, device=dev)
    lse = new_output(B, dtype=acc, device=dev)
    dlse = new_output(B, dtype=acc, device=dev)
    dpos = new_output((B, P), dtype=acc, device=dev)
    w_row = new_output(B, dtype=acc, device=dev)
    loss = new_output(B if per_row else (), dtype=acc if per_row else call.dt, device=dev)
    if B == 0:
        if not per_row:
            loss.zero_()
        return loss, lse, dlse, dpos, w_row, norms
    _prepare(call, cosine, eps, norms)
    parts, n_slots = _sweep(call, norms)
    cfg = call.config("head")
    programs = plan.cdiv(B, cfg["BR"])
    partial = plan.scratch(dev, {"partial": ((programs,), acc)})["partial"]
    poisoned = call.poison is not None and folded
    args = HeadArgs(
        parts,
        call.anchor,
        call.blocks[0],
        call.tau,
        lse,
        n_rows=B,
        n_slots=n_slots,
        B=B,
        d=call.d,
        NORMS=norms,
        POISON=call.poison if poisoned else None,
        POS_IN=None if folded else pos_logits.to(acc).contiguous(),
        MASK=None if pos_mask is None else pos_mask.contiguous().view(torch.uint8),
        LOG_EXTRA=None if log_extra is None else log_extra.to(acc).contiguous(),
        WEIGHTS=weights.contiguous(),
        DLSE=dlse,
        DPOS=dpos,
        WROW=w_row,
        ROWS=loss if per_row else None,
        PARTIAL=partial,
        P=P,
        pos_offset=pos_offset if folded else 0,
        HEAD=True,
        POISONED=poisoned,
        KIND=KINDS[kind],
        FOLDED=folded,
        SCALE_ON_LOAD=plan.scale_on_load(call.dt),
    )
    launch(HEAD, (programs,), cfg, **args.kwargs(call.none))
    if not per_row:
        launch(SUM, (1,), call.config("rows"), PARTIAL=partial, OUT=loss, n=programs)
    return loss, lse, dlse, dpos, w_row, norms


# ---------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------


def _zero_grads(call: _Call) -> tuple[Tensor, Tensor, Tensor]:
    out = (torch.zeros_like(call.anchor), *(torch.zeros_like(b) for b in call.blocks))
    return out


def _cols(t: Tensor | None, lo: int, hi: int) -> Tensor | None:
    """Columns ``[lo, hi)`` of a row-major matrix: a prefix segment (the matrix itself for the
    plain problem's one segment, all of ``d``)."""
    if t is None or (lo == 0 and hi == t.shape[1]):
        return t
    return t[:, lo:hi]


def _segment(t: Tensor | None, j: int) -> Tensor | None:
    """Segment ``j``'s radial weights in a buffer ``[parts, K, n]``: the GEMM reads its pointer
    and strides (the buffer itself for one prefix, no view on the plain path)."""
    if t is None or t.shape[1] == 1:
        return t
    return t[:, j]


class _Upstream(NamedTuple):
    """What the backward reads besides the inputs: the row scales, ``lse``, the rows' gradient
    ``g_rows`` (times the reduction weights ``row_w`` and the upstream gradient ``go``, 0-d or
    ``[B]`` with ``go_per_row``, where given: the fused head's), the own positives' ``d_pos``
    and the rows' ``<G, l>`` before scaling, ``w_row`` (the fused head's; None: summed from
    the dS tiles)."""

    norms: Tensor
    lse: Tensor
    g_rows: Tensor
    row_w: Tensor | None = None
    go: Tensor | None = None
    go_per_row: bool = False
    d_pos: Tensor | None = None
    w_row: Tensor | None = None

    @property
    def go_mode(self) -> int:
        """The kernels' ``GO_MODE`` and ``RADIAL_SCALE``: 0 no upstream gradient, 1 one, 2 one per row."""
        return 0 if self.go is None else 2 if self.go_per_row else 1


class _Chunk(NamedTuple):
    """A dS chunk: the columns ``[c0, c1)`` of candidate block ``block``, the first of them in
    the norms layout (``base``), its first column tile among all chunks' (``tile0``), and its
    views: rows ``blk`` and ``tags``, row scales ``ic``/``rc`` (made once: a view costs the host
    a few us)."""

    block: int
    c0: int
    c1: int
    base: int
    tile0: int
    first: bool
    last: bool
    blk: Tensor
    tags: Tensor
    ic: Tensor
    rc: Tensor


class _ChunkPlan:
    """The backward's plan (``lse_bwd.py``): the dS dtype, the configs, the chunks of each
    candidate block (``plan.chunks``, at most ``triton.ds_bytes`` of dS each, K prefixes' tiles
    included), the scratch (dS ``[K, B, W]``, the radial partial sums ``colw [row tiles, K, W]``
    (cosine) and ``roww [col tiles, K, B]`` (``row_sums``), the anchors' fp32 accumulator across
    chunks) and the launches' arguments: the ds launches' common ones built once (``ds``),
    a chunk's by :meth:`ds_chunk`, the GEMMs' by :meth:`products`."""

    def __init__(self, call: _Call, up: _Upstream, cosine: bool, fp32_ds: bool, padded: bool):
        B, d, K, dt = call.B, call.d, call.K, call.dt
        self.call, self.up, self.cosine, self.padded = call, up, cosine, padded
        self.row_sums = cosine and up.w_row is None
        # the prefixes' suffix sums would add rounded terms: always fp32
        self.ds_type = plan.ds_dtype(dt, fp32_ds or call.prefixes)
        self.ds_cfg = call.config("ds")
        self.mm_cfg = call.config("mm_split" if self.ds_type != dt else "mm")
        align = plan.chunk_align(self.ds_cfg, self.mm_cfg)
        elt = torch.empty((), dtype=self.ds_type).element_size()
        width = tuple(plan.chunk_width(K * B, n, d, elt, align, call.arch) for n in call.sizes)
        spans = plan.chunks(call.sizes, width)
        self.W = W = max(c1 - c0 for _, c0, c1 in spans)
        self.bm, self.bn = self.ds_cfg["BM"], self.ds_cfg["BN"]
        self.chunks: list[_Chunk] = []
        tile0 = 0
        for i, (block, c0, c1) in enumerate(spans):
            base = B + (0 if block == 0 else call.sizes[0]) + c0
            views = call.blocks[block][c0:c1], call.tags[block][c0:c1], *up.norms[:, 0, base : base + c1 - c0]
            self.chunks.append(_Chunk(block, c0, c1, base, tile0, i == 0, i == len(spans) - 1, *views))
            tile0 += plan.cdiv(c1 - c0, self.bn)
        self.ia, self.ra = up.norms[:, 0, :B]
        self.col_tiles = tile0
        layout = {"ds": ((K, B, W), self.ds_type)}
        if cosine:
            layout["colw"] = ((plan.cdiv(B, self.bm), K, W), call.acc)
        if self.row_sums:
            layout["roww"] = ((self.col_tiles, K, B), call.acc)
        if len(self.chunks) > 1:
            layout["d_anchor_acc"] = ((B, d), call.acc)
        self.ws = ws = plan.scratch(call.dev, layout)
        # the prefixes' dS has their norms folded in (they differ per prefix) and their radial sums
        # come multiplied by rinv_k^2: the GEMMs then scale nothing (row scales of one)
        fold = plan.fold_norms(dt, cosine) or call.prefixes
        on_load = plan.scale_on_load(dt) and not call.prefixes
        self.scale_mm = cosine and not fold  # the GEMMs normalise Y's rows and scale output rows
        self.ones = plan.ones(max(B, W), call.acc, call.dev) if call.prefixes and cosine else None
        self.ds = DsArgs(
            call.anchor,
            up.norms,
            call.tau,
            up.lse,
            up.g_rows,
            ws["ds"],
            B=B,
            d=d,
            R=call.R,
            stride_ds=W,
            COSINE=cosine,
            SCALE_ON_LOAD=on_load,
            FOLD_NORMS=fold,
            GO_MODE=up.go_mode,
            EVEN_K=d % self.ds_cfg["BK"] == 0 and not call.prefixes,
            PRECISION=call.precision,
            ext=call.ext_args(),
            prefix=call.prefix_args(),
            ROW_W=up.row_w,
            GO=up.go,
            ROWW=ws.get("roww"),
            COLW=ws.get("colw"),
        )

    def ds_chunk(self, c: _Chunk) -> DsChunk:
        """Chunk ``c``'s part of its ds launch: its columns, guide rows and own positives (the
        offset relative to the chunk), and a persistent grid of ``n_progs`` programs."""
        call, nc = self.call, c.c1 - c.c0
        pos_offset, P = call.own_positives(c.block, c.c0, c.c1)
        progs = min(plan.cdiv(call.B, self.bm) * plan.cdiv(nc, self.bn), call.sms * self.ds_cfg.occupancy)
        dpos = self.up.d_pos if P > 0 else None
        gc = call.guide_rows(c.block, c.c0, c.c1)
        return DsChunk(c.blk, c.tags, dpos, gc, nc, c.base, c.tile0, progs, pos_offset, P)

    def products(self, c: _Chunk, j: int, d_anchor: Tensor, d_blocks: tuple[Tensor, ...]) -> tuple[Product, Product]:
        """Chunk ``c``'s two GEMMs on prefix segment ``j`` (a plain problem: one, all of ``d``):
        the candidates' gradient ``dS^T @ A`` (dS read transposed through its strides; complete)
        and the anchors' ``dS @ C[chunk]``, accumulated over the chunks in a fixed order, the
        last adding the radial term."""
        call, up, ws, B, K = self.call, self.up, self.ws, self.call.B, self.call.K
        lo, hi = call.segments[j]
        nc, scale, cosine, radial = c.c1 - c.c0, self.scale_mm, self.cosine, self.cosine and c.last
        blk, tags, ia, ra, ic, rc = c.blk, c.tags, self.ia, self.ra, c.ic, c.rc
        ds, acc = ws["ds"][j, :, :nc], ws.get("d_anchor_acc")
        d_candidates = Product(
            ds,
            _cols(call.anchor, lo, hi),
            _cols(d_blocks[c.block][c.c0 : c.c1], lo, hi),
            tags,
            x_transposed=True,
            kscale=ia if scale else None,
            mscale=ic if scale else None,
            rinv=(self.ones if call.prefixes else rc) if cosine else None,
            radw=_segment(ws.get("colw"), j),
            n_parts=plan.cdiv(B, self.bm),
            stride_radw=K * self.W,
            z=_cols(blk, lo, hi) if cosine else None,
        )
        if self.row_sums:
            weights: dict = dict(radw=_segment(ws["roww"], j), n_parts=self.col_tiles, stride_radw=K * B)
        else:
            weights = dict(radw=up.w_row, n_parts=1, stride_radw=B, rscale=up.row_w, go=up.go, radial_scale=up.go_mode)
        d_anchor_part = Product(
            ds,
            _cols(blk, lo, hi),
            _cols(d_anchor if c.last else acc, lo, hi),
            tags,
            x_transposed=False,
            pad=self.padded,
            acc_in=None if c.first else _cols(acc, lo, hi),
            kscale=ic if scale else None,
            mscale=ia if scale else None,
            rinv=(self.ones if call.prefixes else ra) if radial else None,
            z=_cols(call.anchor, lo, hi) if radial else None,
            **weights,
        )
        return d_candidates, d_anchor_part


def _backward(call: _Call, up: _Upstream, cosine: bool, fp32_ds: bool, padded: bool = True) -> tuple[Tensor, ...]:
    """The chunked backward sweep (``lse_bwd.py``), plain or Matryoshka: per dS chunk one ds
    launch, then per prefix segment the two GEMMs (a plain problem: one segment, all of ``d``);
    ``d_pos`` is folded at the own positives of ``call.ext``. With prefixes the ds kernel
    writes suffix sums ``T_j`` of the prefixes' dS and coordinate ``j`` of a row gets the
    gradients of the prefixes ``k >= seg(j)`` (docs/triton.md, "Matryoshka prefixes")."""
    B, d, dt, dev = call.B, call.d, call.dt, call.dev
    d_anchor = new_output((B, d), dtype=dt, device=dev)
    d_blocks = tuple(new_output(b.shape, dtype=dt, device=dev) for b in call.blocks)
    if call.prefixes:  # coordinates beyond every prefix get no gradient
        top = call.segments[-1][1]
        for t in (d_anchor, *d_blocks):
            t[:, top:].zero_()
    p = _ChunkPlan(call, up, cosine, fp32_ds, padded)
    common = p.ds.kwargs(call.none)  # the ds launches' common keywords, once per backward
    for chunk in p.chunks:
        part = p.ds_chunk(chunk)
        launch(DS, (part.n_progs,), p.ds_cfg, **common, **part.kwargs(call.none))
        if call.prefixes and cosine:  # the radial weights of segment j: prefixes k >= j
            _suffix_sums_(p.ws["colw"].transpose(0, 1))
            if chunk.last:
                _suffix_sums_(p.ws["roww"].transpose(0, 1))
        for j in range(call.K):
            for product in p.products(chunk, j, d_anchor, d_blocks):
                _gemm(call, p.mm_cfg, product)
    return (d_anchor, *d_blocks)


def _suffix_sums_(x: Tensor) -> Tensor:
    """``x[j] = sum_{k >= j} x[k]`` along dim 0, in place (K <= 8 small adds, fixed order)."""
    for j in range(x.shape[0] - 2, -1, -1):
        x[j] += x[j + 1]
    return x


def _gemm(call: _Call, cfg, product: Product) -> None:
    """One backward product (``matmul.py``) on a persistent grid sized to the device."""
    # a size-1 dimension may carry any stride (a [n, 1] slice of a transposed input is contiguous)
    if any(t.shape[1] > 1 and t.stride(1) != 1 for t in (product.X, product.Y, product.OUT)):
        raise ValueError("the backward GEMM takes row-major operands (a dS chunk, contiguous rows)")
    M, N = product.OUT.shape
    progs = max(1, min(plan.cdiv(M, cfg["BM"]) * plan.cdiv(N, cfg["BN"]), call.sms * cfg.occupancy))
    launch(MM, (progs,), cfg, **product.kwargs(cfg, call.precision, progs, call.none))


def _lse_backward(
    anchor: Tensor,
    block0: Tensor,
    block1: Tensor,
    tags0: Tensor,
    tags1: Tensor,
    tau: Tensor,
    lse: Tensor,
    g: Tensor,
    d_pos: Tensor | None,
    cosine: bool,
    eps: float,
    fp32_ds: bool,
    dims: list[int] | None = None,
    threshold: Tensor | None = None,
    guide_anchor: Tensor | None = None,
    guide_block0: Tensor | None = None,
    guide_block1: Tensor | None = None,
    bias: Tensor | None = None,
    pos_offset: int = 0,
    pos_count: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``d anchor, d block0, d block1`` (input dtype) from ``g = dLoss/dlse`` (the sigmoid
    reduction: ``dLoss/dvalue``; ``lse`` is not read), ``[B]``, or ``[K, B]`` in ``dims`` order
    for Matryoshka prefixes (their gradients summed; dS always fp32).

    ``d_pos [B, P]`` (``[K, B, P]``; or None): gradient of the own-positive logits, anchor
    ``i``'s positive ``k`` being row ``pos_offset + i * P + k`` of block 0; folded into dS
    (float32). Extensions: ``EXT_PARAMS`` (``pos_count``: the own positives' count when
    ``d_pos`` is None).
    """
    count = pos_count if d_pos is None else d_pos.shape[-1]
    ext = Extensions.of(threshold, guide_anchor, guide_block0, guide_block1, bias).with_positives(pos_offset, count)
    call = _Call(anchor, block0, block1, tags0, tags1, tau, ext, dims)
    too_big = plan.size_reasons(call.B, call.d)
    if too_big:
        raise ValueError(f"triton LSE backward: {too_big[0]}")
    if call.B == 0 or sum(call.sizes) == 0:  # no anchor or no candidate: every gradient is zero
        return _zero_grads(call)
    norms = _prepare(call, cosine, eps, _norms_scratch(call))
    lse, g = (call.sorted_prefixes(t).to(call.acc).contiguous() for t in (lse, g))
    dpos = None if d_pos is None or ext.sigmoid else call.sorted_prefixes(d_pos).to(call.acc).contiguous()
    return _backward(call, _Upstream(norms, lse, g, d_pos=dpos), cosine, fp32_ds)


def _head_backward(
    anchor: Tensor,
    block0: Tensor,
    block1: Tensor,
    tags0: Tensor,
    tags1: Tensor,
    tau: Tensor,
    norms: Tensor,
    lse: Tensor,
    dlse: Tensor,
    dpos: Tensor,
    w_row: Tensor,
    weights: Tensor,
    grad_out: Tensor,
    pos_offset: int,
    folded: bool,
    cosine: bool,
    fp32_ds: bool,
    padded: bool,
    threshold: Tensor | None = None,
    guide_anchor: Tensor | None = None,
    guide_block0: Tensor | None = None,
    guide_block1: Tensor | None = None,
    own_offset: int = 0,
    own_count: int = 0,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`_head_forward`'s loss for the upstream ``grad_out`` (0-d for the
    reduced loss, ``[B]`` for rows), without a host read: ``g_i = dlse_i * weights_i * go``
    (rows: ``dlse_i * go_i``) is formed inside the ds kernel, and the anchors' radial term
    comes from the forward's ``w_row``. A filter (as :func:`_head_forward`'s) runs the row pass
    again (the inputs read as zeros where non-finite; ``eps`` as the forward's)."""
    own = (pos_offset, dpos.shape[1]) if folded else (own_offset, own_count)
    ext = Extensions.of(threshold, guide_anchor, guide_block0, guide_block1, None, *own)
    call = _Call(anchor, block0, block1, tags0, tags1, tau, ext)
    if call.B == 0 or sum(call.sizes) == 0:
        return _zero_grads(call)
    if ext.filter:
        norms = _prepare(call, cosine, eps, _norms_scratch(call))
    per_row = grad_out.dim() > 0
    row_w = None if per_row else weights
    up = _Upstream(norms, lse, dlse, row_w, grad_out.contiguous(), per_row, dpos if folded else None, w_row)
    return _backward(call, up, cosine, fp32_ds, padded)


lse_forward = register_op("fastcl_triton::lse_forward", _lse_forward)
lse_backward = register_op("fastcl_triton::lse_backward", _lse_backward)
head_forward = register_op("fastcl_triton::head_forward", _head_forward)
head_backward = register_op("fastcl_triton::head_backward", _head_backward)
