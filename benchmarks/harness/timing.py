"""Timing that a busy machine cannot fool: warm-up, interleaved rounds, a settle rule.

Every implementation of one benchmark case (and the GEMM floor, ``benchmarks.harness.floor``)
is timed in the same loop, **round by round**: round ``r`` runs each of them once, in an
order rotated by one place per round (:func:`round_order`), so drift in the machine's
load hits all of them alike and none always follows the same neighbour. Rounds go on
until every implementation's fastest rounds agree (:func:`spread` at most
:data:`SETTLE_SPREAD`), or a time budget ends, or :data:`MAX_ROUNDS` is reached; never
fewer than :data:`MIN_ROUNDS`. A budget that ends while a *reference* a share divides by (the
floor, one GEMM) is still too wide to divide by gets a second budget of rounds for it (still
at most ``MAX_ROUNDS``): on a busy machine the minimum and the third-fastest round of a
reference come closer with every round, so more rounds, not a lucky one, make a share printable.

The reported time is the **minimum** over rounds (the least disturbed run), with its
**spread**: how far the ``SPREAD_RANK``-th fastest round lies above the fastest, relative
to it. A minimum that one lucky round produced, or a machine that never gave two quiet
rounds in a row, shows as a wide spread. A case whose implementations do not all have a
spread of at most :data:`NOISY_SPREAD` is marked **noisy**: a ratio between two of its
times can then be off by more than the 5 % that the decisions these benchmarks support
(share of the floor, faster than ``torch.compile`` or not) need.

A step shorter than a scheduler tick says little per call; a *reference* step (the GEMM
floor, one GEMM: ``min_sample_s``) is therefore repeated back to back within its turn of a
round until one sample lasts ``min_sample_s``, the sample being the mean of those calls
(:func:`repeats_for`, calibrated on the last warm-up call). Repeats keep the inputs in
cache, so they can only make a reference faster: a share of it errs low, never high.

Every benchmark file uses this loop and records the same fields (:func:`impl_fields`,
:func:`case_fields`): ``min_s``, ``spread``, the case's ``noisy`` flag, rounds, how the
loop stopped, the load average around the case.

The thread count benchmarks run on is PyTorch's (``--bench-threads`` sets it for a
benchmark run; default all cores: what users run).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SPREAD_RANK = 3  # spread = k-th fastest round vs the fastest
SETTLE_SPREAD = 0.02  # stop adding rounds once every implementation's spread is within 2 %
NOISY_SPREAD = 0.05  # above 5 % a ratio between two times of the case is not to be trusted
MIN_ROUNDS = 3
MAX_ROUNDS = 30
WARMUP_ROUNDS = 1
BUDGET_S = 5.0  # seconds of timed rounds per case, after the warm-up (the main job: ~5 min)
MAX_REPEATS = 64  # calls of one reference step per sample, at most


def settings(min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS, budget_s: float = BUDGET_S) -> dict:
    """The interleaved loop's knobs (``interleave``'s keyword arguments); the benchmark files
    take theirs from their pytest options (``benchmarks/options.py``)."""
    return dict(warmup=WARMUP_ROUNDS, min_rounds=min_rounds, max_rounds=max_rounds, budget_s=budget_s)


def spread(samples: list[float], rank: int = SPREAD_RANK) -> float:
    """``(t_k - t_1) / t_1`` with ``t_i`` the i-th fastest round and ``k = min(rank, rounds)``.

    ``inf`` with fewer than two rounds (one round says nothing about the noise).
    """
    if len(samples) < 2:
        return float("inf")
    ordered = sorted(samples)
    best, kth = ordered[0], ordered[min(rank, len(ordered)) - 1]
    if best <= 0:
        return 0.0 if kth <= 0 else float("inf")
    return (kth - best) / best


def is_noisy(spreads: list[float], threshold: float = NOISY_SPREAD) -> bool:
    """A case is noisy when any of its implementations' spread exceeds ``threshold``."""
    return any(not s <= threshold for s in spreads)  # NaN counts as noisy


def repeats_for(call_s: float | None, min_sample_s: float, max_repeats: int = MAX_REPEATS) -> int:
    """Calls per sample so that a sample of calls of ``call_s`` seconds lasts ``min_sample_s``
    (1 for an unknown or long call, at most ``max_repeats``)."""
    if not call_s or call_s <= 0 or call_s >= min_sample_s:
        return 1
    return max(1, min(max_repeats, math.ceil(min_sample_s / call_s)))


def best_ms(fn: Callable[[], object], reps: int, device: str = "cuda") -> float:
    """The fastest of ``reps`` calls of ``fn`` in milliseconds: on CUDA between two events
    around the call (the kernels' time, not the host's), elsewhere by the wall clock. For the
    GPU lease's one-off scripts, where one card runs nothing else; CPU comparisons of several
    implementations use :func:`interleave`."""
    import torch

    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def round_order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``names`` rotated left by ``r`` places."""
    if not names:
        return []
    k = r % len(names)
    return names[k:] + names[:k]


@dataclass
class Interleaved:
    """What :func:`interleave` measured."""

    samples: dict[str, list[float]]  # timed rounds per name, in round order
    first_s: dict[str, float]  # the first (warm-up) call per name: cold start, compile
    errors: dict[str, BaseException] = field(default_factory=dict)  # dropped from the rotation
    rounds: int = 0
    stopped: str = ""  # "settled" | "budget" | "reference_budget" | "max_rounds" | "disabled"
    order: list[list[str]] = field(default_factory=list)  # the order each timed round ran in
    elapsed_s: float = 0.0
    repeats: dict[str, int] = field(default_factory=dict)  # calls per sample (1 unless min_sample_s)

    def minimum(self, name: str) -> float:
        return min(self.samples[name])

    def spread(self, name: str) -> float:
        return spread(self.samples[name])

    def noisy(self) -> bool:
        return is_noisy([self.spread(n) for n in self.samples if self.samples[n]])


def interleave(
    steps: dict[str, Callable[[], object]],
    *,
    warmup: int = WARMUP_ROUNDS,
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    budget_s: float = BUDGET_S,
    settle: float = SETTLE_SPREAD,
    min_sample_s: dict[str, float] | None = None,
    max_repeats: int = MAX_REPEATS,
    references: list[tuple[str, ...]] | None = None,
    reference_budget_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Interleaved:
    """Time every step of ``steps`` round by round (see the module docstring).

    Each round runs every step once in :func:`round_order`. A step that raises is dropped
    from the rotation and its exception kept in ``errors`` (the others go on). Warm-up
    rounds run in the same rotation and are not timed, except that each step's very first
    call is kept in ``first_s``. ``min_sample_s``: for the steps it names, the calls per
    sample (:func:`repeats_for` of the last warm-up call; 1 without a warm-up); a sample is
    their mean.

    ``references``: groups of steps a share divides by (a group: the blockings of one floor,
    whose fastest counts). When the budget ends before the fastest of every group has a
    spread of at most :data:`NOISY_SPREAD`, rounds go on for up to ``reference_budget_s``
    more seconds (default: ``budget_s`` again), still within ``max_rounds``; the loop then
    stops as ``"reference_budget"`` (:func:`unsettled_references` says which stayed wide).
    """
    names = list(steps)
    out = Interleaved(samples={n: [] for n in names}, first_s={}, repeats={n: 1 for n in names})
    last_warm: dict[str, float] = {}

    def call(name: str, times: int = 1) -> float | None:
        t0 = clock()
        try:
            for _ in range(times):
                steps[name]()
        except Exception as exc:  # noqa: BLE001 - reported per implementation by the caller
            out.errors[name] = exc
            names.remove(name)
            out.samples.pop(name, None)
            out.repeats.pop(name, None)
            return None
        return (clock() - t0) / times

    for r in range(warmup):
        for name in round_order(list(names), r):
            seconds = call(name)
            if seconds is not None:
                out.first_s.setdefault(name, seconds)
                last_warm[name] = seconds
    for name, target in (min_sample_s or {}).items():
        if name in out.repeats:
            out.repeats[name] = repeats_for(last_warm.get(name), target, max_repeats)
    start = clock()
    r = 0
    while names:
        order = round_order(list(names), warmup + r)
        out.order.append(order)
        for name in order:
            seconds = call(name, out.repeats[name])
            if seconds is not None:
                out.samples[name].append(seconds)
                out.first_s.setdefault(name, seconds)
        r += 1
        if r < min_rounds:
            continue
        if all(spread(out.samples[n]) <= settle for n in names):
            out.stopped = "settled"
            break
        elapsed = clock() - start
        if elapsed >= budget_s:
            if r >= max_rounds or not unsettled_references(out, references or []):
                out.stopped = "budget"
                break
            if elapsed >= budget_s + (budget_s if reference_budget_s is None else reference_budget_s):
                out.stopped = "reference_budget"
                break
            continue  # a reference too wide to divide by: more rounds, within max_rounds
        if r >= max_rounds:
            out.stopped = "max_rounds"
            break
    out.rounds = r
    out.elapsed_s = clock() - start
    return out


def unsettled_references(
    result: Interleaved, groups: list[tuple[str, ...]], threshold: float = NOISY_SPREAD
) -> list[str]:
    """The fastest member of each group in ``groups`` whose spread exceeds ``threshold`` (a
    share of it would not be printed: ``benchmarks.harness.shares``); groups without timed
    samples (every member failed) are left out."""
    out = []
    for group in groups:
        timed = [n for n in group if result.samples.get(n)]
        if timed:
            best = min(timed, key=lambda n: min(result.samples[n]))
            if not result.spread(best) <= threshold:
                out.append(best)
    return out


def impl_fields(result: Interleaved, name: str) -> dict:
    """One implementation's record fields from an interleaved run: ``min_s`` (the time),
    ``median_s``, ``spread``, ``first_s`` (its first, cold call)."""
    samples = result.samples[name]
    return dict(
        min_s=min(samples),
        median_s=sorted(samples)[len(samples) // 2],
        spread=spread(samples),
        first_s=result.first_s.get(name),
    )


def case_fields(result: Interleaved, names: list[str], *, threads: int, loadavg_before, loadavg_after) -> dict:
    """Fields every record of a case shares: its ``noisy`` flag (over ``names``: the
    implementations, not the references), rounds, how the loop stopped, timed seconds, the
    threshold, the thread count and the load average before and after the case."""
    timed = [n for n in names if result.samples.get(n)]
    return dict(
        noisy=is_noisy([result.spread(n) for n in timed]),
        rounds=result.rounds,
        stopped=result.stopped,
        timed_s=round(result.elapsed_s, 3),
        noisy_threshold=NOISY_SPREAD,
        threads=threads,
        loadavg_before=list(loadavg_before),
        loadavg_after=list(loadavg_after),
    )


class ReplayTimer:
    """A clock that replays measured durations to pytest-benchmark.

    ``benchmark.pedantic`` reads its timer before and after each round; with this timer
    round ``i`` lasts exactly ``samples[i]``. That way the per-implementation records,
    their statistics and the JSON stay pytest-benchmark's own, while the times come from
    the interleaved loop above (a fixture can only time one callable, in isolation).
    """

    def __init__(self, samples: list[float]):
        self._samples = list(samples)
        self._now = 0.0
        self._calls = 0

    def __call__(self) -> float:
        if self._calls % 2 == 1:  # the end of a round
            self._now += self._samples[self._calls // 2]
        self._calls += 1
        return self._now


def replay(benchmark, samples: list[float]) -> None:
    """Hand ``samples`` (seconds per round) to a pytest-benchmark fixture as its rounds."""
    if not samples:
        raise ValueError("no timed rounds to record")
    if getattr(benchmark, "disabled", False):
        benchmark.pedantic(lambda: None)
        return
    if not hasattr(benchmark, "_timer"):
        raise RuntimeError("this pytest-benchmark has no BenchmarkFixture._timer to replay measured rounds into")
    benchmark._timer = ReplayTimer(samples)
    benchmark.pedantic(lambda: None, rounds=len(samples), iterations=1, warmup_rounds=0)
