"""Work and speed-of-light numbers for a benchmark case: FLOPs, the device's GEMM rate.

A fused loss does four ``B x N x d`` matrix products per forward + backward (forward,
recompute, d anchor, d candidates; docs/design.md): ``8 * B * N * d`` FLOPs. The GEMM rate is
measured in the same interleaved rounds as the implementations, on the same device and
dtype (one ``[B, d] @ [d, N]`` product into a preallocated output, :func:`gemm_step`), so
"share of GEMM" = achieved / measured, not a datasheet peak; see ``benchmarks.harness.shares``
for when that share is sound enough to print.
"""

from __future__ import annotations

import torch

from benchmarks.harness.cases import DTYPES


def num_candidates(loss: str, B: int, P: int, Q: int) -> int:
    """N, the columns of the logits: ``B`` for InfoNCE, CLIP and SigLIP; ``B * (3 + Q)`` for
    GIST (anchor–positive, anchor–anchor, positive–positive, anchor–negative blocks);
    ``B * (P + Q)`` otherwise."""
    if loss in ("infonce", "clip", "siglip"):
        return B
    if loss == "gist":
        return B * (3 + Q)
    return B * (P + Q)


def guide_flops(loss: str, B: int, P: int, Q: int) -> int:
    """GIST's guide: one forward ``[B, g] x [g, N]`` product (no gradient); 0 otherwise."""
    if loss != "gist":
        return 0
    from benchmarks.harness.gist import GUIDE_D

    return 2 * B * num_candidates(loss, B, P, Q) * GUIDE_D


def loss_flops(loss: str, B: int, P: int, Q: int, d: int) -> int:
    """``8 * B * N * d``: the four GEMM passes of a forward + backward with recompute (GIST:
    and its guide's forward product)."""
    return 8 * B * num_candidates(loss, B, P, Q) * d + guide_flops(loss, B, P, Q)


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# Largest GEMM measured whole; bigger ones are measured on a column slice of this many
# elements (B x N_slice), which runs at the same rate once the product is large.
_MAX_GEMM_ELEMENTS = 2**26


def gemm_columns(B: int, N: int) -> int:
    """Columns of the GEMM timed for a ``[B, d] @ [d, N]`` rate (a slice of N when large)."""
    return max(1, min(N, _MAX_GEMM_ELEMENTS // max(B, 1)))


def gemm_step(B: int, N: int, d: int, dtype: str = "float32", device: str = "cpu", seed: int = 0):
    """A zero-argument callable computing ``[B, d] @ [d, n]`` once into a preallocated
    output (``n = gemm_columns(B, N)``), for the case's interleaved rounds; ``step.flops``
    is its ``2 B n d``. The output is allocated once: a fresh ``[B, n]`` per call would time
    the allocator and first-touch page faults too.

    On CUDA, bf16/fp16 use tensor cores and float32 uses whatever
    ``torch.backends.cuda.matmul.allow_tf32`` says (tf32 when set).
    """
    dt = DTYPES[dtype]
    n = gemm_columns(B, N)
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(B, d, device=device, dtype=torch.float32, generator=g).to(dt)
    c = torch.randn(d, n, device=device, dtype=torch.float32, generator=g).to(dt)
    out = torch.empty(B, n, device=device, dtype=dt)

    def step():
        torch.mm(a, c, out=out)
        synchronize(device)
        return out

    step.flops = 2 * B * n * d
    step.inputs = (a, c)  # for tests
    return step


def tflops(flops: float, seconds: float | None) -> float | None:
    """``flops / seconds`` in TFLOP/s (None when the time is unknown)."""
    return None if not seconds else flops / seconds / 1e12
