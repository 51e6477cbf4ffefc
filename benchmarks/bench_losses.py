"""Forward + backward of each loss: fastcl's backends against the reference, its peers and the GEMM floor.

Every case (loss, B, P, Q, d, dtype, device) runs, in the same process and on the same
inputs, each implementation of ``benchmarks.harness.peers.IMPLS`` that computes the loss:
``eager`` (the oracle), ``compile`` (``torch.compile`` of the loss written for compile to
fuse, ``benchmarks.harness.fusable``), fastcl's backends (``torch``, ``cpp``, ``triton``:
whichever dispatch can run here; the others are skipped with dispatch's reason)
and the peers (sentence-transformers MNRL and CachedMNRL, pytorch-metric-learning NTXent
and SupCon, PyTorch's chunked ``linear_cross_entropy``; on CUDA Inf-CL, cut-cross-entropy,
Liger's fused linear cross-entropy, siglip-kernel; ``st-gist-gemm``: sentence-transformers'
GIST computation with a GEMM similarity). For CLIP and SigLIP ``eager`` is open_clip's
``ClipLoss`` / ``SigLipLoss``, for GIST sentence-transformers' ``GISTEmbedLoss``
computation (``peers.EAGER_IS``). Before timing,
each implementation's loss value is asserted equal to the float64 reference.

Timing (``benchmarks.harness.timing``): all implementations of a case, its GEMM **floor**
(the three GEMMs of a gradient-in-forward step at that shape, ``benchmarks.harness.floor``) and
one ``[B, d] @ [d, N]`` GEMM (the rate "share of GEMM" divides by) are timed together,
round by round in a rotating order, after a warm-up round, until their fastest rounds
agree or the case's time budget ends; a reference (the floor's fastest blocking, the GEMM)
still too wide to divide by then gets up to a second budget of rounds (``stopped`` is
``reference_budget`` where even that did not settle it). The references are repeated within their turn
until a sample lasts ``benchmarks.harness.shares.MIN_REFERENCE_SAMPLE_S``; a share of either is
recorded only where it was measured soundly (``benchmarks.harness.shares``), else ``None`` with
``floor_share_problem`` / ``gemm_share_problem`` saying why. The first test item of a case
runs that loop for every selected implementation of the case; each item then hands its
own rounds to pytest-benchmark (``timing.replay``), so the JSON, the table and
``python -m benchmarks.harness report`` keep one record per (case, implementation).

Per record (``extra_info``): ``min_s`` (the time), ``spread`` and the case's ``noisy``
flag, ``floor_s`` and ``floor_share`` (floor / time), peak memory (CPU: extra peak RSS
of a fresh process running one step, forked per case from a probe server that imported
the libraries once, ``benchmarks.harness.memory``; CUDA: max allocated beyond the inputs),
achieved TFLOP/s on ``8 * B * N * d`` and its share of the GEMM rate of the same rounds,
``threads``, ``compile_s`` (implementations that compile: seconds of their first calls beyond a step;
``None`` where the case compiled nothing, its graph being an earlier case's),
``cold_s`` (first value check + first step), the load average before and after the case.

    pytest benchmarks --benchmark-only                       # CPU grid (a few minutes)
    pytest benchmarks/bench_losses.py -m gpu --benchmark-only  # GPU grid (needs CUDA)
    ... --bench-threads 1                                    # one thread (default: all cores)
    ... --bench-no-memory                                    # skip the memory probes
    ... --bench-impls eager,torch,st-mnrl                    # a subset of implementations
    ... --bench-targets                                      # add the csrc CPU-target cases
    ... --bench-budget-s 5 --bench-min-rounds 3 --bench-max-rounds 30
    python -m benchmarks.harness report .benchmarks/fastcl-latest.json   # RESULTS.md + plots
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field

import pytest
import torch

from benchmarks import options
from benchmarks.harness import gist, image_text, peers, timing
from benchmarks.harness.cases import SENTENCE_LOSSES, make_inputs
from benchmarks.harness.floor import FLOOR_LIMITS, fastest_floor, floor_step, named_floor_plans, share_of_floor
from benchmarks.harness.memory import cpu_extra_peak_mib_parallel, cuda_extra_peak_bytes
from benchmarks.harness.metrics import gemm_step, loss_flops, num_candidates, synchronize, tflops
from benchmarks.harness.shares import (
    FLOOR_SHARE_CEILING,
    MIN_REFERENCE_SAMPLE_S,
    floor_share_problem,
    gemm_share_problem,
    share_problem,
)
from fastcl.ops.dispatch import BackendUnavailableError

# (loss, P, Q, d, dtype, batch sizes). SupMPN's setting P = Q = 5; SimCSE-sup (MNRL with
# one hard negative); SimCSE-unsup (InfoNCE) at d = 128 to reach larger B on 2 cores.
CPU_GRID = [
    ("supmpn", 5, 5, 768, "float32", (64, 256)),
    ("supcon", 5, 5, 768, "float32", (64, 256)),
    ("mnrl", 1, 1, 768, "float32", (256, 1024)),
    ("infonce", 1, 0, 128, "float32", (1024, 2048, 4096)),
    # image–text (open_clip's ClipLoss / SigLipLoss against fastcl's): the B = 16384 cases are
    # heavy (open_clip's 1 GiB logits, several copies; seconds per step): HEAVY_FLOPS
    ("clip", 1, 0, 512, "float32", (4096, 16384)),
    ("clip", 1, 0, 768, "float32", (4096, 16384)),
    ("siglip", 1, 0, 512, "float32", (4096, 16384)),
    ("siglip", 1, 0, 768, "float32", (4096, 16384)),
    # GIST (sentence-transformers' GISTEmbedLoss computation), one hard negative, guide d = 384:
    # ST's own computation (eager) fits at B = 128 only (its [B, B, d] broadcast: too_big);
    # B = 4096 is heavy too
    ("gist", 1, 1, 768, "float32", (128, 4096)),
]
# The csrc CPU targets, side by side in one run (opt-in, ~5 min more on 2 cores:
# --bench-targets): time at B = 1024, P = Q = 5, d = 768 and memory at B = 8192,
# P = Q = 5, d = 128 (eager holds several 2.5 GiB [B, N] float32 buffers there); and GIST
# against sentence-transformers' own computation at B = 512, near the largest batch its
# [B, B, d] broadcast runs at (~1 min more).
CPU_TARGET_GRID = [
    ("supmpn", 5, 5, 768, "float32", (1024,)),
    ("supmpn", 5, 5, 128, "float32", (8192,)),
    ("gist", 1, 1, 768, "float32", (512,)),
]
TARGET_IMPLS = ("eager", "compile", "torch", "cpp")
# GPU: bf16 at BERT-base width (768) and BERT-large width (1024), B up to 65536
# and beyond (eager runs out of memory first: such cases are skipped as "out of memory"
# and reported).
GPU_GRID = [
    ("infonce", 1, 0, 768, "bfloat16", (4096, 16384, 65536, 131072)),
    ("mnrl", 1, 1, 768, "bfloat16", (4096, 16384, 65536)),
    ("supmpn", 5, 5, 768, "bfloat16", (1024, 4096, 16384)),
    ("supcon", 5, 5, 768, "bfloat16", (1024, 4096, 16384)),
    ("infonce", 1, 0, 1024, "bfloat16", (4096, 16384, 65536)),
    ("supmpn", 5, 5, 1024, "bfloat16", (4096, 16384)),
    ("infonce", 1, 0, 768, "float32", (4096, 16384, 65536)),
    ("clip", 1, 0, 768, "bfloat16", (16384, 65536)),
    ("siglip", 1, 0, 768, "bfloat16", (16384, 65536)),
]
# this run's settings (pytest options, benchmarks/options.py), fixed before this import
SETTINGS = options.CURRENT
SELECTED = list(SETTINGS.impls)
IMPLS = [name for name in peers.IMPLS if not SELECTED or name in SELECTED]
MEMORY = SETTINGS.memory
MEMORY_WORKERS = SETTINGS.memory_workers
# the interleaved loop of benchmarks.harness.timing, per case
TIMING = options.timing_settings()
FLOOR = "floor"  # the tall blocking's name in the interleaved loop (benchmarks.harness.floor.named_floor_plans)
SYM_FLOOR = "sym-floor"  # CLIP's symmetric floor: four GEMMs (benchmarks.harness.floor, "symmetric floor")
SYMMETRIC_LOSSES = ("clip",)  # fastcl's one-process step runs both directions from one pass of LSEs
# CPU cases of at least this many FLOPs per step (8·B·N·d: the image–text B = 16384 and GIST
# B = 4096 ones; ~3 s at 100 GFLOP/s) are heavy: seconds per step for every implementation, so
# a warm-up round then --bench-heavy-rounds timed rounds, no budget
HEAVY_FLOPS = 2**38
# what the floor line of a case is (records: floor_kind)
FLOOR_KINDS = {
    None: "3 GEMMs",
    "gist": f"3 GEMMs + the guide's (d={gist.GUIDE_D})",
}
GEMM = "gemm"  # one [B, d] @ [d, N] product: the GEMM rate, timed in the same rounds (benchmarks.harness.metrics)
# imported once by the memory probe server, before it forks a child per case (dynamo and
# inductor: about a second of imports in every "compile" child otherwise)
PRELOAD = (
    "benchmarks.harness.peers",
    "sentence_transformers",
    "pytorch_metric_learning",
    "torch._dynamo",
    "torch._inductor.compile_fx",
)


def _cases(grid, device, marks=(), impls=None):
    for loss, P, Q, d, dtype, batches in grid:
        for B in batches:
            for impl in IMPLS:
                if loss in peers.IMPLS[impl].losses and (impls is None or impl in impls):
                    case = dict(loss=loss, backend=impl, B=B, P=P, Q=Q, d=d, dtype=dtype, device=device)
                    yield pytest.param(case, id=f"{device}-{loss}-B{B}-P{P}-Q{Q}-d{d}-{dtype}-{impl}", marks=marks)


TARGETS = SETTINGS.targets
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
    if case["loss"] == "gist" and case["backend"] == "eager":
        # ST's sim_matrix: nn.CosineSimilarity of [B, 1, d] and [1, N, d] views broadcasts to
        # [B, N, d] before reducing (and its backward likewise), per block of the row
        n = gist.broadcast_elements(case["B"], case["Q"], case["d"])
        if n > gist.MAX_BROADCAST_ELEMENTS:
            return (
                f"sentence-transformers' sim_matrix broadcasts [B, B, d] per block: {n:.2g} elements "
                f"({4 * n / 2**30:.0f} GiB in float32) > {gist.MAX_BROADCAST_ELEMENTS:.2g} at B={case['B']}; "
                "st-gist-gemm is the same computation with a GEMM sim_matrix"
            )
    limit = MAX_WORK.get(case["backend"])
    B, P = case["B"], case["P"]
    work = B * num_candidates(case["loss"], B, P, case["Q"]) * B * P
    if limit and work > limit:
        return f"O(B*N*B*P) pair bookkeeping: {work:.2g} > {limit:.2g} at B={B} (minutes per step)"
    return None


def not_runnable(case: dict) -> str | None:
    """Why this (case, implementation) is skipped before anything runs (None: it runs)."""
    if case["device"] == "cuda" and not torch.cuda.is_available():
        return "GPU grid: no CUDA device"
    return peers.unavailable(case["backend"], case["loss"], case["device"]) or too_big(case)


def _selected_cases(session) -> list[dict]:
    """The cases of this session's (selected, not deselected) items, in run order."""
    out = []
    for item in session.items:
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        if case and item.path.name == "bench_losses.py":
            out.append(case)
    return out


@pytest.fixture(scope="session")
def cpu_memory(request) -> dict:
    """Extra peak RSS (MiB) of one step per selected CPU case, each in a fresh process,
    ``MEMORY_WORKERS`` at a time, before any timing starts (RSS does not depend on load)."""
    if not MEMORY:
        return {}
    wanted = [c for c in _selected_cases(request.session) if c["device"] == "cpu" and not not_runnable(c)]
    peaks = cpu_extra_peak_mib_parallel(
        "benchmarks.harness.cases:loss_step",
        wanted,
        preload=PRELOAD,
        threads=torch.get_num_threads(),
        workers=MEMORY_WORKERS,
    )
    return {workload_name(c) + "|" + c["backend"]: p for c, p in zip(wanted, peaks)}


# ---------------------------------------------------------------------------------------
# One case: every selected implementation and the floor, interleaved
# ---------------------------------------------------------------------------------------


@dataclass
class CaseRun:
    """What one case's interleaved run left for its items: numbers and reasons, no tensors."""

    outcomes: dict[str, tuple[str, object]] = field(default_factory=dict)  # impl -> ("ok"|"skip"|"error", x)
    samples: dict[str, list[float]] = field(default_factory=dict)
    info: dict[str, dict] = field(default_factory=dict)  # impl -> extra_info of its record
    case_info: dict = field(default_factory=dict)  # shared by every record of the case


def _why_skipped(exc: BaseException, B: int) -> str | None:
    if isinstance(exc, BackendUnavailableError):  # dispatch: the backend cannot take these inputs
        return " ".join(str(exc).split())
    if isinstance(exc, torch.OutOfMemoryError):
        return f"out of memory at B={B}"
    return None


def heavy(case: dict) -> bool:
    """An image–text or GIST CPU case whose every step lasts seconds (``HEAVY_FLOPS``; the
    sentence-embedding grids keep their rounds, ``--bench-targets`` included)."""
    if case["device"] != "cpu" or case["loss"] in SENTENCE_LOSSES:
        return False
    return loss_flops(case["loss"], case["B"], case["P"], case["Q"], case["d"]) >= HEAVY_FLOPS


def timing_for(case: dict) -> dict:
    """The interleaved loop's knobs for ``case``: the run's, or for a heavy case a warm-up round
    and ``--bench-heavy-rounds`` timed rounds (at most ``--bench-max-rounds``), no budget."""
    if not heavy(case):
        return TIMING
    rounds = max(1, min(SETTINGS.heavy_rounds, TIMING["max_rounds"]))
    return dict(TIMING, min_rounds=rounds, max_rounds=rounds, budget_s=0.0)


def _dynamo_graphs() -> int | None:
    """Graphs torch.compile has compiled in this process so far (None: the counter is gone)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a private counter: without it, every compiling impl counts as compiled
        return None


def compiled_here(impl: peers.Impl, graphs_before: int | None, graphs_after: int | None) -> bool:
    """Whether ``impl``'s first calls in this case compiled anything: a ``torch.compile``
    implementation compiles one dynamic-shape graph per loss and process, so a later case of
    the loss reuses it (``compile_s`` is then ``None``, printed "n/a", not "0.0 s"); a CUDA
    graph is captured per case."""
    if not impl.compiles:
        return False
    if not impl.dynamo or graphs_before is None or graphs_after is None:
        return True
    return graphs_after > graphs_before


def _make_step(forward, leaves, device):
    def step():
        for t in leaves:
            t.grad = None
        forward().backward()
        synchronize(device)

    return step


def run_case(cases: list[dict], cpu_memory: dict, disabled: bool = False) -> CaseRun:
    """Check and time every implementation of ``cases`` (one workload) and its floor."""
    c0 = cases[0]
    loss, B, P, Q, d, dtype, device = (c0[k] for k in ("loss", "B", "P", "Q", "d", "dtype", "device"))
    workload = workload_name(c0)
    run = CaseRun()
    inputs = make_inputs(loss, B, P, Q, d, dtype, device)
    leaves = [t for t in inputs.values() if t is not None]
    reference = peers.reference_value(loss, inputs)
    steps = {}
    for case in cases:
        impl = case["backend"]
        try:
            graphs = _dynamo_graphs()
            forward = peers.build(impl, loss, inputs)
            t0 = time.perf_counter()
            check = peers.check_value(impl, loss, forward, inputs, expected=reference)
            check_s = time.perf_counter() - t0
            compiled = compiled_here(peers.IMPLS[impl], graphs, _dynamo_graphs())
            step = _make_step(forward, leaves, device)
            # CUDA: the first step's peak (its kernels compile), then a warm step's; the
            # scratch is the warm peak beyond the inputs *and their gradients* (the step sets
            # them to None first, so it allocates them); CPU: probed earlier, in fresh processes
            extra = {}
            if device == "cuda":
                first = cuda_extra_peak_bytes(step) / 2**20
                peak = cuda_extra_peak_bytes(step) / 2**20
                grads = sum(t.numel() * t.element_size() for t in leaves if t.requires_grad) / 2**20
                extra = dict(first_peak_mib=first, scratch_mib=max(peak - grads, 0.0))
            else:
                peak = cpu_memory.get(f"{workload}|{impl}")
        except Exception as exc:  # noqa: BLE001 - each implementation's item reports its own outcome
            traceback.clear_frames(exc.__traceback__)  # no frame keeps (possibly huge) tensors alive
            why = _why_skipped(exc, B)
            run.outcomes[impl] = ("skip", why) if why else ("error", exc)
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        steps[impl] = step
        run.info[impl] = dict(
            **extra,
            peak_mib=peak,
            loss_value=check["value"],
            reference_value=check["reference"],
            abs_err=check["abs_err"],
            check_s=check_s,
            compiled=compiled,
        )
        if loss == "clip" and peers.IMPLS[impl].family == "fastcl":  # symmetric step or two directions
            run.info[impl]["clip_path"] = image_text.clip_path(inputs, peers.IMPLS[impl].backend)
    N = num_candidates(loss, B, P, Q)
    limits = FLOOR_LIMITS[torch.device(device).type]
    guide_d = gist.GUIDE_D if loss == "gist" else None  # GIST's floor adds its guide's product
    floors = named_floor_plans(B, N, d, **limits)
    sym_floors = named_floor_plans(B, N, d, prefix=SYM_FLOOR, **limits) if loss in SYMMETRIC_LOSSES else {}
    gemm = gemm_step(B, N, d, dtype, device)
    references = [*floors, *sym_floors, GEMM]
    if steps:
        steps.update({name: floor_step(plan, dtype, device, guide_d=guide_d) for name, plan in floors.items()})
        steps.update({name: floor_step(plan, dtype, device, recompute=True) for name, plan in sym_floors.items()})
        steps[GEMM] = gemm
    settings = dict(warmup=0, min_rounds=1, max_rounds=1) if disabled else timing_for(c0)
    # the references (floor, GEMM) are short at small shapes: repeated within their turn
    min_sample = {name: MIN_REFERENCE_SAMPLE_S for name in references}
    load_before = list(os.getloadavg())
    # a share's reference still too wide to divide by when the budget ends gets more rounds
    groups = [tuple(floors), *([tuple(sym_floors)] if sym_floors else []), (GEMM,)]
    result = timing.interleave(steps, **settings, min_sample_s=min_sample, references=groups) if steps else None
    load_after = list(os.getloadavg())
    steps = inputs = leaves = forward = step = None  # free the case's tensors before the next one
    if result is None:
        return run
    for impl, exc in result.errors.items():
        if impl in references:  # reported as floor_error / gemm_error below; the implementations still count
            continue
        why = _why_skipped(exc, B)
        run.outcomes[impl] = ("skip", why) if why else ("error", exc)
    impls = [n for n in result.samples if n not in references]

    def sample_s(name):  # how long one timed sample of a reference lasted
        return min(result.samples[name]) * result.repeats[name] if result.samples.get(name) else None

    # the floor: the fastest of its blockings (benchmarks.harness.floor.floor_plans)
    best, floor_s = fastest_floor(floors, result.samples) or (FLOOR, None)
    floor_samples, plan = result.samples.get(best), floors[best]
    floor_spread = timing.spread(floor_samples) if floor_samples else None
    sym = {}  # CLIP: the symmetric floor, judged like the floor
    if sym_floors:
        sym_best, sym_s = fastest_floor(sym_floors, result.samples) or (SYM_FLOOR, None)
        sym_samples = result.samples.get(sym_best)
        sym = dict(
            sym_floor_s=sym_s,
            sym_floor_spread=timing.spread(sym_samples) if sym_samples else None,
            sym_floor_rows=sym_floors[sym_best].rows,
            sym_floor_scale=sym_floors[sym_best].scale,
            sym_floor_repeats=result.repeats.get(sym_best),
            sym_floor_sample_s=sample_s(sym_best),
            sym_floor_error="; ".join(repr(result.errors[n]) for n in sym_floors if n in result.errors) or None,
        )
    gemm_samples = result.samples.get(GEMM)
    gemm_rate = tflops(gemm.flops, min(gemm_samples)) if gemm_samples else None
    gemm_spread = timing.spread(gemm_samples) if gemm_samples else None
    run.case_info = dict(
        **timing.case_fields(
            result, impls, threads=torch.get_num_threads(), loadavg_before=load_before, loadavg_after=load_after
        ),
        eager_is=peers.EAGER_IS.get(loss),
        heavy=heavy(c0),
        floor_kind=FLOOR_KINDS.get(loss, FLOOR_KINDS[None]),
        **sym,
        floor_s=floor_s,
        floor_spread=floor_spread,
        floor_rows=plan.rows,
        floor_scale=plan.scale,
        floor_repeats=result.repeats.get(best),
        floor_sample_s=sample_s(best),
        floor_error="; ".join(repr(result.errors[n]) for n in floors if n in result.errors) or None,
        gemm_tflops=gemm_rate,
        gemm_spread=gemm_spread,
        gemm_repeats=result.repeats.get(GEMM),
        gemm_sample_s=sample_s(GEMM),
        gemm_in_rounds=True,
        gemm_error=repr(result.errors[GEMM]) if GEMM in result.errors else None,
    )
    for impl in impls:
        samples = result.samples[impl]
        run.outcomes[impl] = ("ok", None)
        run.samples[impl] = samples
        fields = timing.impl_fields(result, impl)
        best_s = fields["min_s"]
        info = run.info[impl]
        achieved = tflops(loss_flops(loss, B, P, Q, d), best_s)
        floor_share = share_of_floor(floor_s, best_s)
        floor_problem = floor_share_problem(floor_share, spread=floor_spread, sample_s=sample_s(best))
        gemm_share = achieved / gemm_rate if achieved and gemm_rate else None
        gemm_problem = gemm_share_problem(gemm_share, spread=gemm_spread, sample_s=sample_s(GEMM), in_rounds=True)
        info.update(
            min_s=best_s,
            median_s=fields["median_s"],
            spread=fields["spread"],
            cold_s=info["check_s"] + result.first_s[impl],
            tflops=achieved,
            # a share is recorded only where its reference was measured soundly (benchmarks.harness.shares);
            # the measured ratio and the reason stay in the record
            floor_share=None if floor_problem else floor_share,
            floor_share_measured=floor_share,
            floor_share_problem=floor_problem,
            gemm_share=None if gemm_problem else gemm_share,
            gemm_share_measured=gemm_share,
            gemm_share_problem=gemm_problem,
        )
        if sym:
            sym_share = share_of_floor(sym["sym_floor_s"], best_s)
            sym_problem = share_problem(
                sym_share,
                reference="symmetric floor",
                in_rounds=True,
                spread=sym["sym_floor_spread"],
                sample_s=sym["sym_floor_sample_s"],
                ceiling=FLOOR_SHARE_CEILING,
            )
            info.update(
                sym_floor_share=None if sym_problem else sym_share,
                sym_floor_share_measured=sym_share,
                sym_floor_share_problem=sym_problem,
            )
        if info.pop("compiled"):  # its first calls compiled (the check's forward, then fwd + bwd)
            info["compile_s"] = max(0.0, info["cold_s"] - best_s)
        elif peers.IMPLS[impl].compiles:  # its graph was compiled by an earlier case: no compile time here
            info["compile_s"] = None
    if device == "cuda":
        torch.cuda.empty_cache()
    return run


_RUNS: dict[str, CaseRun] = {}


@pytest.mark.parametrize("case", CASES)
def test_loss_fwd_bwd(benchmark, bench_record, bench_skip, cpu_memory, request, case):
    impl = case["backend"]
    workload = workload_name(case)
    if case["device"] == "cuda" and not torch.cuda.is_available():
        pytest.skip("GPU grid: no CUDA device")
    why = not_runnable(case)
    if why:
        bench_skip(workload, impl, why)
    if workload not in _RUNS:  # the case's first item times all of its implementations
        members = [c for c in _selected_cases(request.session) if workload_name(c) == workload and not not_runnable(c)]
        _RUNS[workload] = run_case(members, cpu_memory, disabled=benchmark.disabled)
    run = _RUNS[workload]
    kind, what = run.outcomes.get(impl, ("error", RuntimeError(f"{impl} was not part of its case's run")))
    if kind == "skip":
        bench_skip(workload, impl, what)
    if kind == "error":
        raise what
    timing.replay(benchmark, run.samples[impl])
    B, P, Q, d = case["B"], case["P"], case["Q"], case["d"]
    bench_record(
        benchmark,
        workload=workload,
        impl=impl,
        family=peers.IMPLS[impl].family,
        loss=case["loss"],
        B=B,
        P=P,
        Q=Q,
        d=d,
        dtype=case["dtype"],
        device=case["device"],
        **run.info[impl],
        **run.case_info,
    )
