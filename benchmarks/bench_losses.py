"""Forward + backward of each loss: fastcl's backends against the reference and its peers.

Every case runs, in the same process and on the same inputs, each implementation of
``fastcl.bench.peers.IMPLS`` that computes the loss: ``eager`` (the oracle), ``compile``
(``torch.compile`` of it), fastcl's backends (``torch``, ``cpp``, ``triton``, ``cuda``:
whichever dispatch can run here; the others are skipped with dispatch's reason) and the
peers (sentence-transformers MNRL and CachedMNRL, pytorch-metric-learning NTXent and
SupCon, PyTorch's chunked ``linear_cross_entropy``, Inf-CL on CUDA). Before timing, each
implementation's loss value is asserted equal to the float64 reference (like with like).

Per case (``extra_info``): median time of forward + backward (pytest-benchmark, one
warm-up round), peak memory (CPU: extra peak RSS of a fresh process running one step,
forked per case from a probe server that imported the libraries once,
``fastcl.bench.memory``; CUDA: max allocated beyond the inputs), achieved TFLOP/s on
``8 * B * N * d`` and its share of a GEMM of the same shape measured in the same run.

    pytest benchmarks --benchmark-only                       # CPU grid (a few minutes)
    pytest benchmarks/bench_losses.py -m gpu --benchmark-only  # GPU grid (needs CUDA)
    FASTCL_BENCH_MEMORY=0 ...                                # skip the memory probes
    FASTCL_BENCH_IMPLS=eager,torch,st-mnrl ...               # a subset of implementations
    FASTCL_BENCH_TARGETS=1 ...                               # add the csrc CPU-target cases
    python -m fastcl.bench report .benchmarks/fastcl-latest.json   # RESULTS.md + plots
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fastcl.bench import peers
from fastcl.bench.cases import make_inputs
from fastcl.bench.memory import cpu_extra_peak_bytes_many, cuda_extra_peak_bytes
from fastcl.bench.metrics import gemm_tflops, loss_flops, num_candidates, synchronize
from fastcl.ops.dispatch import BackendUnavailableError

# (loss, P, Q, d, dtype, batch sizes). SupMPN's setting P = Q = 5; SimCSE-sup (MNRL with
# one hard negative); SimCSE-unsup (InfoNCE) at d = 128 to reach larger B on 2 cores.
CPU_GRID = [
    ("supmpn", 5, 5, 768, "float32", (64, 256)),
    ("supcon", 5, 5, 768, "float32", (64, 256)),
    ("mnrl", 1, 1, 768, "float32", (256, 1024)),
    ("infonce", 1, 0, 128, "float32", (1024, 2048, 4096)),
]
# The csrc issue's CPU targets, side by side in one run (opt-in, ~5 min more on 2 cores:
# FASTCL_BENCH_TARGETS=1): time at B = 1024, P = Q = 5, d = 768 and memory at B = 8192,
# P = Q = 5, d = 128 (eager holds several 2.5 GiB [B, N] float32 buffers there).
CPU_TARGET_GRID = [
    ("supmpn", 5, 5, 768, "float32", (1024,)),
    ("supmpn", 5, 5, 128, "float32", (8192,)),
]
TARGET_IMPLS = ("eager", "torch", "cpp")
# GPU: bf16 at BERT-base width, B up to 65536 and beyond (eager runs out of memory first:
# such cases are skipped as "out of memory" and reported).
GPU_GRID = [
    ("infonce", 1, 0, 768, "bfloat16", (4096, 16384, 65536, 131072)),
    ("mnrl", 1, 1, 768, "bfloat16", (4096, 16384, 65536)),
    ("supmpn", 5, 5, 768, "bfloat16", (1024, 4096, 16384)),
    ("supcon", 5, 5, 768, "bfloat16", (1024, 4096, 16384)),
    ("infonce", 1, 0, 768, "float32", (4096, 16384, 65536)),
]
SELECTED = [s for s in os.environ.get("FASTCL_BENCH_IMPLS", "").split(",") if s]
IMPLS = [name for name in peers.IMPLS if not SELECTED or name in SELECTED]
MEMORY = os.environ.get("FASTCL_BENCH_MEMORY", "1") == "1"
MEMORY_WORKERS = int(os.environ.get("FASTCL_BENCH_MEMORY_WORKERS", "2"))
ROUNDS = {"cpu": 3, "cuda": 5}
# imported once by the memory probe server, before it forks a child per case
PRELOAD = ("fastcl.bench.peers", "sentence_transformers", "pytorch_metric_learning")


def _cases(grid, device, marks=(), impls=None):
    for loss, P, Q, d, dtype, batches in grid:
        for B in batches:
            for impl in IMPLS:
                if loss in peers.IMPLS[impl].losses and (impls is None or impl in impls):
                    case = dict(loss=loss, backend=impl, B=B, P=P, Q=Q, d=d, dtype=dtype, device=device)
                    yield pytest.param(case, id=f"{device}-{loss}-B{B}-P{P}-Q{Q}-d{d}-{dtype}-{impl}", marks=marks)


TARGETS = os.environ.get("FASTCL_BENCH_TARGETS", "0") == "1"
CASES = [
    *_cases(CPU_GRID, "cpu"),
    *(_cases(CPU_TARGET_GRID, "cpu", impls=TARGET_IMPLS) if TARGETS else ()),
    *_cases(GPU_GRID, "cuda", marks=(pytest.mark.gpu,)),
]


def workload_name(case: dict) -> str:
    return f"{case['loss']} B={case['B']} P={case['P']} Q={case['Q']} d={case['d']} {case['dtype']} {case['device']}"


# pytorch-metric-learning's NTXentLoss matches each positive pair with its negatives through
# a [pairs, negative pairs] mask: O(B * N * B * P) work and memory (B = 512 InfoNCE takes
# ~20 s per step on one core, B = 1024 ~150 s). Cases beyond this size skip it, saying so.
MAX_WORK = {"pml-ntxent": 2**25}


def too_big(case: dict) -> str | None:
    limit = MAX_WORK.get(case["backend"])
    B, P = case["B"], case["P"]
    work = B * num_candidates(case["loss"], B, P, case["Q"]) * B * P
    if limit and work > limit:
        return f"O(B*N*B*P) pair bookkeeping: {work:.2g} > {limit:.2g} at B={B} (minutes per step)"
    return None


def _probe_many(cases: list[dict]) -> list[float | None]:
    try:
        peaks = cpu_extra_peak_bytes_many("fastcl.bench.cases:loss_step", cases, preload=PRELOAD)
    except (RuntimeError, subprocess.TimeoutExpired):  # the tests report what they can
        return [None] * len(cases)
    return [None if p is None else p / 2**20 for p in peaks]


@pytest.fixture(scope="session")
def cpu_memory(request) -> dict:
    """Extra peak RSS (MiB) of one step per selected CPU case, each in a fresh process,
    ``MEMORY_WORKERS`` at a time, before any timing starts (RSS does not depend on load)."""
    if not MEMORY:
        return {}
    wanted = []
    for item in request.session.items:
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        if (case and case["device"] == "cpu" and not peers.unavailable(case["backend"], case["loss"], "cpu")
                and not too_big(case)):
            wanted.append(case)
    # one probe server per worker; each case still runs in its own fresh (forked) process
    chunks = [wanted[i::MEMORY_WORKERS] for i in range(MEMORY_WORKERS)]
    with ThreadPoolExecutor(max_workers=MEMORY_WORKERS) as pool:
        peaks = list(pool.map(_probe_many, chunks))
    out = {}
    for chunk, values in zip(chunks, peaks):
        out.update({workload_name(c) + "|" + c["backend"]: p for c, p in zip(chunk, values)})
    return out


@pytest.fixture(scope="session")
def reference_values() -> dict:
    """Float64 reference loss per workload, computed once and shared by its implementations."""
    return {}


@pytest.mark.parametrize("case", CASES)
def test_loss_fwd_bwd(benchmark, bench_record, bench_skip, cpu_memory, reference_values, case):
    loss, impl, device = case["loss"], case["backend"], case["device"]
    workload = workload_name(case)
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("GPU grid: no CUDA device")
    why = peers.unavailable(impl, loss, device) or too_big(case)
    if why:
        bench_skip(workload, impl, why)
    B, P, Q, d = case["B"], case["P"], case["Q"], case["d"]
    skipped = None
    try:
        inputs = make_inputs(loss, B, P, Q, d, case["dtype"], device)
        if workload not in reference_values:
            reference_values[workload] = peers.reference_value(loss, inputs)
        forward = peers.build(impl, loss, inputs)
        check = peers.check_value(impl, loss, forward, inputs, expected=reference_values[workload])
        leaves = [t for t in inputs.values() if t is not None]

        def step():
            for t in leaves:
                t.grad = None
            forward().backward()
            synchronize(device)

        if device == "cuda":
            step()
            peak = cuda_extra_peak_bytes(step) / 2**20
        else:
            peak = cpu_memory.get(workload + "|" + impl)
        benchmark.pedantic(step, rounds=ROUNDS[device], iterations=1, warmup_rounds=1)
    except BackendUnavailableError as exc:  # dispatch: the backend cannot take these inputs
        skipped = " ".join(str(exc).split())
    except torch.OutOfMemoryError:
        skipped = f"out of memory at B={B}"
    if skipped:
        # skip outside the handler so no traceback keeps the (possibly huge) inputs alive
        inputs = forward = step = leaves = None
        if device == "cuda":
            torch.cuda.empty_cache()
        bench_skip(workload, impl, skipped)
    seconds = benchmark.stats.stats.median
    flops = loss_flops(loss, B, P, Q, d)
    gemm = gemm_tflops(B, num_candidates(loss, B, P, Q), d, case["dtype"], device)
    tflops = flops / seconds / 1e12
    bench_record(
        benchmark, workload=workload, impl=impl, family=peers.IMPLS[impl].family,
        loss=loss, B=B, P=P, Q=Q, d=d, dtype=case["dtype"], device=device,
        peak_mib=peak, tflops=tflops, gemm_tflops=gemm, gemm_share=tflops / gemm,
        loss_value=check["value"], reference_value=check["reference"], abs_err=check["abs_err"],
        threads=torch.get_num_threads(),
    )

