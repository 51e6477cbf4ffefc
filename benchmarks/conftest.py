"""pytest-benchmark setup: CPU defaults, peak memory in extra_info, a ratio table at the end.

Every case records ``extra_info["group_key"]`` (the workload) and ``extra_info["impl"]``;
the terminal summary prints each implementation's time and peak memory as a ratio of the
eager reference measured in the same run.
"""

from __future__ import annotations

import pytest

_RESULTS: list[dict] = []


def record(benchmark, *, workload: str, impl: str, **info) -> None:
    """Attach metadata to a benchmark and remember it for the summary table."""
    benchmark.extra_info.update(workload=workload, impl=impl, **info)
    _RESULTS.append({"benchmark": benchmark, "workload": workload, "impl": impl, **info})


@pytest.fixture
def bench_record():
    return record


def pytest_terminal_summary(terminalreporter):
    rows = [r for r in _RESULTS if getattr(r["benchmark"], "stats", None)]
    if not rows:
        return
    tr = terminalreporter
    tr.section("fastcl: time and peak memory relative to eager, same run")
    by_workload: dict[str, list[dict]] = {}
    for r in rows:
        by_workload.setdefault(r["workload"], []).append(r)
    for workload, items in by_workload.items():
        base = next((r for r in items if r["impl"] == "eager"), None)
        tr.write_line(workload)
        for r in items:
            t = r["benchmark"].stats.stats.median
            mem = r.get("peak_mib")
            line = f"  {r['impl']:<14} {t * 1e3:9.1f} ms"
            if base is not None:
                line += f"  ({base['benchmark'].stats.stats.median / t:5.2f}x eager speed)"
            if mem is not None:
                line += f"  peak {mem:8.1f} MiB"
                if base is not None and base.get("peak_mib"):
                    line += f" ({mem / base['peak_mib']:.3f}x eager)"
            tr.write_line(line)
