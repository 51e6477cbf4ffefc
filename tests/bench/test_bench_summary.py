"""The end-of-run summary's lines (``benchmarks.conftest.workload_lines``): ratios against the
workload's baseline, named: a record marked ``baseline`` (a peer under its own name, as
bench_api's rows) before one called ``eager``; none without either."""

from __future__ import annotations

from benchmarks.conftest import workload_lines


def _row(impl: str, ms: float, peak: float | None = None, **extra) -> dict:
    return {"impl": impl, "min_s": ms / 1e3, "peak_mib": peak, **extra}


def test_a_named_peer_is_the_baseline():
    rows = [_row("st-matryoshka-cmnrl", 200.0, 400.0, baseline=True), _row("fastcl-cpp", 50.0, 40.0)]
    lines = workload_lines("Matryoshka MNRL B=1024", rows, [{"impl": "fastcl-triton", "reason": "no CUDA"}])
    assert lines[0] == "Matryoshka MNRL B=1024"
    assert "( 4.00x st-matryoshka-cmnrl speed)" in lines[2]
    assert "(0.100x st-matryoshka-cmnrl)" in lines[2]
    assert "eager" not in "\n".join(lines)
    # names line up: the column is as wide as the longest name
    assert lines[1].index(" 200.0 ms") == lines[2].index("  50.0 ms")
    assert lines[3].split() == ["fastcl-triton", "skipped:", "no", "CUDA"]


def test_eager_is_the_baseline_without_a_marked_one():
    lines = workload_lines("MNRL", [_row("fastcl-cpp", 10.0), _row("eager", 30.0)], [])
    assert "( 3.00x eager speed)" in lines[1] and "( 1.00x eager speed)" in lines[2]


def test_a_marked_baseline_wins_over_eager():
    rows = [_row("eager", 30.0), _row("pml-supcon", 60.0, baseline=True), _row("fastcl-cpp", 15.0)]
    lines = workload_lines("SupCon", rows, [])
    assert "( 2.00x pml-supcon speed)" in lines[1] and "( 4.00x pml-supcon speed)" in lines[3]


def test_no_baseline_no_ratio():
    lines = workload_lines("GIST", [_row("fastcl-cpp", 10.0, 5.0), _row("compile", 12.0, 9.0)], [])
    assert all("speed)" not in line and "MiB (" not in line for line in lines[1:]), lines
