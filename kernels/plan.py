"""Planning for the LSE kernels: forward splits, backward chunks, and the cached scratch.

Every buffer a launcher uses beyond its inputs and outputs comes from :func:`scratch`
(sizes: docs/triton.md, "Extra memory"). Scratch is cached per device, stream and buffer
layout, so a warm training step allocates nothing but the outputs autograd keeps; buffers
a captured CUDA graph used are never released (the graph replays into them).
"""

from __future__ import annotations

import collections
import threading

import torch
from torch import Tensor

from fastcl.ops import contract
from fastcl.ops.contract import new_output

from .configs import Config

# A dS chunk holds at most fastcl.config's triton.ds_bytes (default 40 MiB, all Matryoshka
# prefixes together) and spans at least MIN_CHUNK columns, so that the launch count stays
# bounded (3 launches per chunk) and the candidates' GEMM (M = chunk width) keeps enough
# programs. With the d-anchor accumulator (B x d fp32) the default keeps a SupMPN step at
# B = 4096, d = 768 under 64 MiB of scratch.
MIN_CHUNK = 2048
# the interpreter uses tiny chunks and splits so small test shapes cross their edges
INTERP_CHUNK = 32
INTERP_SPLITS = 3
# The backward GEMM addresses its operands with int32 offsets: a dS chunk, a candidate
# chunk and the anchors must each stay under 2**31 elements (chunks are capped to fit;
# anchor blocks beyond it are refused by size_reasons).
INT32_ELEMENTS = 2**31 - 1


def ds_chunk_bytes() -> int:
    """Bytes of one recomputed dS chunk: ``fastcl.config``'s ``triton.ds_bytes``."""
    from fastcl import config

    return config.get().triton.ds_bytes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def size_reasons(B: int, d: int) -> list[str]:
    """Why the backward cannot take ``B`` anchors of ``d`` features (empty: it can)."""
    if B * d > INT32_ELEMENTS:
        return [
            f"the anchor block has B * d = {B * d} >= 2**31 elements (the backward GEMM uses 32-bit "
            "offsets); split the anchors into several calls"
        ]
    return []


# numerics chosen per dtype (docs/triton.md, "Precision")
def scale_on_load(dtype: torch.dtype) -> bool:
    """Scale fp32/fp64 rows by their row scale (inverse norm; 1 or NaN for dot similarity) as
    they are loaded, so no product of raw rows over- or underflows; 16-bit rows scale the
    logit tile instead."""
    return dtype in (torch.float32, torch.float64)


def fold_norms(dtype: torch.dtype, cosine: bool) -> bool:
    """Fold ``ia * ic`` into dS (bf16 only): fp16 could leave its range, and fp32/fp64 could
    underflow ``ia * ic`` for huge rows; they normalise the GEMM operands on load instead."""
    return cosine and dtype == torch.bfloat16


def ds_dtype(dtype: torch.dtype, fp32_ds: bool) -> torch.dtype:
    """Storage of the recomputed dS chunk: float32 for fp16 inputs (dS ~ 1 / (B N tau) is
    subnormal in fp16 at large batches) and for bf16 when ``fp32_ds``; else the input dtype."""
    if dtype == torch.float16 or (fp32_ds and dtype == torch.bfloat16):
        return torch.float32
    return dtype


# ---------------------------------------------------------------------------------------
# forward splits
# ---------------------------------------------------------------------------------------


def forward_splits(row_tiles: int, n_tiles: int, slots: int, arch: str) -> tuple[int, int]:
    """``(splits, tiles per split)`` of the forward grid ``[row_tiles, splits]``: each program
    sweeps a contiguous run of column tiles (flash-decoding style), so the grid fills the
    device when ``row_tiles`` alone would not. ``slots``: programs the device runs at once.
    Chosen to minimise waves x (tiles per program + 1), the +1 being a program's fixed cost
    (its anchor rows' first loads, the partials it writes)."""
    if n_tiles == 0:
        return 0, 1
    if arch == "interp":
        per = cdiv(n_tiles, min(INTERP_SPLITS, n_tiles))
        return cdiv(n_tiles, per), per
    best = None
    for splits in range(1, n_tiles + 1):
        per = cdiv(n_tiles, splits)
        if splits > 1 and cdiv(n_tiles, per) != splits:
            continue  # same per-program work as a smaller split count
        cost = cdiv(row_tiles * splits, slots) * (per + 1)
        if best is None or cost < best[0]:
            best = (cost, splits, per)
        if row_tiles * splits > 8 * slots:
            break
    return best[1], best[2]


# ---------------------------------------------------------------------------------------
# backward chunks
# ---------------------------------------------------------------------------------------


def chunk_align(ds_cfg: Config, mm_cfg: Config) -> int:
    """Column alignment of a dS chunk: every tile edge that walks its columns (the ds kernel's
    BN, the GEMMs' BM and BK) divides it."""
    return max(ds_cfg["BN"], mm_cfg["BM"], mm_cfg["BK"])


def chunk_width(rows: int, n: int, d: int, elt: int, align: int, arch: str) -> int:
    """Columns of one recomputed dS chunk for a block of ``n`` candidates: at most
    ``ds_chunk_bytes()`` of dS (``rows`` rows of ``elt`` bytes; at least ``MIN_CHUNK`` columns),
    under 2**31 elements in dS and in the candidate chunk, and even: the block's chunks all
    have the same width, a multiple of ``align``."""
    if arch == "interp":
        widest = INTERP_CHUNK
    else:
        widest = max(MIN_CHUNK, ds_chunk_bytes() // max(rows * elt, 1))
    widest = min(widest, INT32_ELEMENTS // max(rows, d, 1))
    widest = max(align, widest // align * align)
    if n <= 0:
        return align
    chunks = cdiv(n, widest)
    return min(widest, round_up(cdiv(n, chunks), align))


def chunks(sizes: tuple[int, int], width: tuple[int, int]) -> list[tuple[int, int, int]]:
    """``(block, first column, end column)`` of every chunk, block 0's first (a chunk never
    spans the two blocks: its columns are one tensor's rows)."""
    return [(b, c0, min(c0 + w, n)) for b, (n, w) in enumerate(zip(sizes, width)) for c0 in range(0, n, w)]


# ---------------------------------------------------------------------------------------
# cached scratch
# ---------------------------------------------------------------------------------------

# unpinned layouts kept per process (a training run alternates between one or two: the
# full batch and the last, smaller one)
KEEP = 4


class _Scratch:
    def __init__(self):
        self.lock = threading.Lock()
        self.entries: collections.OrderedDict[tuple, dict[str, Tensor]] = collections.OrderedDict()
        self.pinned: set[tuple] = set()
        self.allocations = 0  # buffers allocated so far (tests: a warm step allocates none)


_SCRATCH = _Scratch()


def _traced() -> bool:
    """Under ``torch.compile`` or fake-tensor tracing (opcheck, the compiler's shape pass):
    the buffers must be fresh tensors of the tracing mode, never cached real ones."""
    return torch.compiler.is_compiling() or torch._guards.active_fake_mode() is not None


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def scratch(device: torch.device, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Tensor]:
    """Buffers ``{name: tensor}`` of ``layout`` (``{name: (shape, dtype)}``), cached per device,
    stream and layout: the launchers' only allocator of scratch.

    Reused buffers hold whatever the last launch left (kernels must write every element they
    read: under ``contract.poison_outputs`` the buffers are refilled with NaN at every use, so
    a tile a kernel forgets shows as NaN). Buffers handed out while a CUDA graph is being
    captured are pinned: the graph replays into them, so they are never released. Under
    ``torch.compile`` tracing, fresh buffers (the compiler plans their memory).
    """
    if _traced() or any(isinstance(s, torch.SymInt) for sh, _ in layout.values() for s in sh):
        return {k: new_output(shape, dtype=dt, device=device) for k, (shape, dt) in layout.items()}
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream, tuple(sorted((k, tuple(s), dt) for k, (s, dt) in layout.items())))
    s = _SCRATCH
    with s.lock:
        bufs = s.entries.get(key)
        if bufs is None:
            bufs = {k: torch.empty(shape, dtype=dt, device=device) for k, (shape, dt) in layout.items()}
            s.allocations += len(bufs)
            s.entries[key] = bufs
        s.entries.move_to_end(key)
        if _capturing(device):
            s.pinned.add(key)
        unpinned = [k for k in s.entries if k not in s.pinned]
        for old in unpinned[:-KEEP]:
            del s.entries[old]
    if contract.poisoning():
        for t in bufs.values():
            t.fill_(float("nan") if t.is_floating_point() else -1)
    return bufs


def release_scratch(include_pinned: bool = False) -> None:
    """Drop the cached scratch (``include_pinned``: also buffers a captured CUDA graph uses;
    only when no such graph will be replayed again)."""
    with _SCRATCH.lock:
        for key in list(_SCRATCH.entries):
            if include_pinned or key not in _SCRATCH.pinned:
                del _SCRATCH.entries[key]
        if include_pinned:
            _SCRATCH.pinned.clear()


def scratch_allocations() -> int:
    """How many scratch buffers have been allocated in this process (tests)."""
    return _SCRATCH.allocations


_DUMMIES: dict[torch.device, Tensor] = {}


def dummy(device: torch.device) -> Tensor:
    """One cached float32 element per device for pointer arguments a specialisation never
    reads (NaN under the tests' poisoning, so a read would show)."""
    if _traced():
        return new_output((1,), dtype=torch.float32, device=device)
    t = _DUMMIES.get(device)
    if t is None:
        t = _DUMMIES[device] = new_output((1,), dtype=torch.float32, device=device)
    if contract.poisoning():
        t.fill_(float("nan"))
    return t


_CONSTANTS: dict[tuple, Tensor] = {}


def int_constant(values: tuple[int, ...], device: torch.device) -> Tensor:
    """A cached int32 device tensor of ``values`` (e.g. Matryoshka bounds): copied to the
    device once, before any CUDA graph capture that uses it (a host-to-device copy cannot
    be captured)."""
    if _traced():
        return torch.tensor(values, dtype=torch.int32, device=device)
    key = (device, values)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(values, dtype=torch.int32, device=device)
    return t


_ONES: dict[tuple, Tensor] = {}


def ones(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A cached vector of at least ``n`` ones (row scales of 1 for the GEMM's radial epilogue)."""
    if _traced():
        return torch.ones(max(n, 1), dtype=dtype, device=device)
    key = (device, dtype)
    t = _ONES.get(key)
    if t is None or t.numel() < n:
        t = _ONES[key] = torch.ones(max(n, 1), dtype=dtype, device=device)
    return t
