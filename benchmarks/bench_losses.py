"""Forward + backward time and peak memory of each loss: eager reference vs fastcl backends.

CPU grid by default (a few minutes on 2 cores). Time: pytest-benchmark, median of a few
rounds after a warm-up. Peak memory: extra peak RSS of a fresh process running one step
(``fastcl.bench.memory``), so earlier cases cannot hide or inflate it.

    pytest benchmarks --benchmark-only                    # the CPU grid
    FASTCL_BENCH_MEMORY=0 pytest benchmarks ...           # skip the memory probes
"""

from __future__ import annotations

import os

import pytest
import torch

from fastcl.bench.cases import loss_step
from fastcl.bench.memory import cpu_extra_peak_bytes
from fastcl.ops import dispatch

# (loss, B, P, Q, d): SupMPN's setting P = Q = 5 and SimCSE-unsup's P = 1, Q = 0
CPU_GRID = [
    ("supmpn", 256, 5, 5, 768),
    ("supmpn", 1024, 5, 5, 768),
    ("supmpn", 4096, 5, 5, 64),
    ("infonce", 1024, 1, 0, 768),
    ("infonce", 8192, 1, 0, 128),
]
IMPLS = ["eager", "torch", "cpp"]


def _flops(B, P, Q, d, loss):
    n = B * (P + Q) if loss != "infonce" else B
    return 8 * B * n * d  # forward + backward with recompute, as in SPEC.md


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss, B, P, Q, d", CPU_GRID, ids=lambda v: str(v))
def test_loss_fwd_bwd(benchmark, bench_record, loss, B, P, Q, d, impl):
    if impl != "eager":
        status = dispatch.describe()[impl]
        if status != "available":
            pytest.skip(f"backend {impl!r}: {status}")
    case = dict(loss=loss, backend=impl, B=B, P=P, Q=Q, d=d, dtype="float32")
    step = loss_step(**case)
    peak = None
    if os.environ.get("FASTCL_BENCH_MEMORY", "1") == "1":
        peak = cpu_extra_peak_bytes("fastcl.bench.cases:loss_step", case) / 2**20
    benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=1)
    seconds = benchmark.stats.stats.median
    bench_record(
        benchmark, workload=f"{loss} B={B} P={P} Q={Q} d={d} fp32", impl=impl,
        peak_mib=peak, gflops=_flops(B, P, Q, d, loss) / seconds / 1e9,
        threads=torch.get_num_threads(),
    )
