"""A strided GEMM with the epilogues the LSE backward needs (one kernel, flags per use).

    out[m, n] = mscale[m] * sum_k X[m, k] * (kscale[k] * Y[k, n])       (main loop)
              + ACC_IN[m, n]                                          (ACCUMULATE)
              - rad[m] * (sum_p RADW[p, m]) * Z[m, n]                  (RADIAL)

Flags, padding and determinism: docs/triton.md, "The backward GEMM".
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import PAD_TAG, Kernel, cast_to, cfg, mma


@triton.jit
def _mm_kernel(
    X,
    Y,
    OUT,
    ACC_IN,
    KSCALE,
    MSCALE,
    RINV,
    RADW,
    Z,
    TAGS,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_yk,
    stride_yn,
    stride_om,
    n_parts,
    stride_radw,
    SPLIT_X: tl.constexpr,
    Y_KSCALE: tl.constexpr,
    M_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    RADIAL: tl.constexpr,
    PAD_K: tl.constexpr,
    PAD_M: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    ACC: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    # grouped ordering: programs that run together share Y column panels in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    # int32 offsets: the launcher keeps every operand of this GEMM under 2**31 elements
    # (plan.chunk_width caps a chunk; lse_bwd refuses larger anchor blocks), which
    # keeps the main loop's registers free (64-bit offset tensors spilled on sm_80)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BM, BN], dtype=ACC)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        y_ok = k_ok
        if PAD_K:
            y_ok = k_ok & (tl.load(TAGS + rk, mask=k_ok, other=PAD_TAG) != PAD_TAG)
        x = tl.load(
            X + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        y = tl.load(
            Y + rk[:, None] * stride_yk + rn[None, :] * stride_yn, mask=y_ok[:, None] & n_ok[None, :], other=0.0
        )
        if Y_KSCALE:
            ks = tl.load(KSCALE + rk, mask=k_ok, other=0.0)
            y = cast_to(y.to(ACC) * ks[:, None], y.dtype)
        if SPLIT_X:
            # fp32 X on 16-bit tensor cores: x = hi + lo, both exact in Y's dtype to about
            # 2^-16 relative, so the product keeps fp32-like accuracy at two MMAs
            x_hi = cast_to(x, y.dtype)
            x_lo = cast_to(x - x_hi.to(tl.float32), y.dtype)
            acc = mma(x_hi, y, acc, PRECISION)
            acc = mma(x_lo, y, acc, PRECISION)
        else:
            acc = mma(x, y, acc, PRECISION)

    if M_SCALE:
        acc = acc * tl.load(MSCALE + rm, mask=m_ok, other=0.0)[:, None]
    out_offs = rm[:, None] * stride_om + rn[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    z_ok = out_ok
    if PAD_M:
        m_pad = tl.load(TAGS + rm, mask=m_ok, other=PAD_TAG) == PAD_TAG
        z_ok = out_ok & ~m_pad[:, None]
    if ACCUMULATE:
        acc += tl.load(ACC_IN + out_offs, mask=out_ok, other=0.0).to(ACC)
    if RADIAL:
        w = tl.zeros([BM], dtype=ACC)
        for p in range(0, n_parts):
            w += tl.load(RADW + p * stride_radw + rm, mask=m_ok, other=0.0).to(ACC)
        rinv = tl.load(RINV + rm, mask=m_ok, other=0.0).to(ACC)
        z = tl.load(Z + out_offs, mask=z_ok, other=0.0).to(ACC)
        acc -= (rinv * w)[:, None] * (z * rinv[:, None])
    if PAD_M:
        acc = tl.where(m_pad[:, None], 0.0, acc)
    tl.store(OUT + out_offs, cast_to(acc, OUT.dtype.element_ty), mask=out_ok)


_C = cfg
# The spill-free configs of the compiled candidates, sized for the heaviest variant
# (SPLIT_X), plus on sm_90 a spilling 128x128x64 the autotuner keeps only where it is
# faster; why each size: docs/triton.md, "Tuning tables".
_MM_32 = [_C(4, 3, BM=64, BN=64, BK=16, GROUP_M=8), _C(8, 3, BM=128, BN=64, BK=16, GROUP_M=8)]
_MM_64 = [_C(4, 2, BM=32, BN=64, BK=16, GROUP_M=8), _C(4, 2, BM=32, BN=32, BK=16, GROUP_M=8)]
MM = Kernel(
    _mm_kernel,
    {
        "sm80": {
            "16": [
                _C(8, 4, BM=128, BN=64, BK=32, GROUP_M=8),
                _C(8, 3, BM=128, BN=64, BK=64, GROUP_M=8),
                _C(4, 3, BM=64, BN=64, BK=64, GROUP_M=8),
                _C(4, 4, BM=64, BN=64, BK=32, GROUP_M=8),
            ],
            "32": _MM_32,
            "64": _MM_64,
        },
        "sm90": {
            "16": [
                _C(8, 3, BM=128, BN=128, BK=64, GROUP_M=8),
                _C(8, 3, BM=128, BN=64, BK=64, GROUP_M=8),
                _C(8, 3, BM=64, BN=128, BK=64, GROUP_M=8),
                _C(8, 4, BM=128, BN=64, BK=32, GROUP_M=8),
                _C(4, 3, BM=64, BN=64, BK=64, GROUP_M=8),
                _C(4, 4, BM=64, BN=64, BK=32, GROUP_M=8),
            ],
            "32": _MM_32 + [_C(8, 3, BM=64, BN=64, BK=32, GROUP_M=8)],
            "64": _MM_64,
        },
        # interpreter: wide along d (fewer Python-speed programs), still crossing d > 64
        "interp": {"16": [_C(BM=16, BN=64, BK=16, GROUP_M=2)]},
    },
    dtype_arg="Y",
    # ACCUMULATE may read and write the same buffer: benchmarking configs must not compound
    restore_value=["OUT"],
)
