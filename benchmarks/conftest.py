"""pytest-benchmark setup: ratios against eager at the end, skips and versions in the JSON.

Every case records ``extra_info["workload"]`` and ``extra_info["impl"]`` (``bench_record``);
the terminal summary prints each implementation's time (the minimum of interleaved rounds
where the record has one, ``min_s``, with its spread), its share of the GEMM floor and
peak memory, as ratios of the eager reference measured in the same run, and marks a case
**NOISY** when a spread exceeds ``benchmarks.harness.timing.NOISY_SPREAD``. A share whose
reference was not measured soundly prints as "–" with the reason (``benchmarks.harness.shares``). Implementations that
cannot run are skipped through ``bench_skip`` so the reason reaches the JSON
(``fastcl_skipped``) and the report.

Settings are pytest options (``pytest benchmarks --help``, "fastcl benchmarks";
``benchmarks/options.py``). Threads: ``--bench-threads N`` sets PyTorch's intra-op threads
for the whole run; without it PyTorch's default (all cores) is kept. The count is recorded
in the machine info and in every record.

Without ``--benchmark-json`` the results are written to ``.benchmarks/fastcl-latest.json``
(``--bench-json PATH`` changes the path, ``--bench-json off`` turns it off) for
``python -m benchmarks.harness report``.
"""

from __future__ import annotations

import atexit
import datetime
import importlib.metadata
import os
import platform
import shutil
import tempfile
from pathlib import Path

# torch.compile's kernel cache is private to this run, as in tests/conftest.py: the shared
# /tmp/torchinductor_<user> has served a run a kernel that aborted it
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastcl-bench-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

import pytest  # noqa: E402

from benchmarks import options  # noqa: E402

_RESULTS: list[dict] = []
_SKIPPED: list[dict] = []
_LOAD_AT_START: list[float] = []
DEFAULT_JSON = Path(__file__).resolve().parent.parent / ".benchmarks" / "fastcl-latest.json"


def record(benchmark, *, workload: str, impl: str, **info) -> None:
    """Attach metadata to a benchmark and remember it for the summary table."""
    benchmark.extra_info.update(workload=workload, impl=impl, **info)
    _RESULTS.append({"benchmark": benchmark, "workload": workload, "impl": impl, **info})


def skip(workload: str, impl: str, reason: str):
    """Skip this case, keeping the reason for the JSON and the report."""
    _SKIPPED.append({"workload": workload, "impl": impl, "reason": reason})
    pytest.skip(f"{impl}: {reason}")


@pytest.fixture
def bench_record():
    return record


@pytest.fixture
def bench_skip():
    return skip


def pytest_addoption(parser):
    options.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # before pytest-benchmark reads its options: save JSON by default for the report; and
    # before the benchmark modules are imported, which read the settings
    _LOAD_AT_START[:] = os.getloadavg()
    options.CURRENT = options.from_pytest(config)
    threads = options.CURRENT.threads
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    target = options.CURRENT.json or str(DEFAULT_JSON)
    if getattr(config.option, "benchmark_json", "absent") is None and target != "off":
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        config.option.benchmark_json = target


def _versions() -> dict:
    out = {}
    for dist in ("torch", "triton", "sentence-transformers", "pytorch-metric-learning", "inf-cl", "fastcl"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _backends(dispatch) -> dict:
    try:
        return dispatch.describe()
    except Exception as exc:  # reported, not fatal: the cases say which backends ran
        return {"error": f"{type(exc).__name__}: {exc}"}


def pytest_benchmark_update_machine_info(config, machine_info):
    import torch

    from fastcl.ops import dispatch

    info = {
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "threads_setting": str(options.CURRENT.threads or "default (all cores)"),
        "loadavg_start": list(_LOAD_AT_START) or None,
        "backends": _backends(dispatch),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    machine_info["fastcl"] = info


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["fastcl_skipped"] = list(_SKIPPED)
    output_json["machine_info"].setdefault("fastcl", {})["loadavg_end"] = list(os.getloadavg())


def _seconds(r: dict) -> float:
    """The record's time: the minimum of interleaved rounds, else pytest-benchmark's median."""
    return r["min_s"] if r.get("min_s") is not None else r["benchmark"].stats.stats.median


def _case_header(workload: str, info: dict) -> str:
    from benchmarks.harness.timing import NOISY_SPREAD

    if info.get("eager_is"):  # the loss grid's records: what "eager" is for this loss
        workload = f"{workload}  (eager = {info['eager_is']})"
    if "rounds" not in info:
        return workload
    threads = info.get("threads")
    heavy = ", heavy: minimal rounds" if info.get("heavy") else ""
    line = (
        f"{workload}  [{threads} thread{'' if threads == 1 else 's'}, {info['rounds']} rounds, "
        f"{info.get('stopped')}{heavy}]"
    )
    if info.get("noisy"):
        line += f"  NOISY: a spread above {100 * NOISY_SPREAD:.0f}%, ratios not to be trusted"
    return line


def workload_lines(workload: str, items: list[dict], skipped: list[dict]) -> list[str]:
    """The summary's lines for one workload: its header, the floors, a line per record (time,
    spread, ratios to the baseline, shares, peak memory, compile time), then the skips."""
    from benchmarks.harness.report import compile_text, memory_ratio, peak_text

    out: list[str] = []
    # the baseline: a record that says it is one (a named peer), else "eager"
    base = next((r for r in items if r.get("baseline")), None) or next((r for r in items if r["impl"] == "eager"), None)
    base_name = base["impl"] if base is not None else "eager"
    width = max(11, *(len(r["impl"]) for r in items))
    out.append(_case_header(workload, items[0]))
    floors = (
        ("floor", f"{items[0].get('floor_kind') or '3 GEMMs'}: A·Cᵀ, X·C, Xᵀ·A at this shape"),
        ("sym_floor", "4 GEMMs: A·Cᵀ, A·Cᵀ again, X·C, Xᵀ·A: a logit-free symmetric step's least"),
    )
    for key, what in floors:
        if seconds := items[0].get(f"{key}_s"):
            spread = items[0].get(f"{key}_spread")
            name = key.replace("_", "-")
            line = f"  {name:<{width}} {seconds * 1e3:9.1f} ms"
            out.append(line + (f" ±{100 * spread:4.1f}%" if spread is not None else "") + f"  ({what})")
    for r in items:
        t = _seconds(r)
        line = f"  {r['impl']:<{width}} {t * 1e3:9.1f} ms"
        if r.get("spread") is not None:
            line += f" ±{100 * r['spread']:4.1f}%"
        if base is not None:
            line += f"  ({_seconds(base) / t:5.2f}x {base_name} speed)"
        if r.get("floor_share") is not None:
            line += f"  {100 * r['floor_share']:4.0f}% of floor"
        elif r.get("floor_share_problem"):
            line += "     – of floor"
        if r.get("sym_floor_share") is not None:
            line += f" {100 * r['sym_floor_share']:4.0f}% of sym-floor"
        elif r.get("sym_floor_share_problem"):
            line += "    – of sym-floor"
        if r.get("clip_path"):
            line += f" [{r['clip_path']}]"
        if "peak_mib" in r:  # None: not measured ("n/a"); below 1 MiB: "< 1", no ratio
            line += f"  peak {peak_text(r['peak_mib']):>8}" + (" MiB" if r["peak_mib"] is not None else "")
            ratio = memory_ratio(r["peak_mib"], base.get("peak_mib") if base is not None else None)
            if ratio:
                line += f" ({ratio} {base_name})"
        if r.get("tflops") is not None:
            line += f"  {r['tflops'] * 1e3:7.1f} GFLOP/s"
            if r.get("gemm_share") is not None:
                line += f" ({100 * r['gemm_share']:.0f}% of GEMM)"
            elif r.get("gemm_share_problem"):
                line += " (– of GEMM)"
        if "compile_s" in r:  # implementations that compile; None: nothing compiled in this case
            line += f"  compile {compile_text(r['compile_s'])}" + (" s" if r["compile_s"] is not None else "")
        out.append(line)
    # shares printed as "–": their reference was not measured soundly (benchmarks.harness.shares)
    for why in dict.fromkeys(r.get(f"{k}_share_problem") for r in items for k in ("floor", "sym_floor", "gemm")):
        if why:
            out.append(f"  – share not shown: {why}")
    for s in skipped:
        out.append(f"  {s['impl']:<{width}} skipped: {s['reason'][:110]}")
    return out


def pytest_terminal_summary(terminalreporter):
    rows = [r for r in _RESULTS if getattr(r["benchmark"], "stats", None)]
    if not rows:
        return
    tr = terminalreporter
    tr.section(
        "fastcl: time (min of interleaved rounds, spread), share of the GEMM floor, peak memory; "
        "ratios to the baseline (eager, or the named peer), same run"
    )
    by_workload: dict[str, list[dict]] = {}
    for r in rows:
        by_workload.setdefault(r["workload"], []).append(r)
    skipped: dict[str, list[dict]] = {}
    for s in _SKIPPED:
        skipped.setdefault(s["workload"], []).append(s)
    for workload, items in by_workload.items():
        for line in workload_lines(workload, items, skipped.get(workload, [])):
            tr.write_line(line)
