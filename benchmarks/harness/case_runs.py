"""One case of a pytest-benchmark file, timed the way the loss grid times it.

A benchmark file parametrises one test per (workload, implementation). Timing each item on
its own (``benchmark.pedantic``: a few rounds of one implementation, then the next) lets a
busy machine favour whichever ran in a quiet minute: an earlier harness saw ``cpp`` at 0.24-0.30x
eager in ``bench_api.py`` / ``bench_st.py`` where an idle run gives ~1.9x. Instead, the
first item of a workload builds the step of every selected implementation of that
workload, :func:`run_case` times them together in ``benchmarks.harness.timing.interleave``'s
rotating rounds, and each item then hands its own rounds to pytest-benchmark
(``timing.replay``) and records the same fields as the loss grid (``timing.impl_fields``,
``timing.case_fields``: ``min_s``, ``spread``, ``noisy``, rounds, load average), so the
end-of-run summary marks noisy cases here too.

    runs = case_runs.CaseRuns()
    run = runs.get(key, lambda: case_runs.run_case({impl: build_step_of(impl) for impl in members}))
    harness.replay_and_fields(benchmark, run, impl)   # -> the record's fields
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.harness import timing

__all__ = ["CaseRun", "CaseRuns", "run_case", "selected_params", "record_fields"]


@dataclass
class CaseRun:
    """What one workload's interleaved run left for its items (numbers and reasons, no tensors)."""

    outcomes: dict[str, tuple[str, object]] = field(default_factory=dict)  # impl -> ("ok"|"skip"|"error", x)
    samples: dict[str, list[float]] = field(default_factory=dict)
    info: dict[str, dict] = field(default_factory=dict)  # impl -> its record fields
    case_info: dict = field(default_factory=dict)  # shared by every record of the workload
    order: list[list[str]] = field(default_factory=list)  # the order of each timed round


def run_case(
    builders: dict[str, Callable[[], Callable[[], object]]],
    *,
    settings: dict | None = None,
    threads: int | None = None,
    skip_reason: Callable[[BaseException], str | None] = lambda exc: None,
) -> CaseRun:
    """Build each implementation's step (``builders[impl]()``: checks the implementation's
    value and returns a zero-argument step), then time every step that was built in one
    interleaved loop (``settings``: ``timing.interleave``'s knobs, default
    ``timing.settings()``) on ``threads`` intra-op threads (restored afterwards).

    A builder or step that raises is that implementation's outcome: ``("skip", reason)``
    when ``skip_reason(exc)`` gives one, else ``("error", exc)``; the others go on.
    """
    run = CaseRun()
    steps = {}
    for impl, build in builders.items():
        try:
            steps[impl] = build()
        except Exception as exc:  # noqa: BLE001 - each implementation's item reports its own outcome
            traceback.clear_frames(exc.__traceback__)
            why = skip_reason(exc)
            run.outcomes[impl] = ("skip", why) if why else ("error", exc)
    if not steps:
        return run
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        load_before = os.getloadavg()
        result = timing.interleave(steps, **(settings if settings is not None else timing.settings()))
        load_after = os.getloadavg()
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    steps = None  # free the implementations' tensors before the next workload
    for impl, exc in result.errors.items():
        why = skip_reason(exc)
        run.outcomes[impl] = ("skip", why) if why else ("error", exc)
    timed = [n for n in result.samples if result.samples[n]]
    run.case_info = timing.case_fields(
        result, timed, threads=used, loadavg_before=load_before, loadavg_after=load_after
    )
    run.order = result.order
    for impl in timed:
        run.outcomes[impl] = ("ok", None)
        run.samples[impl] = result.samples[impl]
        run.info[impl] = timing.impl_fields(result, impl)
    return run


class CaseRuns:
    """Each workload's :class:`CaseRun`, made once by the workload's first item."""

    def __init__(self):
        self._runs: dict[object, CaseRun] = {}

    def get(self, key, make: Callable[[], CaseRun]) -> CaseRun:
        if key not in self._runs:
            self._runs[key] = make()
        return self._runs[key]


def record_fields(benchmark, run: CaseRun, impl: str) -> dict:
    """Hand ``impl``'s rounds to ``benchmark`` (skips or raises its outcome otherwise) and
    return the fields its record takes: its own timing fields and the case's."""
    import pytest

    kind, what = run.outcomes.get(impl, ("error", RuntimeError(f"{impl} was not part of its case's run")))
    if kind == "skip":
        pytest.skip(what)
    if kind == "error":
        raise what
    timing.replay(benchmark, run.samples[impl])
    return {**run.info[impl], **run.case_info}


def selected_params(session, file_name: str, test_name: str) -> list[dict]:
    """The parameters of every selected (collected, not deselected) item of ``test_name`` in
    ``file_name``, in run order: who else shares a workload's interleaved run."""
    out = []
    for item in session.items:
        if item.path.name == file_name and getattr(item, "originalname", None) == test_name:
            callspec = getattr(item, "callspec", None)
            if callspec is not None:
                out.append(dict(callspec.params))
    return out
