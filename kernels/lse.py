"""Masked cosine-LSE forward and backward kernels, their launchers and ``torch.library`` ops.

The contract is ``fastcl/ops/contract.py``: anchors ``A [B, d]``, candidate blocks
``C0 [N0, d]``, ``C1 [N1, d]`` with int32 tags, ``l_ic = <a_i, c> * ia_i * ic_c / tau``
where ``ia, ic`` are inverse clamped norms (1 for dot similarity).

Pre-pass (cosine only)
    ``_row_norms_kernel`` writes ``inv = 1 / max(|x|, eps)`` and ``rad = inv^2`` (0 where the
    norm is clamped) per row: O(B + N) floats. The kernels then take raw dot products
    (bf16/fp16 operands, fp32 accumulation) and scale the tile: no normalised copy of any
    input exists, and nothing is rounded to 16 bits after normalising.

Forward (never a B x N buffer)
    ``_lse_fwd_kernel``: a program owns ``BM`` anchor rows and one contiguous *split* of a
    block's columns; it streams ``BN``-column tiles, each a GEMM main loop over ``d`` in
    ``BK`` chunks, applies the structural mask and keeps an online max / sum / weighted
    logit sum. Splits (flash-decoding style) give enough programs when ``B / BM`` alone
    would leave most SMs idle; ``_lse_combine_kernel`` merges them in a fixed order and
    writes ``lse`` and ``mean_logit``.

Backward (recompute from ``lse``)
    The gradient of a logit is ``G_ic = g_i * softmax_ic``. With ``d`` up to 1024 a row of
    ``d anchor`` does not fit in registers beside a logit tile (a [64, 768] fp32
    accumulator alone is 192 KB, most of an SM's register file), so the two products with
    ``G`` run as GEMMs on a bounded *chunk* of recomputed ``dS`` instead:

    for each chunk of ``R`` columns of one block (``B x R`` elements, default <= 32 MiB)::

        _lse_ds_kernel   recompute the logit tiles, dS = G * ia * ic / tau (input dtype),
                         plus partial sums of G * l per row and per column (radial terms)
        _sum_parts       row sums accumulate over chunks (fixed order)
        _mm  dC[chunk] = dS^T @ A  - ic^2 <G, l>_col * C[chunk]         (complete, K = B)
        _mm  dA       += dS @ C[chunk]; last chunk: - ia^2 <G, l>_row * A

    Four GEMM-sized passes in all (forward, recompute, two products), the ``8 B N d`` FLOPs
    of the contract, with every product on tensor cores. Deterministic: each output
    element has one owner, reductions run in a fixed order, no atomics. Extra memory:
    the dS chunk, an fp32 ``[B, d]`` accumulator (only with several chunks), partial
    sums and norms: :func:`backward_plan` lists every buffer and the launcher allocates
    nothing else.

    fp16 only: ``ia * ic / tau`` can leave fp16's range for small or large norms, so dS
    keeps ``G / tau`` and the GEMMs normalise the ``Y`` operand rows on load instead
    (``FOLD_NORMS=False``); bf16, fp32 and fp64 fold the norms into dS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastcl.ops.contract import new_output

from ._common import (
    Cfg,
    Spec,
    Tuned,
    TRITON_TYPE,
    acc_dtype,
    arch_of,
    cast_to,
    dot_precision,
    dtype_class,
    dummy,
    launch,
    load_tags,
    online_lse,
    raw_dot_tile,
    register_op,
    sqrt_rn,
    structural_mask,
)
from .matmul import MM

# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _row_norms_kernel(X, INV, RAD, n_rows, d, eps, BR: tl.constexpr, BD: tl.constexpr):
    ACC: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < n_rows
    ss = tl.zeros([BR], dtype=ACC)
    for k0 in range(0, d, BD):
        ks = k0 + tl.arange(0, BD)
        x = tl.load(X + rows[:, None] * d + ks[None, :], mask=ok[:, None] & (ks < d)[None, :], other=0.0).to(ACC)
        ss += tl.sum(x * x, 1)
    norm = sqrt_rn(ss)
    inv = 1.0 / tl.maximum(norm, eps)
    tl.store(INV + rows, inv, mask=ok)
    tl.store(RAD + rows, tl.where(norm > eps, inv * inv, 0.0), mask=ok)


@triton.jit
def _logits(s, rows, cols, B, NC, IA, IC, inv_tau, COSINE: tl.constexpr):
    """Raw dot tile -> logits (scaled by inverse norms and 1/tau)."""
    if COSINE:
        ia = tl.load(IA + rows, mask=rows < B, other=0.0)
        ic = tl.load(IC + cols, mask=cols < NC, other=0.0)
        return s * (ia * inv_tau)[:, None] * ic[None, :]
    else:
        return s * inv_tau


@triton.jit
def _lse_fwd_kernel(
    A, C, TAGS, IA, IC, TAU, PARTS,
    B, NC, d, split_width, split_base, n_slots,
    tune_m, tune_n, tune_d,
    COSINE: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    ACC: tl.constexpr = tl.float64 if A.dtype.element_ty == tl.float64 else tl.float32
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    inv_tau = 1.0 / tl.load(TAU)
    m = tl.full([BM], float("-inf"), dtype=ACC)
    l = tl.zeros([BM], dtype=ACC)
    u = tl.zeros([BM], dtype=ACC)
    c_begin = pid_s * split_width
    c_end = tl.minimum(c_begin + split_width, NC)
    for c0 in range(c_begin, c_end, BN):
        cols = c0 + tl.arange(0, BN)
        col_ok = cols < c_end
        tags = load_tags(TAGS, cols, col_ok)
        s = raw_dot_tile(A, C, rows, cols, B, c_end, d, d, d, BM, BN, BK, ACC, PRECISION)
        logits = _logits(s, rows, cols, B, NC, IA, IC, inv_tau, COSINE)
        m, l, u = online_lse(m, l, u, logits, structural_mask(rows, B, tags, col_ok))
    slot = split_base + pid_s
    ok = rows < B
    tl.store(PARTS + slot * B + rows, m, mask=ok)
    tl.store(PARTS + (n_slots + slot) * B + rows, l, mask=ok)
    tl.store(PARTS + (2 * n_slots + slot) * B + rows, u, mask=ok)


@triton.jit
def _lse_combine_kernel(PARTS, LSE, MEAN_LOGIT, B, n_slots, BR: tl.constexpr):
    ACC: tl.constexpr = PARTS.dtype.element_ty
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < B
    m = tl.full([BR], float("-inf"), dtype=ACC)
    for s in range(0, n_slots):
        m = tl.maximum(m, tl.load(PARTS + s * B + rows, mask=ok, other=float("-inf")))
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BR], dtype=ACC)
    u = tl.zeros([BR], dtype=ACC)
    for s in range(0, n_slots):
        w = tl.exp(tl.load(PARTS + s * B + rows, mask=ok, other=float("-inf")) - m_ref)
        l += w * tl.load(PARTS + (n_slots + s) * B + rows, mask=ok, other=0.0)
        u += w * tl.load(PARTS + (2 * n_slots + s) * B + rows, mask=ok, other=0.0)
    nonempty = l > 0
    l_safe = tl.where(nonempty, l, 1.0)  # an empty row: -inf and 0 without log(0) or 0/0
    tl.store(LSE + rows, tl.where(nonempty, m_ref + tl.log(l_safe), float("-inf")), mask=ok)
    tl.store(MEAN_LOGIT + rows, tl.where(nonempty, u / l_safe, 0.0), mask=ok)


@triton.jit
def _lse_ds_kernel(
    A, C, TAGS, IA, IC, TAU, LSE, G, DPOS, DS, ROWW, COLW,
    B, NC, d, stride_ds, stride_roww, stride_colw, n_row_parts, n_col_parts, pos_offset, pos_count,
    tune_m, tune_n, tune_d,
    COSINE: tl.constexpr, FOLD_NORMS: tl.constexpr, FOLD_POS: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PART: tl.constexpr,
):
    ACC: tl.constexpr = tl.float64 if A.dtype.element_ty == tl.float64 else tl.float32
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < B
    col_ok = cols < NC
    inv_tau = 1.0 / tl.load(TAU)
    tags = load_tags(TAGS, cols, col_ok)
    s = raw_dot_tile(A, C, rows, cols, B, NC, d, d, d, BM, BN, BK, ACC, PRECISION)
    logits = _logits(s, rows, cols, B, NC, IA, IC, inv_tau, COSINE)
    keep = structural_mask(rows, B, tags, col_ok)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    g = tl.load(G + rows, mask=row_ok, other=0.0)
    grad = tl.where(keep, tl.exp(logits - lse[:, None]), 0.0) * g[:, None]  # dLoss/dlogit
    if FOLD_POS:
        # the own-positive logits' gradient d_pos [B, P] (contract: OwnPositives): column c
        # is positive k = c - pos_offset - row * P of its row; added to the float32 dS
        # before any rounding, whatever the tag (as the torch backend's _fold_positives)
        k = cols[None, :] - pos_offset - rows[:, None] * pos_count
        is_pos = (k >= 0) & (k < pos_count) & row_ok[:, None] & col_ok[None, :]
        grad += tl.load(DPOS + rows[:, None] * pos_count + k, mask=is_pos, other=0.0)
    if COSINE:
        # <G, l> per row and per column, for the radial part of the normalisation
        # backward; stored per PART-wide group so the layout does not depend on BM/BN
        gl = grad * logits
        row_sums = tl.sum(tl.reshape(gl, [BM, BN // PART, PART]), 2)
        col_groups = pid_n * (BN // PART) + tl.arange(0, BN // PART)
        tl.store(ROWW + col_groups[None, :] * stride_roww + rows[:, None], row_sums,
                 mask=row_ok[:, None] & (col_groups < n_col_parts)[None, :])
        col_sums = tl.sum(tl.reshape(gl, [BM // PART, PART, BN]), 1)
        row_groups = pid_m * (BM // PART) + tl.arange(0, BM // PART)
        tl.store(COLW + row_groups[:, None] * stride_colw + cols[None, :], col_sums,
                 mask=(row_groups < n_row_parts)[:, None] & col_ok[None, :])
    ds = grad * inv_tau
    if FOLD_NORMS:
        ia = tl.load(IA + rows, mask=row_ok, other=0.0)
        ic = tl.load(IC + cols, mask=col_ok, other=0.0)
        ds = ds * ia[:, None] * ic[None, :]
    tl.store(DS + rows[:, None] * stride_ds + cols[None, :], cast_to(ds, DS.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_parts_kernel(PARTS, OUT, n, n_parts, stride_p, ACCUMULATE: tl.constexpr, BR: tl.constexpr):
    j = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = j < n
    if ACCUMULATE:
        acc = tl.load(OUT + j, mask=ok, other=0.0)
    else:
        acc = tl.zeros([BR], dtype=OUT.dtype.element_ty)
    for p in range(0, n_parts):
        acc += tl.load(PARTS + p * stride_p + j, mask=ok, other=0.0)
    tl.store(OUT + j, acc, mask=ok)


# ---------------------------------------------------------------------------------------
# tuning tables (see _common.Tuned); block sizes are multiples of 16
# ---------------------------------------------------------------------------------------

_C = Cfg.of
_ROWWISE = {a: {"16": [_C(4, 1, BR=32, BD=128)]} for a in ("sm80", "sm90")}
_ROWWISE["interp"] = {"16": [_C(BR=16, BD=64)]}
_REDUCE = {a: {"16": [_C(4, 1, BR=256)]} for a in ("sm80", "sm90")}
_REDUCE["interp"] = {"16": [_C(BR=16)]}

# Logit tiles: a GEMM main loop over d with an online-softmax (forward) or gradient
# (backward) epilogue; sm_80 mma.sync, sm_90 wgmma. Chosen from compiled candidates with
# `python -m fastcl.kernels.aot` (docs/triton.md has registers and spills per config):
# * the epilogue keeps about three [BM, BN] fp32 tensors live (logits, mask, p), so a
#   thread may own at most 32 tile elements (BM * BN <= 1024 * num_warps): 64x64 on 4
#   warps, 128x64 on 8; 128x128 on 8 warps and every BK=64 config on sm_80 spilled;
# * BK=32 with 4 stages keeps the operand loads small beside the epilogue (BK=64 spilled
#   on sm_80); on sm_90 wgmma keeps its accumulator out of the general registers' way
#   enough that 128x64x64 and 64x128x64 do not spill, and are offered to the tuner;
# * fp32 (3xTF32: three MMAs and hi/lo splits per product) needs BK=16 to stay spill-free
#   on sm_80; fp64 (no fp64 tensor-core path worth tuning) gets 32-row tiles.
_TILES = {
    "sm80": {
        "16": [_C(8, 4, BM=128, BN=64, BK=32), _C(4, 4, BM=64, BN=64, BK=32)],
        "32": [_C(4, 3, BM=64, BN=64, BK=16), _C(8, 3, BM=128, BN=64, BK=16)],
        "64": [_C(4, 2, BM=32, BN=64, BK=16), _C(4, 2, BM=32, BN=32, BK=16)],
    },
    "sm90": {
        "16": [_C(8, 4, BM=128, BN=64, BK=32), _C(8, 3, BM=128, BN=64, BK=64), _C(8, 3, BM=64, BN=128, BK=64),
               _C(4, 4, BM=64, BN=64, BK=32)],
        "32": [_C(4, 3, BM=64, BN=64, BK=16), _C(8, 3, BM=128, BN=64, BK=16), _C(8, 3, BM=64, BN=64, BK=32)],
        "64": [_C(4, 2, BM=32, BN=64, BK=16), _C(4, 2, BM=32, BN=32, BK=16)],
    },
    # interpreter: 16-wide tiles so small test shapes cross tile edges; BK=32 halves the
    # (Python-speed) feature loop, d > 32 still crosses its edge
    "interp": {"16": [_C(BM=16, BN=16, BK=32)]},
}
_TUNE_KEY = ["tune_m", "tune_n", "tune_d"]

ROW_NORMS = Tuned(_row_norms_kernel, _ROWWISE, key=[])
FWD = Tuned(_lse_fwd_kernel, _TILES, key=_TUNE_KEY)
COMBINE = Tuned(_lse_combine_kernel, _REDUCE, key=[])


def _with_part(table: dict[str, dict[str, list[Cfg]]]) -> dict[str, dict[str, list[Cfg]]]:
    """The ds kernel's table: the tile table plus PART, the granularity of its partial sums
    (the smallest block size of the list, so it divides every BM and BN; buffers sized
    with it fit whichever config the autotuner picks)."""
    out = {}
    for arch, by_class in table.items():
        out[arch] = {}
        for dc, cfgs in by_class.items():
            part = min(min(c.kwargs["BM"], c.kwargs["BN"]) for c in cfgs)
            out[arch][dc] = [Cfg.of(c.num_warps, c.num_stages, PART=part, **c.kwargs) for c in cfgs]
    return out


DS = Tuned(_lse_ds_kernel, _with_part(_TILES), key=_TUNE_KEY)
SUM_PARTS = Tuned(_sum_parts_kernel, _REDUCE, key=[])

KERNELS = (ROW_NORMS, FWD, COMBINE, DS, SUM_PARTS, MM)

# ---------------------------------------------------------------------------------------
# specialisations: the one definition of what each launch site passes (aot.py enumerates
# these functions; launch() checks every real launch against them)
# ---------------------------------------------------------------------------------------


def _t(dtype: torch.dtype) -> str:
    return "*" + TRITON_TYPE[dtype]


def _scales_type(dtype: torch.dtype, used: bool) -> str:
    return _t(acc_dtype(dtype)) if used else "*fp32"


def row_norms_spec(dtype: torch.dtype) -> Spec:
    acc = _t(acc_dtype(dtype))
    sig = {"X": _t(dtype), "INV": acc, "RAD": acc, "n_rows": "i32", "d": "i32", "eps": "fp32"}
    return Spec.make(ROW_NORMS, "16", sig, {})


def fwd_spec(dtype: torch.dtype, cosine: bool) -> Spec:
    sc, acc = _scales_type(dtype, cosine), _t(acc_dtype(dtype))
    sig = {"A": _t(dtype), "C": _t(dtype), "TAGS": "*i32", "IA": sc, "IC": sc, "TAU": acc, "PARTS": acc,
           **dict.fromkeys(["B", "NC", "d", "split_width", "split_base", "n_slots", "tune_m", "tune_n", "tune_d"],
                           "i32")}
    return Spec.make(FWD, dtype_class(dtype), sig, {"COSINE": cosine, "PRECISION": dot_precision(dtype)})


def combine_spec(dtype: torch.dtype) -> Spec:
    acc = _t(acc_dtype(dtype))
    sig = {"PARTS": acc, "LSE": acc, "MEAN_LOGIT": acc, "B": "i32", "n_slots": "i32"}
    return Spec.make(COMBINE, "16", sig, {})


def fold_norms(dtype: torch.dtype, cosine: bool) -> bool:
    """Fold ``ia * ic`` into dS (all but fp16, whose range it could leave; see module doc)."""
    return cosine and dtype != torch.float16


def ds_dtype(dtype: torch.dtype, fp32_ds: bool) -> torch.dtype:
    """Storage of the recomputed dS chunk: float32 for 16-bit inputs unless ``fp32_ds`` is off."""
    return torch.float32 if fp32_ds and dtype in (torch.float16, torch.bfloat16) else dtype


def ds_spec(dtype: torch.dtype, cosine: bool, fp32_ds: bool, fold_pos: bool = False) -> Spec:
    """``fold_pos``: the chunk holds own positives whose ``d_pos`` is added to dS."""
    sc, acc = _scales_type(dtype, cosine), _t(acc_dtype(dtype))
    parts = acc if cosine else "*fp32"
    sig = {"A": _t(dtype), "C": _t(dtype), "TAGS": "*i32", "IA": sc, "IC": sc, "TAU": acc, "LSE": acc, "G": acc,
           "DPOS": acc if fold_pos else "*fp32", "DS": _t(ds_dtype(dtype, fp32_ds)), "ROWW": parts, "COLW": parts,
           **dict.fromkeys(["B", "NC", "d", "stride_ds", "stride_roww", "stride_colw", "n_row_parts",
                            "n_col_parts", "pos_offset", "pos_count", "tune_m", "tune_n", "tune_d"], "i32")}
    flags = {"COSINE": cosine, "FOLD_NORMS": fold_norms(dtype, cosine), "FOLD_POS": fold_pos,
             "PRECISION": dot_precision(dtype)}
    return Spec.make(DS, dtype_class(dtype), sig, flags)


def sum_parts_spec(dtype: torch.dtype, accumulate: bool) -> Spec:
    acc = _t(acc_dtype(dtype))
    sig = {"PARTS": acc, "OUT": acc, "n": "i32", "n_parts": "i32", "stride_p": "i32"}
    return Spec.make(SUM_PARTS, "16", sig, {"ACCUMULATE": accumulate})


MM_ROLES = ("d_candidates", "d_anchor")


def mm_spec(dtype: torch.dtype, cosine: bool, fp32_ds: bool, role: str, first: bool = True,
            last: bool = True) -> Spec:
    """The GEMM of one backward role; ``first``/``last``: position of the chunk (d_anchor)."""
    if role not in MM_ROLES:
        raise ValueError(role)
    acc = acc_dtype(dtype)
    on_load = cosine and not fold_norms(dtype, cosine)
    if role == "d_candidates":
        out, accumulate, radial = dtype, False, cosine
    else:
        out, accumulate, radial = (dtype if last else acc), not first, cosine and last
    x = ds_dtype(dtype, fp32_ds)
    sig = {"X": _t(x), "Y": _t(dtype), "OUT": _t(out), "ACC_IN": _t(acc) if accumulate else "*fp32",
           "KSCALE": _scales_type(dtype, on_load), "MSCALE": _scales_type(dtype, on_load),
           "RAD": _scales_type(dtype, radial), "RADW": _scales_type(dtype, radial),
           "Z": _t(dtype) if radial else "*fp32",
           **dict.fromkeys(["M", "N", "K", "stride_xm", "stride_xk", "stride_yk", "stride_yn", "stride_om",
                            "n_parts", "stride_radw", "tune_m", "tune_n", "tune_k"], "i32")}
    flags = {"SPLIT_X": x != dtype, "Y_KSCALE": on_load, "M_SCALE": on_load, "ACCUMULATE": accumulate, "RADIAL": radial,
             "PRECISION": dot_precision(dtype)}
    return Spec.make(MM, dtype_class(dtype), sig, flags)


def specialisations(dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64)) -> list[Spec]:
    """Every specialisation the launchers of this module can produce (for ``aot.py``)."""
    out: dict[str, Spec] = {}
    for dt in dtypes:
        specs = [row_norms_spec(dt), combine_spec(dt), sum_parts_spec(dt, False), sum_parts_spec(dt, True)]
        for cosine in (True, False):
            specs.append(fwd_spec(dt, cosine))
            for fp32_ds in (True, False):  # the same specs for fp32 and fp64 (deduplicated)
                specs += [ds_spec(dt, cosine, fp32_ds, fold_pos) for fold_pos in (False, True)]
                specs.append(mm_spec(dt, cosine, fp32_ds, "d_candidates"))
                specs += [mm_spec(dt, cosine, fp32_ds, "d_anchor", first, last)
                          for first in (True, False) for last in (True, False)]
        out.update((s.key, s) for s in specs)
    return list(out.values())


# ---------------------------------------------------------------------------------------
# plans: every buffer a launcher allocates beyond inputs and outputs
# ---------------------------------------------------------------------------------------

# Bytes of one recomputed dS chunk; the chunk is at least MIN_CHUNK columns so the
# d-candidates GEMM (M = chunk width) keeps enough programs at large B.
DS_CHUNK_BYTES = int(os.environ.get("FASTCL_TRITON_DS_BYTES", 32 << 20))
MIN_CHUNK = 2048
# the interpreter uses tiny chunks and splits so small test shapes cross their edges
INTERP_CHUNK = 32
INTERP_SPLITS = 3
# a forward split spans at least this many columns (amortises loading its anchor rows)
MIN_SPLIT_COLS = 512


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _tune(n: int) -> int:
    """Autotune key bucket: the next power of two (each bucket tunes once)."""
    return max(16, triton.next_power_of_2(max(n, 1)))


@dataclass(frozen=True)
class Buffer:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Plan:
    """Named scratch buffers of one launch; ``allocate`` is the launchers' only allocator."""

    buffers: dict[str, Buffer]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def allocate(self, device: torch.device) -> dict[str, Tensor]:
        # new_output: tests poison scratch too, so a tile a kernel forgets shows up as NaN
        return {k: new_output(b.shape, dtype=b.dtype, device=device) for k, b in self.buffers.items()}


def _col_align(arch: str, dclass: str) -> int:
    return max(FWD.block_sizes(arch, dclass, "BN") + DS.block_sizes(arch, dclass, "BN"))


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def forward_splits(B: int, sizes: tuple[int, int], arch: str, dclass: str, num_sms: int) -> list[tuple[int, int]]:
    """``(splits, width)`` per block: enough programs to fill the device (about two per SM)."""
    align = _col_align(arch, dclass)
    total = sum(sizes)
    out = []
    for n in sizes:
        if n == 0:
            out.append((0, align))
            continue
        if arch == "interp":
            want, min_cols = INTERP_SPLITS, align
        else:
            row_blocks = _cdiv(B, 128)
            want, min_cols = max(1, round(_cdiv(2 * num_sms, row_blocks) * n / total)), max(align, MIN_SPLIT_COLS)
        width = _round_up(max(_cdiv(n, want), min_cols), align)
        out.append((_cdiv(n, width), width))
    return out


def forward_plan(B: int, sizes: tuple[int, int], dtype: torch.dtype, cosine: bool, arch: str,
                 num_sms: int) -> Plan:
    acc = acc_dtype(dtype)
    slots = sum(s for s, _ in forward_splits(B, sizes, arch, dtype_class(dtype), num_sms))
    bufs = {"parts": Buffer((3, slots, B), acc)}
    if cosine:
        bufs["norms"] = Buffer((2, B + sum(sizes)), acc)
    return Plan(bufs)


def partial_width(arch: str, dclass: str) -> int:
    """Granularity of the ds kernel's partial sums: divides every BM and BN in its table."""
    return DS.block_sizes(arch, dclass, "PART")[0]


def chunk_width(B: int, sizes: tuple[int, int], dtype: torch.dtype, arch: str, fp32_ds: bool = True) -> int:
    """Columns of one recomputed dS chunk (a chunk never spans two blocks)."""
    align = _col_align(arch, dtype_class(dtype))
    if arch == "interp":
        width = INTERP_CHUNK
    else:
        elt = torch.empty((), dtype=ds_dtype(dtype, fp32_ds)).element_size()
        width = max(MIN_CHUNK, DS_CHUNK_BYTES // max(B * elt, 1) // align * align)
    return min(width, _round_up(max(max(sizes), 1), align))


def backward_plan(B: int, sizes: tuple[int, int], d: int, dtype: torch.dtype, cosine: bool, arch: str,
                  fp32_ds: bool = True) -> Plan:
    acc = acc_dtype(dtype)
    width = chunk_width(B, sizes, dtype, arch, fp32_ds)
    part = partial_width(arch, dtype_class(dtype))
    chunks = sum(_cdiv(n, width) for n in sizes)
    bufs = {"ds": Buffer((B, width), ds_dtype(dtype, fp32_ds))}
    if cosine:
        bufs["norms"] = Buffer((2, B + sum(sizes)), acc)
        bufs["row_parts"] = Buffer((_cdiv(width, part), B), acc)
        bufs["col_parts"] = Buffer((_cdiv(B, part), width), acc)
        bufs["row_w"] = Buffer((B,), acc)
    if chunks > 1:
        bufs["d_anchor_acc"] = Buffer((B, d), acc)
    return Plan(bufs)


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def _row_norms(x: Tensor, inv: Tensor, rad: Tensor, eps: float, arch: str) -> None:
    n, d = x.shape
    if n == 0:
        return
    grid = lambda meta: (triton.cdiv(n, meta["BR"]),)  # noqa: E731
    launch(row_norms_spec(x.dtype), arch, grid, x, inv, rad, n, d, float(eps))


def _norm_views(norms: Tensor | None, B: int, sizes: tuple[int, int]):
    """``(inv, rad)`` views of the norms buffer for anchors and each block."""
    if norms is None:
        return [(None, None)] * 3
    bounds = [0, B, B + sizes[0], B + sizes[0] + sizes[1]]
    return [(norms[0, a:b], norms[1, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _prepare(anchor, blocks, tags, tau, cosine, eps, norms, arch):
    """Validate layouts, convert tau, compute the norms; shared by forward and backward."""
    for t in (anchor, *blocks, *tags):
        if not t.is_contiguous():
            raise ValueError("triton LSE kernels need contiguous inputs")
    tau = tau.to(acc_dtype(anchor.dtype)).reshape(1)
    B = anchor.shape[0]
    sizes = (blocks[0].shape[0], blocks[1].shape[0])
    views = _norm_views(norms if cosine else None, B, sizes)
    if cosine:
        for x, (inv, rad) in zip((anchor, *blocks), views):
            _row_norms(x, inv, rad, eps, arch)
    return tau, sizes, views


def _lse_forward(anchor: Tensor, block0: Tensor, block1: Tensor, tags0: Tensor, tags1: Tensor, tau: Tensor,
                 cosine: bool, eps: float) -> tuple[Tensor, Tensor]:
    dev, dt = anchor.device, anchor.dtype
    B, d = anchor.shape
    acc = acc_dtype(dt)
    arch = arch_of(dev)
    lse = new_output(B, dtype=acc, device=dev)
    mean_logit = new_output(B, dtype=acc, device=dev)
    if B == 0:
        return lse, mean_logit
    sizes = (block0.shape[0], block1.shape[0])
    num_sms = 1 if arch == "interp" else _num_sms(dev)
    ws = forward_plan(B, sizes, dt, cosine, arch, num_sms).allocate(dev)
    tau, sizes, views = _prepare(anchor, (block0, block1), (tags0, tags1), tau, cosine, eps, ws.get("norms"), arch)
    ia = views[0][0] if cosine else dummy(dev)
    splits = forward_splits(B, sizes, arch, dtype_class(dt), num_sms)
    n_slots = sum(s for s, _ in splits)
    parts = ws["parts"]
    spec = fwd_spec(dt, cosine)
    base = 0
    for blk, tg, (ic, _), (n_split, width) in zip((block0, block1), (tags0, tags1), views[1:], splits):
        if n_split == 0:
            continue
        grid = lambda meta, s=n_split: (triton.cdiv(B, meta["BM"]), s)  # noqa: E731
        launch(spec, arch, grid, anchor, blk, tg, ia, ic if cosine else ia, tau, parts,
               B, blk.shape[0], d, width, base, n_slots, _tune(B), _tune(sum(sizes)), d)
        base += n_split
    grid = lambda meta: (triton.cdiv(B, meta["BR"]),)  # noqa: E731
    launch(combine_spec(dt), arch, grid, parts, lse, mean_logit, B, n_slots)
    return lse, mean_logit


def _lse_backward(anchor: Tensor, block0: Tensor, block1: Tensor, tags0: Tensor, tags1: Tensor, tau: Tensor,
                  lse: Tensor, g: Tensor, d_pos: Tensor | None, pos_offset: int, cosine: bool, eps: float,
                  fp32_ds: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``d anchor, d block0, d block1`` (input dtype) from ``g = dLoss/dlse [B]``.

    ``d_pos [B, P]`` (or None): gradient of the own-positive logits, anchor ``i``'s positive
    ``k`` being row ``pos_offset + i * P + k`` of block 0; folded into dS (float32).
    """
    dev, dt = anchor.device, anchor.dtype
    B, d = anchor.shape
    acc = acc_dtype(dt)
    arch = arch_of(dev)
    blocks = (block0, block1)
    d_anchor = new_output((B, d), dtype=dt, device=dev)
    d_blocks = tuple(new_output(b.shape, dtype=dt, device=dev) for b in blocks)
    sizes = (block0.shape[0], block1.shape[0])
    width = chunk_width(B, sizes, dt, arch, fp32_ds)
    chunks = [(i, c0, min(c0 + width, n)) for i, n in enumerate(sizes) for c0 in range(0, n, width)]
    if B == 0 or not chunks:  # no anchor or no candidate: every gradient is zero
        for t in (d_anchor, *d_blocks):
            t.zero_()
        return (d_anchor, *d_blocks)
    ws = backward_plan(B, sizes, d, dt, cosine, arch, fp32_ds).allocate(dev)
    tau, sizes, views = _prepare(anchor, blocks, (tags0, tags1), tau, cosine, eps, ws.get("norms"), arch)
    lse, g = lse.to(acc).contiguous(), g.to(acc).contiguous()
    pos_count = 0 if d_pos is None else d_pos.shape[1]
    dpos = None
    if pos_count:
        dpos = d_pos.to(acc).contiguous()
    part = partial_width(arch, dtype_class(dt))
    fold = fold_norms(dt, cosine)
    none = dummy(dev)
    ia, ra = views[0] if cosine else (none, none)
    ds = ws["ds"]
    row_parts, col_parts = ws.get("row_parts", none), ws.get("col_parts", none)
    row_w = ws.get("row_w", none)
    tags = (tags0, tags1)
    for idx, (bi, c0, c1) in enumerate(chunks):
        first, last = idx == 0, idx == len(chunks) - 1
        nc = c1 - c0
        blk, tg, d_blk = blocks[bi][c0:c1], tags[bi][c0:c1], d_blocks[bi][c0:c1]
        ic, rc = (views[bi + 1][0][c0:c1], views[bi + 1][1][c0:c1]) if cosine else (none, none)
        n_row_parts, n_col_parts = _cdiv(B, part), _cdiv(nc, part)

        # does this chunk of block 0 hold rows pos_offset .. pos_offset + B * P - 1?
        fold_pos = bi == 0 and pos_count > 0 and c0 < pos_offset + B * pos_count and pos_offset < c1
        grid = lambda meta, nc=nc: (triton.cdiv(B, meta["BM"]), triton.cdiv(nc, meta["BN"]))  # noqa: E731
        launch(ds_spec(dt, cosine, fp32_ds, fold_pos), arch, grid, anchor, blk, tg, ia, ic, tau, lse, g,
               dpos if fold_pos else none, ds, row_parts, col_parts,
               B, nc, d, width, B, width, n_row_parts, n_col_parts, pos_offset - c0 if fold_pos else 0,
               pos_count if fold_pos else 0, _tune(B), _tune(width), d)
        if cosine:
            grid = lambda meta: (triton.cdiv(B, meta["BR"]),)  # noqa: E731
            launch(sum_parts_spec(dt, not first), arch, grid, row_parts, row_w, B, n_col_parts, B)

        mm_grid = lambda M: (lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(d, meta["BN"]),))  # noqa: E731
        # d candidates of this chunk: dS^T @ A (dS read transposed through its strides)
        launch(mm_spec(dt, cosine, fp32_ds, "d_candidates"), arch, mm_grid(nc),
               ds, anchor, d_blk, none, ia if not fold else none, ic if not fold else none,
               rc if cosine else none, col_parts if cosine else none, blk if cosine else none,
               nc, d, B, 1, width, d, 1, d, n_row_parts, width, _tune(nc), _tune(d), _tune(B))
        # d anchor: accumulate dS @ C[chunk] over chunks in fixed order
        acc_buf = ws.get("d_anchor_acc", none)
        spec = mm_spec(dt, cosine, fp32_ds, "d_anchor", first, last)
        radial = cosine and last
        launch(spec, arch, mm_grid(B),
               ds, blk, d_anchor if last else acc_buf, acc_buf if not first else none,
               ic if not fold and cosine else none, ia if not fold and cosine else none,
               ra if radial else none, row_w if radial else none, anchor if radial else none,
               B, d, nc, width, 1, d, 1, d, 1, B, _tune(B), _tune(d), _tune(width))
    return (d_anchor, *d_blocks)


lse_forward = register_op("fastcl_triton::lse_forward", _lse_forward)
lse_backward = register_op("fastcl_triton::lse_backward", _lse_backward)
