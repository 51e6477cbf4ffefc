"""GCLSR grouped cosine: fused per-group normalise-and-dot, forward and backward.

``h, z [B, D]`` are split into contiguous groups of ``group_size`` features; row-major
storage makes the groups the rows of a ``[B * G, group_size]`` matrix, so one kernel
handles any group size: a program takes ``BR`` groups and loops over the group in
``BG``-wide chunks (``BG`` = the next power of two of the group size, 16 to 128).

    forward   cos[r] = <h_r, z_r> / (max(|h_r|, eps) * max(|z_r|, eps))
    backward  dh_r  = dcos_r * ih_r * (z_r * iz_r - cos_r * h_r * ih_r [|h_r| > eps])

``z`` is stop-gradient. Memory-bound: each kernel reads ``h`` and ``z`` once per chunk
loop (twice in backward) and writes ``B * G`` floats or ``d h``; no intermediate exists.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from fastcl.ops.contract import new_output

from ._common import Kernel, acc_dtype, arch_of, cast_to, cfg, launch, register_op, sqrt_rn


@triton.jit
def _group_stats(H, Z, rows, ok, gs, BR: tl.constexpr, BG: tl.constexpr, ACC: tl.constexpr):
    hz = tl.zeros([BR], dtype=ACC)
    hh = tl.zeros([BR], dtype=ACC)
    zz = tl.zeros([BR], dtype=ACC)
    for k0 in range(0, gs, BG):
        ks = k0 + tl.arange(0, BG)
        m = ok[:, None] & (ks < gs)[None, :]
        h = tl.load(H + rows[:, None] * gs + ks[None, :], mask=m, other=0.0).to(ACC)
        z = tl.load(Z + rows[:, None] * gs + ks[None, :], mask=m, other=0.0).to(ACC)
        hz += tl.sum(h * z, 1)
        hh += tl.sum(h * h, 1)
        zz += tl.sum(z * z, 1)
    return hz, sqrt_rn(hh), sqrt_rn(zz)


@triton.jit
def _grouped_cos_fwd_kernel(H, Z, COS, n, gs, eps, BR: tl.constexpr, BG: tl.constexpr):
    ACC: tl.constexpr = COS.dtype.element_ty
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < n
    hz, h_norm, z_norm = _group_stats(H, Z, rows, ok, gs, BR, BG, ACC)
    cos = hz / (tl.maximum(h_norm, eps) * tl.maximum(z_norm, eps))
    tl.store(COS + rows, cos, mask=ok)


@triton.jit
def _grouped_cos_bwd_kernel(H, Z, DCOS, DH, n, gs, eps, BR: tl.constexpr, BG: tl.constexpr):
    ACC: tl.constexpr = DCOS.dtype.element_ty
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < n
    hz, h_norm, z_norm = _group_stats(H, Z, rows, ok, gs, BR, BG, ACC)
    ih = 1.0 / tl.maximum(h_norm, eps)
    iz = 1.0 / tl.maximum(z_norm, eps)
    dc = tl.load(DCOS + rows, mask=ok, other=0.0)
    coef_z = dc * ih * iz
    coef_h = tl.where(h_norm > eps, dc * ih * ih * (hz * ih * iz), 0.0)
    for k0 in range(0, gs, BG):
        ks = k0 + tl.arange(0, BG)
        m = ok[:, None] & (ks < gs)[None, :]
        offs = rows[:, None] * gs + ks[None, :]
        h = tl.load(H + offs, mask=m, other=0.0).to(ACC)
        z = tl.load(Z + offs, mask=m, other=0.0).to(ACC)
        dh = coef_z[:, None] * z - coef_h[:, None] * h
        tl.store(DH + offs, cast_to(dh, DH.dtype.element_ty), mask=m)


# Memory-bound: 4 warps over 1024 elements per program (8 per thread: two 16-byte loads of
# h and z each). 4096 needed 255 registers and spilled on sm_80 (see docs/triton.md).
_TABLE = {a: {"16": [cfg(4, 1)]} for a in ("sm80", "sm90")}
_TABLE["interp"] = {"16": [cfg()]}
FWD = Kernel(_grouped_cos_fwd_kernel, _TABLE, dtype_arg="H")
BWD = Kernel(_grouped_cos_bwd_kernel, _TABLE, dtype_arg="H")

GROUP_BLOCKS = (16, 32, 64, 128)
ELEMENTS_PER_PROGRAM = 1024


def group_block(group_size: int) -> int:
    """Chunk width over a group: its next power of two, clamped to 16..128."""
    return min(max(triton.next_power_of_2(group_size), GROUP_BLOCKS[0]), GROUP_BLOCKS[-1])


def _flags(group_size: int) -> dict[str, int]:
    bg = group_block(group_size)
    return {"BG": bg, "BR": ELEMENTS_PER_PROGRAM // bg}


def _check(h: Tensor, z: Tensor, group_size: int) -> tuple[int, int]:
    if h.shape != z.shape or h.dim() != 2:
        raise ValueError(f"h and z must both be [B, D]; got {tuple(h.shape)} and {tuple(z.shape)}")
    if group_size <= 0 or h.shape[1] % group_size:
        raise ValueError(f"D = {h.shape[1]} is not divisible by group_size = {group_size}")
    return h.shape[0], h.shape[1] // group_size


def _grouped_cosine_forward(h: Tensor, z: Tensor, group_size: int, eps: float) -> Tensor:
    """``[B, D // group_size]`` cosines in float32 (float64 for float64 inputs)."""
    B, G = _check(h, z, group_size)
    h, z = h.contiguous(), z.contiguous()
    cos = new_output((B, G), dtype=acc_dtype(h.dtype), device=h.device)
    n = B * G
    if n:
        flags = _flags(group_size)
        launch(FWD, (triton.cdiv(n, flags["BR"]),), arch_of(h.device),
               H=h, Z=z, COS=cos, n=n, gs=group_size, eps=float(eps), **flags)
    return cos


def _grouped_cosine_backward(h: Tensor, z: Tensor, group_size: int, eps: float, d_cos: Tensor) -> Tensor:
    """``d h`` (``h``'s dtype) from ``d_cos [B, D // group_size]``; ``z`` gets no gradient."""
    B, G = _check(h, z, group_size)
    h, z = h.contiguous(), z.contiguous()
    d_cos = d_cos.to(acc_dtype(h.dtype)).contiguous()  # an expanded upstream gradient has stride 0
    d_h = new_output(h.shape, dtype=h.dtype, device=h.device)
    n = B * G
    if n:
        flags = _flags(group_size)
        launch(BWD, (triton.cdiv(n, flags["BR"]),), arch_of(h.device),
               H=h, Z=z, DCOS=d_cos, DH=d_h, n=n, gs=group_size, eps=float(eps), **flags)
    return d_h


grouped_cosine_forward = register_op("fastcl_triton::grouped_cosine_forward", _grouped_cosine_forward)
grouped_cosine_backward = register_op("fastcl_triton::grouped_cosine_backward", _grouped_cosine_backward)
