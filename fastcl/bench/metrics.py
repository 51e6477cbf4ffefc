"""Work and speed-of-light numbers for a benchmark case: FLOPs, the device's GEMM rate.

A fused loss does four ``B x N x d`` matrix products per forward + backward (forward,
recompute, d anchor, d candidates; docs/design.md): ``8 * B * N * d`` FLOPs. The GEMM rate is
measured in the same run on the same device and dtype (one ``[B, d] @ [d, N]`` product,
best of a few), so "share of GEMM" = achieved / measured, not a datasheet peak.
"""

from __future__ import annotations

import time
from functools import cache

import torch

from fastcl.bench.cases import DTYPES


def num_candidates(loss: str, B: int, P: int, Q: int) -> int:
    """N, the columns of the logits: ``B`` for InfoNCE, ``B * (P + Q)`` otherwise."""
    return B if loss == "infonce" else B * (P + Q)


def loss_flops(loss: str, B: int, P: int, Q: int, d: int) -> int:
    """``8 * B * N * d``: the four GEMM passes of a forward + backward with recompute."""
    return 8 * B * num_candidates(loss, B, P, Q) * d


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# Largest GEMM measured whole; bigger ones are measured on a column slice of this many
# elements (B x N_slice), which runs at the same rate once the product is large.
_MAX_GEMM_ELEMENTS = 2**26


@cache
def gemm_tflops(B: int, N: int, d: int, dtype: str = "float32", device: str = "cpu", repeats: int = 5) -> float:
    """Measured TFLOP/s of ``[B, d] @ [d, N]`` in ``dtype`` on ``device`` (best of ``repeats``).

    Cached per shape for the process. On CUDA, bf16/fp16 use tensor cores and float32 uses
    whatever ``torch.backends.cuda.matmul.allow_tf32`` says (tf32 when set).
    """
    dt = DTYPES[dtype]
    n = max(1, min(N, _MAX_GEMM_ELEMENTS // max(B, 1)))
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(B, d, device=device, dtype=torch.float32, generator=g).to(dt)
    c = torch.randn(d, n, device=device, dtype=torch.float32, generator=g).to(dt)
    a @ c  # warm-up: library load, kernel choice
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        a @ c
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * B * n * d / best / 1e12
