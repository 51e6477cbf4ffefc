"""The user-facing options against the peer that offers them today.

* labels-SupCon: ``fastcl.losses.supcon_labels_loss`` (two views per sample) against
  pytorch-metric-learning's ``SupConLoss`` on the same flattened features and labels
  (PML builds the ``N x N`` distance matrix and float masks).
* joint-direction MNRL: ``fastcl.losses.mnrl_loss`` with the GTE directions
  (``query_to_doc``, ``query_to_query``, ``doc_to_query``, ``doc_to_doc``, one joint
  partition; with and without ``in_batch_negatives`` hardness) against
  sentence-transformers 6's ``MultipleNegativesRankingLoss`` with the same options (its
  ``B x 3B`` query rows and ``B x 3B`` document rows, concatenated).
* Matryoshka MNRL: ``fastcl.losses.mnrl_loss`` with ``matryoshka_dims=(768, 512, 256,
  128, 64)`` (all prefixes in one fused pass over ``d``) against sentence-transformers'
  ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)`` (``mini_batch_size=32``) on the
  same embeddings: K chunked losses and K backward passes into the embeddings.

The loss stage only: forward + backward to the embeddings (``benchmarks.harness.api_cases``).
Before timing, each implementation's value is checked against the peer's (float32, same
inputs). The peer is recorded under its own name (``pml-supcon``: PML ``SupConLoss``,
``st-mnrl``: sentence-transformers 6 ``MultipleNegativesRankingLoss``,
``st-matryoshka-cmnrl``: ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)``) as the
baseline of the run's ratio summary, fastcl as ``fastcl-<backend>``. Peak memory: extra peak RSS of one step in a fresh process
(``benchmarks.harness.memory``), every selected case probed before the first is timed, by
``--bench-memory-workers`` probe servers (at most cores // threads) that import the
libraries once and fork a child per case. Time: the loss grid's interleaved rounds
(``benchmarks.harness.case_runs``): the first item of a workload times every selected
implementation of it together, round by round in a rotating order after a warm-up, until
their fastest rounds agree or the case's budget ends; the record has the minimum over
rounds (``min_s``), its spread and the case's ``noisy`` flag. On ``--bench-threads``
intra-op threads (default: all cores, as in ``bench_losses.py``).

    pytest benchmarks/bench_api.py --benchmark-only
    pytest benchmarks/bench_api.py --benchmark-only --bench-no-memory   # skip the memory probes
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks import options
from benchmarks.harness import api_cases, case_runs
from benchmarks.harness.memory import cpu_extra_peak_mib_parallel
from fastcl.ops import dispatch
from fastcl.testing import value_tol

THREADS = torch.get_num_threads()  # --bench-threads, set by benchmarks/conftest.py
MEMORY = options.CURRENT.memory
# probe servers at once: this file's probes are GEMM-bound steps on THREADS threads each, so
# more of them than the cores hold oversubscribe (on 2 cores: 77 s with two, 58 s with one);
# bench_losses' probes, mostly compiling and importing, gain from two
MEMORY_WORKERS = max(1, min(options.CURRENT.memory_workers, len(os.sched_getaffinity(0)) // THREADS))
# imported once by each memory probe server, before it forks a child per case
PRELOAD = ("benchmarks.harness.api_cases", "fastcl.losses", "sentence_transformers", "pytorch_metric_learning")

# (N features, d, labels): two views per sample
SUPCON_GRID = [(2048, 128, 64), (8192, 128, 256)]
SUPCON_IMPLS = ["pml-supcon", "torch", "cpp"]
# (B, Q, d, hardness_mode)
MNRL_GRID = [(1024, 1, 384, None), (4096, 0, 64, None), (1024, 1, 384, "in_batch_negatives")]
MNRL_IMPLS = ["st-mnrl", "torch", "cpp"]
# (B, Q, d); dims api_cases.MATRYOSHKA_DIMS
MATRYOSHKA_GRID = [(1024, 1, 768), (2048, 1, 768)]
MATRYOSHKA_IMPLS = ["st-matryoshka-cmnrl", "torch", "cpp", "cpp-per-prefix"]
PEERS = ("pml-supcon", "st-mnrl", "st-matryoshka-cmnrl")
TIMING = options.timing_settings()  # the interleaved loop's knobs (pytest options)


def _name(impl: str) -> str:
    return impl if impl in PEERS else f"fastcl-{impl}"


def _unavailable(impl: str) -> str | None:
    """Why ``impl`` cannot run here (None: it can)."""
    backend = impl.removesuffix("-per-prefix")
    if backend in dispatch.NAMES:
        status = dispatch.describe()[backend]
        return None if status == "available" else f"backend {impl!r}: {status}"
    module = {"pml-supcon": "pytorch_metric_learning"}.get(impl, "sentence_transformers")
    try:
        __import__(module)
    except ImportError:
        return f"{impl}: {module} is not installed"
    return None


def _available(impl: str) -> None:
    why = _unavailable(impl)
    if why:
        pytest.skip(why)


# the api_cases step of each test and its case from the test's parameters: the tests and
# the memory probes (which run before the first test) build the same cases
def _supcon_case(N, d, labels, impl) -> dict:
    return dict(backend=impl, N=N, d=d, num_labels=labels)


def _mnrl_case(B, Q, d, hardness, impl) -> dict:
    return dict(backend=impl, B=B, d=d, Q=Q, hardness_mode=hardness)


def _matryoshka_case(B, Q, d, impl) -> dict:
    return dict(backend=impl, B=B, d=d, Q=Q)


STEP_OF_TEST = {
    "test_supcon_labels_fwd_bwd": ("supcon_labels_step", _supcon_case),
    "test_mnrl_gte_joint_fwd_bwd": ("mnrl_directions_step", _mnrl_case),
    "test_matryoshka_mnrl_fwd_bwd": ("matryoshka_step", _matryoshka_case),
}


def _probe_key(step: str, case: dict) -> str:
    return json.dumps({"step": step, **case}, sort_keys=True)


@pytest.fixture(scope="module")
def cpu_memory(request) -> dict:
    """Extra peak RSS (MiB) of one step of every selected case of this file, each in a fresh
    process, ``MEMORY_WORKERS`` at a time, before any timing starts (RSS does not depend on load)."""
    if not MEMORY:
        return {}
    wanted = []
    for item in request.session.items:
        if item.path.name != Path(__file__).name or item.originalname not in STEP_OF_TEST:
            continue
        step, case_of = STEP_OF_TEST[item.originalname]
        params = item.callspec.params
        if not _unavailable(params["impl"]):
            wanted.append({"step": step, **case_of(**params)})
    peaks = cpu_extra_peak_mib_parallel(
        "benchmarks.harness.api_cases:api_step", wanted, preload=PRELOAD, threads=THREADS, workers=MEMORY_WORKERS
    )
    return {json.dumps(c, sort_keys=True): p for c, p in zip(wanted, peaks)}


def _peak_mib(cpu_memory: dict, step: str, case: dict) -> float | None:
    """The probed peak of this case; a probe that failed fails the case, saying how to rerun it."""
    if not MEMORY:
        return None
    peak = cpu_memory.get(_probe_key(step, case))
    if peak is None:
        pytest.fail(
            "memory probe failed; to see why: python -m benchmarks.harness.memory "
            f"benchmarks.harness.api_cases:{step} '{json.dumps(case)}'"
        )
    return peak


_PEER_VALUES: dict[tuple, torch.Tensor] = {}


def _peer_value(key: tuple, peer) -> torch.Tensor:
    """The peer's loss on a workload's inputs, computed once per workload: the inputs are
    seeded, so every implementation's value check of that workload compares with the same
    number (the peer is slow: PML SupCon at N = 8192 takes seconds per call)."""
    if key not in _PEER_VALUES:
        _PEER_VALUES[key] = peer().detach()
    return _PEER_VALUES[key]


class _Unavailable(Exception):
    pass


def run_case(test: str, params: dict, impls: list[str], settings: dict | None = None) -> case_runs.CaseRun:
    """Every implementation of one workload of ``test`` (its parameters but ``impl``):
    each value-checked against the peer, then all timed in one interleaved loop."""
    step, case_of = STEP_OF_TEST[test]
    check = VALUE_CHECKS[test]

    def builder(impl):
        def build():
            why = _unavailable(impl)
            if why:
                raise _Unavailable(why)
            check(impl, **params)
            return getattr(api_cases, step)(**case_of(**params, impl=impl))

        return build

    return case_runs.run_case(
        {impl: builder(impl) for impl in impls},
        settings=TIMING if settings is None else settings,
        threads=THREADS,
        skip_reason=lambda exc: str(exc) if isinstance(exc, _Unavailable) else None,
    )


_RUNS = case_runs.CaseRuns()


def _run(benchmark, bench_record, cpu_memory, request, test: str, params: dict, impl: str, workload: str) -> None:
    """Time ``impl`` in its workload's interleaved run and record it with its probed peak memory."""
    _available(impl)
    step, case_of = STEP_OF_TEST[test]
    peak = _peak_mib(cpu_memory, step, case_of(**params, impl=impl))

    def members() -> list[str]:  # the selected implementations of this workload
        chosen = case_runs.selected_params(request.session, Path(__file__).name, test)
        same = [p for p in chosen if {k: v for k, v in p.items() if k != "impl"} == params]
        return [p["impl"] for p in same if not _unavailable(p["impl"])]

    disabled = dict(warmup=0, min_rounds=1, max_rounds=1) if benchmark.disabled else None
    key = (test, tuple(sorted(params.items(), key=lambda kv: kv[0])))
    run = _RUNS.get(key, lambda: run_case(test, params, members(), disabled))
    fields = case_runs.record_fields(benchmark, run, impl)
    # the peer, under its own name, is the baseline of the end-of-run summary's ratios
    bench_record(benchmark, workload=workload, impl=_name(impl), peak_mib=peak, baseline=impl in PEERS, **fields)


# --------------------------------------------------------------------------- value checks
# like with like: each implementation's loss equals the peer's on the same inputs before timing


def _check_supcon(impl, N, d, labels):
    features, y = api_cases.supcon_labels_inputs(N, d, labels)
    with torch.no_grad():
        got = api_cases.supcon_labels_fn(impl, features, y)()
        want = _peer_value(("supcon", N, d, labels), api_cases.supcon_labels_fn("pml-supcon", features, y))
    _assert_same_value(got, want, B=N, N=N, d=d, logit_scale=1 / api_cases.TEMPERATURE)


def _check_mnrl(impl, B, Q, d, hardness):
    columns = api_cases.mnrl_directions_inputs(B, d, Q)
    strength = 5.0 if hardness else 0.0
    with torch.no_grad():
        got = api_cases.mnrl_directions_fn(impl, columns, hardness_mode=hardness, hardness_strength=strength)()
        peer = api_cases.mnrl_directions_fn("st-mnrl", columns, hardness_mode=hardness, hardness_strength=strength)
        want = _peer_value(("mnrl", B, Q, d, hardness), peer)
    # the hardness weights add up to hardness_strength to a logit
    _assert_same_value(got, want, B=B, N=(2 + Q) * B, d=d, logit_scale=1 / api_cases.TEMPERATURE + strength)


def _check_matryoshka(impl, B, Q, d):
    columns = api_cases.mnrl_directions_inputs(B, d, Q)
    with torch.no_grad():
        got = api_cases.matryoshka_fn(impl, columns)()
        want = _peer_value(("matryoshka", B, Q, d), api_cases.matryoshka_fn("st-matryoshka-cmnrl", columns))
    _assert_same_value(got, want, B=B, N=(2 + Q) * B, d=d, logit_scale=1 / api_cases.TEMPERATURE)


def _assert_same_value(got, want, *, B: int, N: int, d: int, logit_scale: float) -> None:
    """Two float32 computations of one loss value, each within ``value_tol`` of the exact one."""
    atol, rtol = value_tol(torch.float32, B=B, N=N, d=d, logit_scale=logit_scale)
    torch.testing.assert_close(got, want, rtol=2 * rtol, atol=2 * atol)


VALUE_CHECKS = {
    "test_supcon_labels_fwd_bwd": _check_supcon,
    "test_mnrl_gte_joint_fwd_bwd": _check_mnrl,
    "test_matryoshka_mnrl_fwd_bwd": _check_matryoshka,
}


@pytest.mark.parametrize("impl", SUPCON_IMPLS)
@pytest.mark.parametrize("N, d, labels", SUPCON_GRID, ids=lambda v: str(v))
def test_supcon_labels_fwd_bwd(benchmark, bench_record, cpu_memory, request, N, d, labels, impl):
    _run(
        benchmark,
        bench_record,
        cpu_memory,
        request,
        "test_supcon_labels_fwd_bwd",
        dict(N=N, d=d, labels=labels),
        impl,
        f"SupCon labels N={N} V=2 d={d} labels={labels} fp32",
    )


@pytest.mark.parametrize("impl", MNRL_IMPLS)
@pytest.mark.parametrize("B, Q, d, hardness", MNRL_GRID, ids=lambda v: str(v))
def test_mnrl_gte_joint_fwd_bwd(benchmark, bench_record, cpu_memory, request, B, Q, d, hardness, impl):
    _run(
        benchmark,
        bench_record,
        cpu_memory,
        request,
        "test_mnrl_gte_joint_fwd_bwd",
        dict(B=B, Q=Q, d=d, hardness=hardness),
        impl,
        f"MNRL GTE joint B={B} Q={Q} d={d} hardness={hardness} fp32",
    )


@pytest.mark.parametrize("impl", MATRYOSHKA_IMPLS)
@pytest.mark.parametrize("B, Q, d", MATRYOSHKA_GRID, ids=lambda v: str(v))
def test_matryoshka_mnrl_fwd_bwd(benchmark, bench_record, cpu_memory, request, B, Q, d, impl):
    dims = ",".join(map(str, api_cases.MATRYOSHKA_DIMS))
    _run(
        benchmark,
        bench_record,
        cpu_memory,
        request,
        "test_matryoshka_mnrl_fwd_bwd",
        dict(B=B, Q=Q, d=d),
        impl,
        f"Matryoshka MNRL B={B} Q={Q} d={d} dims=({dims}) fp32",
    )
