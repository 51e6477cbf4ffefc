"""Planning for the LSE kernels: tile tables, forward splits, backward chunks, scratch buffers.

Every buffer a launcher allocates beyond its inputs and outputs is listed by
:func:`forward_plan` or :func:`backward_plan` (sizes: docs/triton.md, "Extra memory").
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from fastcl.ops.contract import new_output

from ._common import acc_dtype, cfg, dtype_class

# Row-wise pre-pass and reductions: memory-bound, one config.
# fp64 rows take half the feature chunk: 32 x 128 fp64 values spilled (2 KiB) in the norms.
ROWWISE = {a: {"16": [cfg(4, 1, BR=32, BD=128)], "64": [cfg(4, 1, BR=32, BD=64)]} for a in ("sm80", "sm90")}
ROWWISE["interp"] = {"16": [cfg(BR=16, BD=64)]}
# Own-positive logits: two row chunks and three running sums per row; the spill-free sizes
# of the compiled candidates (BR=32 BD=64 spilled 140-172 B at 4 warps, fp64 BD=64 3 KiB).
OWN_ROWS = {a: {"16": [cfg(4, 1, BR=16, BD=64)], "64": [cfg(4, 1, BR=16, BD=32)]} for a in ("sm80", "sm90")}
OWN_ROWS["interp"] = {"16": [cfg(BR=16, BD=64)]}
REDUCE = {a: {"16": [cfg(4, 1, BR=256)]} for a in ("sm80", "sm90")}
REDUCE["interp"] = {"16": [cfg(BR=16)]}

# Logit tiles: a GEMM main loop over d with an online-softmax (forward) or gradient
# (backward) epilogue; the spill-free configs of the compiled candidates plus, on sm_90,
# one spilling 128x128x64 the autotuner keeps only where it is faster; why each size:
# docs/triton.md, "Tuning tables".
TILES = {
    "sm80": {
        "16": [cfg(8, 4, BM=128, BN=64, BK=32), cfg(4, 4, BM=64, BN=64, BK=32)],
        "32": [cfg(4, 3, BM=64, BN=64, BK=16), cfg(8, 3, BM=128, BN=64, BK=16)],
        "64": [cfg(4, 2, BM=32, BN=64, BK=16), cfg(4, 2, BM=32, BN=32, BK=16)],
    },
    "sm90": {
        "16": [
            cfg(8, 3, BM=128, BN=128, BK=64),
            cfg(8, 4, BM=128, BN=64, BK=32),
            cfg(8, 3, BM=128, BN=64, BK=64),
            cfg(8, 3, BM=64, BN=128, BK=64),
            cfg(4, 4, BM=64, BN=64, BK=32),
        ],
        "32": [cfg(4, 3, BM=64, BN=64, BK=16), cfg(8, 3, BM=128, BN=64, BK=16), cfg(8, 3, BM=64, BN=64, BK=32)],
        "64": [cfg(4, 2, BM=32, BN=64, BK=16), cfg(4, 2, BM=32, BN=32, BK=16)],
    },
    # interpreter: 16-wide tiles so small test shapes cross tile edges; BK=32 halves the
    # (Python-speed) feature loop, d > 32 still crosses its edge
    "interp": {"16": [cfg(BM=16, BN=16, BK=32)]},
}


def _with_part(table):
    """The ds kernel's table: the tile table plus PART, the granularity of its partial sums
    (the smallest block size of the list, so it divides every BM and BN; buffers sized
    with it fit whichever config the autotuner picks)."""

    def with_part(configs):
        part = min(min(c.kwargs["BM"], c.kwargs["BN"]) for c in configs)
        return [cfg(c.num_warps, c.num_stages, PART=part, **c.kwargs) for c in configs]

    return {arch: {dc: with_part(configs) for dc, configs in by_class.items()} for arch, by_class in table.items()}


DS_TILES = _with_part(TILES)

# Bytes of one recomputed dS chunk; the chunk is at least MIN_CHUNK columns so the
# d-candidates GEMM (M = chunk width) keeps enough programs at large B.
DS_CHUNK_BYTES = int(os.environ.get("FASTCL_TRITON_DS_BYTES", 32 << 20))
MIN_CHUNK = 2048
# the interpreter uses tiny chunks and splits so small test shapes cross their edges
INTERP_CHUNK = 32
INTERP_SPLITS = 3
# a forward split spans at least this many columns (amortises loading its anchor rows)
MIN_SPLIT_COLS = 512


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


# numerics chosen per dtype (see lse_bwd.py)
def scale_on_load(dtype: torch.dtype) -> bool:
    """Scale fp32/fp64 rows by their row scale (inverse norm; 1 or NaN for dot similarity) as
    they are loaded, so no product of raw rows over- or underflows; 16-bit rows scale the
    logit tile instead (why, and why dot takes the same path: docs/triton.md)."""
    return dtype in (torch.float32, torch.float64)


def fold_norms(dtype: torch.dtype, cosine: bool) -> bool:
    """Fold ``ia * ic`` into dS (bf16 only): fp16 could leave its range, and fp32/fp64 could
    underflow ``ia * ic`` for huge rows; they normalise the GEMM operands on load instead."""
    return cosine and dtype == torch.bfloat16


def ds_dtype(dtype: torch.dtype, fp32_ds: bool) -> torch.dtype:
    """Storage of the recomputed dS chunk: float32 for 16-bit inputs unless ``fp32_ds`` is off."""
    return torch.float32 if fp32_ds and dtype in (torch.float16, torch.bfloat16) else dtype


# splits, chunks, buffers
class Plan(dict):
    """Named scratch buffers ``{name: (shape, dtype)}`` of one launch; ``allocate`` is the
    launchers' only allocator."""

    def allocate(self, device: torch.device) -> dict[str, Tensor]:
        # new_output: tests poison scratch too, so a tile a kernel forgets shows up as NaN
        return {k: new_output(shape, dtype=dtype, device=device) for k, (shape, dtype) in self.items()}


def col_align(arch: str, dclass: str) -> int:
    """Column alignment of splits and chunks: every BN of the tile tables."""
    return max(c.kwargs["BN"] for c in TILES[arch].get(dclass, TILES[arch]["16"]))


def partial_width(arch: str, dclass: str) -> int:
    """Granularity of the ds kernel's partial sums: divides every BM and BN in its table."""
    return DS_TILES[arch].get(dclass, DS_TILES[arch]["16"])[0].kwargs["PART"]


def num_sms(device: torch.device, arch: str) -> int:
    return 1 if arch == "interp" else torch.cuda.get_device_properties(device).multi_processor_count


def forward_splits(B: int, sizes: tuple[int, int], arch: str, dclass: str, sms: int) -> list[tuple[int, int]]:
    """``(splits, width)`` per block: enough programs to fill the device (about two per SM)."""
    align = col_align(arch, dclass)
    total = sum(sizes)
    out = []
    for n in sizes:
        if n == 0:
            out.append((0, align))
            continue
        if arch == "interp":
            want, min_cols = INTERP_SPLITS, align
        else:
            row_blocks = cdiv(B, 128)
            want, min_cols = max(1, round(cdiv(2 * sms, row_blocks) * n / total)), max(align, MIN_SPLIT_COLS)
        width = _round_up(max(cdiv(n, want), min_cols), align)
        out.append((cdiv(n, width), width))
    return out


def forward_plan(B: int, sizes: tuple[int, int], dtype: torch.dtype, cosine: bool, arch: str, sms: int) -> Plan:
    acc = acc_dtype(dtype)
    slots = sum(s for s, _ in forward_splits(B, sizes, arch, dtype_class(dtype), sms))
    # row scales (inverse norms, or 1 / NaN for dot similarity) of anchors and candidates
    return Plan(parts=((3, slots, B), acc), norms=((2, B + sum(sizes)), acc))


# The backward GEMM (matmul.py) addresses its operands with int32 offsets (64-bit offset
# tensors spilled on sm_80): a dS chunk [B, width], a candidate chunk [width, d] and the
# anchors [B, d] must each stay under 2**31 elements. Chunks are capped to fit; anchors
# beyond it are refused (size_reasons).
INT32_ELEMENTS = 2**31 - 1


def size_reasons(B: int, d: int) -> list[str]:
    """Why the backward cannot take ``B`` anchors of ``d`` features (empty: it can)."""
    if B * d > INT32_ELEMENTS:
        return [
            f"the anchor block has B * d = {B * d} >= 2**31 elements (the backward GEMM uses 32-bit "
            "offsets); split the anchors into several calls"
        ]
    return []


def chunk_width(B: int, sizes: tuple[int, int], d: int, dtype: torch.dtype, arch: str, fp32_ds: bool = True) -> int:
    """Columns of one recomputed dS chunk (a chunk never spans two blocks), at most 2**31
    elements in ``dS [B, width]`` and in the candidate chunk ``[width, d]``."""
    align = col_align(arch, dtype_class(dtype))
    if arch == "interp":
        width = INTERP_CHUNK
    else:
        elt = torch.empty((), dtype=ds_dtype(dtype, fp32_ds)).element_size()
        width = max(MIN_CHUNK, DS_CHUNK_BYTES // max(B * elt, 1) // align * align)
    cap = INT32_ELEMENTS // max(B, d, 1) // align * align
    return max(align, min(width, cap, _round_up(max(max(sizes), 1), align)))


def backward_plan(
    B: int, sizes: tuple[int, int], d: int, dtype: torch.dtype, cosine: bool, arch: str, fp32_ds: bool = True
) -> Plan:
    acc = acc_dtype(dtype)
    width = chunk_width(B, sizes, d, dtype, arch, fp32_ds)
    part = partial_width(arch, dtype_class(dtype))
    chunks = sum(cdiv(n, width) for n in sizes)
    plan = Plan(ds=((B, width), ds_dtype(dtype, fp32_ds)), norms=((2, B + sum(sizes)), acc))
    if cosine:
        plan.update(row_parts=((cdiv(width, part), B), acc), col_parts=((cdiv(B, part), width), acc), row_w=((B,), acc))
    if chunks > 1:
        plan["d_anchor_acc"] = ((B, d), acc)
    return plan
