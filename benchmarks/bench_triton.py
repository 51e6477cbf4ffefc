"""GPU benchmark of the ``"triton"`` backend (skipped with the reason on machines without CUDA).

SupMPN forward + backward, B in {1024, 4096, 16384}, P = Q = 5, d = 768, bf16, against
eager PyTorch (the reference), the ``torch.compile``d reference and the ``"torch"``
backend; plus the device's measured bf16 GEMM rate, the yardstick of the kernels' rate
(``8 B N d`` FLOPs per step, N = B (P + Q)). Before timing, each fastcl case is checked
against the ``"torch"`` backend at the same shape (values and gradients), so a fast wrong
kernel cannot post a number.

    pytest benchmarks/bench_triton.py --benchmark-only

Record results in benchmarks/RESULTS.md (none yet: no GPU was lent while this was written).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.cases import loss_fn, make_inputs
from fastcl.ops import dispatch

if not torch.cuda.is_available():
    pytest.skip("the triton benchmark needs a CUDA device", allow_module_level=True)

GRID = [("supmpn", B, 5, 5, 768) for B in (1024, 4096, 16384)]
IMPLS = ["eager", "compiled", "torch", "triton"]
DTYPE = "bfloat16"


def _flops(B, P, Q, d):
    return 8 * B * B * (P + Q) * d


def _fn(loss: str, impl: str):
    if impl == "compiled":
        return torch.compile(loss_fn(loss, "eager"))
    return loss_fn(loss, impl)


def _step(fn, inputs):
    leaves = [t for t in inputs.values() if t is not None]

    def step():
        for t in leaves:
            t.grad = None
        fn(**inputs).backward()
        torch.cuda.synchronize()

    return step, leaves


def _check_against_torch(loss, inputs, impl):
    """Relative error of the loss and every gradient vs the ``torch`` backend (bf16 bound)."""
    outs = {}
    for name in ("torch", impl):
        for t in inputs.values():
            if t is not None:
                t.grad = None
        value = loss_fn(loss, name)(**inputs)
        value.backward()
        outs[name] = [value.detach().float()] + [t.grad.float() for t in inputs.values() if t is not None]
    for want, got in zip(outs["torch"], outs[impl]):
        err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err < 3e-2, f"{impl} differs from the torch backend: relative error {err:.2e}"


def test_bf16_gemm_rate(benchmark, bench_record):
    """The yardstick: a large bf16 GEMM on this device."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def run():
        torch.mm(a, b)
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=3)
    bench_record(
        benchmark, workload="bf16 GEMM 8192^3", impl="cublas", tflops=2 * n**3 / benchmark.stats.stats.median / 1e12
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss, B, P, Q, d", GRID, ids=lambda v: str(v))
def test_triton_fwd_bwd(benchmark, bench_record, loss, B, P, Q, d, impl):
    if impl in ("torch", "triton"):
        status = dispatch.describe()[impl]
        if status != "available":
            pytest.skip(f"backend {impl!r}: {status}")
    inputs = make_inputs(loss, B, P, Q, d, DTYPE, "cuda")
    if impl == "triton":
        _check_against_torch(loss, inputs, impl)
    step, _ = _step(_fn(loss, impl), inputs)
    step()  # compile / autotune outside the timing
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        benchmark.pedantic(step, rounds=5, iterations=1, warmup_rounds=2)
    except torch.cuda.OutOfMemoryError:
        pytest.skip(f"{impl} runs out of memory at B={B}")
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    seconds = benchmark.stats.stats.median
    bench_record(
        benchmark,
        workload=f"{loss} B={B} P={P} Q={Q} d={d} {DTYPE}",
        impl=impl,
        peak_mib=extra,
        tflops=_flops(B, P, Q, d) / seconds / 1e12,
    )
