"""pytest-benchmark JSON -> ``RESULTS.md`` tables and PNG plots (time and memory vs batch size).

    python -m benchmarks.harness report .benchmarks/fastcl-latest.json [gpu.json ...] \\
        --out benchmarks/RESULTS.md --plots benchmarks/plots [--notes NOTES.md]

Reads the records written by ``benchmarks/bench_losses.py`` (``extra_info``: workload,
impl, B, time as the minimum of interleaved rounds with its spread, the GEMM floor and the
share of it, peak memory, TFLOP/s, GEMM share, compile time, threads, loss value vs
reference) and the skips with their reasons (``fastcl_skipped``). One section per device,
workload family (loss, P, Q, d, dtype) and thread count: a table of every batch size and
implementation with ratios to eager and the floor's own line, cases marked *noisy* where
a spread exceeds ``benchmarks.harness.timing.NOISY_SPREAD``, the skipped implementations with
reasons, and one PNG with time and peak memory against B. A summary says where fastcl's
best backend wins or loses against eager, ``torch.compile`` and the others; given runs at
several thread counts (``scripts/bench_threads.sh``), a thread-scaling table follows.
Older records without ``min_s`` (median-timed runs) are read with their median.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.shares import FLOOR_SHARE_CEILING, floor_share_problem, gemm_share_problem, share_problem
from benchmarks.harness.timing import NOISY_SPREAD

FAMILY_ORDER = {"reference": 0, "fastcl": 1, "peer": 2}


@dataclass
class Row:
    impl: str
    family: str
    B: int
    seconds: float
    peak_mib: float | None
    tflops: float | None
    gemm_share: float | None  # printed only where sound (None otherwise: see gemm_problem)
    abs_err: float | None
    spread: float | None = None
    floor_share: float | None = None  # printed only where sound (None otherwise: see floor_problem)
    compile_s: float | None = None
    noisy: bool = False
    threads: int | None = None
    floor_problem: str | None = None  # why the measured floor share is not printed
    gemm_problem: str | None = None  # why the measured GEMM share is not printed
    scratch_mib: float | None = None  # CUDA: warm peak beyond the inputs and their gradients
    first_peak_mib: float | None = None  # CUDA: the first step's peak (compiles included)
    sym_floor_share: float | None = None  # CLIP: share of the symmetric (4-GEMM) floor, where sound
    sym_floor_problem: str | None = None
    clip_path: str | None = None  # CLIP, fastcl: "symmetric" or "two directions"

    @classmethod
    def from_record(cls, b: dict) -> Row:
        e = b["extra_info"]
        seconds = e["min_s"] if e.get("min_s") is not None else b["stats"]["median"]
        floor_share, floor_problem = _sound_share(
            e,
            "floor",
            lambda share: floor_share_problem(share, spread=e.get("floor_spread"), sample_s=e.get("floor_sample_s")),
        )
        gemm_share, gemm_problem = _sound_share(
            e,
            "gemm",
            lambda share: gemm_share_problem(
                share,
                spread=e.get("gemm_spread"),
                sample_s=e.get("gemm_sample_s"),
                in_rounds=bool(e.get("gemm_in_rounds")),
            ),
        )
        sym_share, sym_problem = _sound_share(
            e,
            "sym_floor",
            lambda share: share_problem(
                share,
                reference="symmetric floor",
                in_rounds=True,
                spread=e.get("sym_floor_spread"),
                sample_s=e.get("sym_floor_sample_s"),
                ceiling=FLOOR_SHARE_CEILING,
            ),
        )
        return cls(
            e["impl"],
            e.get("family", "?"),
            e["B"],
            seconds,
            e.get("peak_mib"),
            e.get("tflops"),
            gemm_share,
            e.get("abs_err"),
            e.get("spread"),
            floor_share,
            e.get("compile_s"),
            bool(e.get("noisy")),
            e.get("threads"),
            floor_problem,
            gemm_problem,
            e.get("scratch_mib"),
            e.get("first_peak_mib"),
            sym_share,
            sym_problem,
            e.get("clip_path"),
        )


def _sound_share(e: dict, ref: str, problem_of) -> tuple[float | None, str | None]:
    """``(share, problem)`` of a record: the share only where ``benchmarks.harness.shares`` finds
    its reference sound. Records from 2026-11-27 on carry the measured ratio and the verdict;
    older ones only the ratio, judged here by the same rules from what they recorded."""
    measured = e.get(f"{ref}_share_measured", e.get(f"{ref}_share"))
    problem = e[f"{ref}_share_problem"] if f"{ref}_share_problem" in e else problem_of(measured)
    return (None if problem else measured), problem


@dataclass
class Group:
    """One workload family on one device: every (B, implementation) measured and skipped."""

    device: str
    loss: str
    P: int
    Q: int
    d: int
    dtype: str
    threads: int | None = None
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # impl -> reason (first seen)
    floors: dict[int, tuple[float, float | None]] = field(default_factory=dict)  # B -> (floor s, spread)
    sym_floors: dict[int, tuple[float, float | None]] = field(default_factory=dict)  # CLIP: the 4-GEMM floor
    floor_kind: str = "3 GEMMs"  # what the floor line is (GIST: and its guide's product)
    eager_is: str | None = None  # what "eager" is for this loss (records from 2026-12 on)
    thread_suffix: bool = False  # several thread counts of this family were loaded: name them

    @property
    def title(self) -> str:
        threads = "" if self.threads is None else f", {self.threads} thread{'s' if self.threads != 1 else ''}"
        return f"{self.loss} P={self.P} Q={self.Q} d={self.d} {self.dtype} ({self.device}{threads})"

    @property
    def slug(self) -> str:
        base = f"{self.device}-{self.loss}-P{self.P}-Q{self.Q}-d{self.d}-{self.dtype}"
        return f"{base}-t{self.threads}" if self.thread_suffix else base

    def noisy(self, B: int) -> bool:
        return any(r.noisy for r in self.rows if r.B == B)


def parse_workload(workload: str) -> dict:
    """``"supmpn B=512 P=5 Q=5 d=768 float32 cpu"`` -> its fields (skip records carry only this)."""
    parts = workload.split()
    out: dict = {"loss": parts[0], "dtype": parts[-2], "device": parts[-1]}
    for p in parts[1:-2]:
        k, v = p.split("=")
        out[k] = int(v)
    return out


def load(paths: list) -> tuple[list[Group], list[dict]]:
    """Groups of rows (sorted by B, then reference / fastcl / peers) and each file's machine info."""
    groups: dict[tuple, Group] = {}
    machines = []

    def group(device, loss, P, Q, d, dtype, threads) -> Group:
        key = (device, loss, P, Q, d, dtype, threads)
        if key not in groups:
            groups[key] = Group(*key)
        return groups[key]

    for path in paths:
        doc = json.loads(Path(path).read_text())
        machine = doc.get("machine_info", {})
        machines.append({"path": str(path), "datetime": doc.get("datetime"), **machine})
        run_threads = machine.get("fastcl", {}).get("torch_threads")
        for b in doc.get("benchmarks", []):
            e = b.get("extra_info", {})
            if "workload" not in e or "B" not in e:
                continue  # another benchmark file's records (e.g. gradcache)
            row = Row.from_record(b)
            row.threads = row.threads or run_threads
            g = group(e["device"], e["loss"], e["P"], e["Q"], e["d"], e["dtype"], row.threads)
            g.rows.append(row)
            if e.get("floor_s"):
                g.floors.setdefault(e["B"], (e["floor_s"], e.get("floor_spread")))
            if e.get("sym_floor_s"):
                g.sym_floors.setdefault(e["B"], (e["sym_floor_s"], e.get("sym_floor_spread")))
            g.floor_kind = e.get("floor_kind") or g.floor_kind
            g.eager_is = e.get("eager_is") or g.eager_is
        for s in doc.get("fastcl_skipped", []):
            w = parse_workload(s["workload"])
            g = group(w["device"], w["loss"], w["P"], w["Q"], w["d"], w["dtype"], run_threads)
            g.skipped.setdefault(s["impl"], f"B={w['B']}: {s['reason']}")
    counts = defaultdict(set)
    for key in groups:
        counts[key[:-1]].add(key[-1])
    for key, g in list(groups.items()):
        g.thread_suffix = len(counts[key[:-1]]) > 1
        if not g.rows and g.thread_suffix:  # skips recorded under a thread count with no rows
            del groups[key]
    for g in groups.values():
        g.rows.sort(key=lambda r: (r.B, FAMILY_ORDER.get(r.family, 9), r.impl))
    ordered = sorted(groups.values(), key=lambda g: (g.device, g.loss, g.P, g.Q, g.d, g.dtype, g.threads or 0))
    return ordered, machines


def _eager(g: Group, B: int) -> Row | None:
    return next((r for r in g.rows if r.B == B and r.impl == "eager"), None)


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


# below 1 MiB the CPU RSS meter sees page-level noise, not the workload (and a buffer kept
# from the probe's warm-up step reads as 0): such a peak is not a measurement of the step
MIN_PEAK_MIB = 1.0


def peak_text(peak_mib: float | None) -> str:
    """A peak memory cell: ``n/a`` where it was not measured, ``< 1`` below the meter's
    resolution (never ``0.0``), else MiB."""
    if peak_mib is None:
        return "n/a"
    if peak_mib < MIN_PEAK_MIB:
        return f"< {MIN_PEAK_MIB:.0f}"
    return f"{peak_mib:.1f}"


def memory_ratio(peak_mib: float | None, eager_peak_mib: float | None) -> str | None:
    """``peak / eager's peak`` as ``0.123x``, or None unless both were measured (>= 1 MiB)."""
    if peak_mib is None or eager_peak_mib is None or min(peak_mib, eager_peak_mib) < MIN_PEAK_MIB:
        return None
    return f"{peak_mib / eager_peak_mib:.3f}x"


def compile_text(compile_s: float | None) -> str:
    """A compile-time cell: ``n/a`` where nothing was compiled (an implementation that does not
    compile, or whose graph an earlier case of the run compiled), else seconds."""
    return "n/a" if compile_s is None else f"{compile_s:.1f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


SHARE_NAMES = {"floor": "share of floor", "sym_floor": "share of the symmetric floor", "gemm": "share of GEMM"}


def share_notes(g: Group) -> list[str]:
    """One line per reason a share was not printed, naming the rows it applies to."""
    by_reason: dict[tuple[str, str], list[str]] = {}
    for r in g.rows:
        for kind, problem in (("floor", r.floor_problem), ("sym_floor", r.sym_floor_problem), ("gemm", r.gemm_problem)):
            if problem:
                by_reason.setdefault((kind, problem), []).append(f"B={r.B} `{r.impl}`")
    return [f"- {SHARE_NAMES[kind]} not shown ({', '.join(rows)}): {why}." for (kind, why), rows in by_reason.items()]


def table(g: Group) -> str:
    """Markdown table: one line per (B, implementation), ratios to eager at that B; the
    floor's own line first at each B; ``B (noisy)`` where a spread of the case is too wide."""
    gpu = g.device == "cuda"
    rate = "TFLOP/s" if gpu else "GFLOP/s"
    extra = " scratch (MiB) | first step (MiB) |" if gpu else ""
    lines = [
        f"| B | impl | time (ms) | spread | speed vs eager | share of floor | peak (MiB) |{extra} memory vs eager | {rate} "
        "| share of GEMM | compile (s) | loss error |",
        "|---:|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if gpu else "") + "---:|---:|---:|---:|---:|",
    ]
    floor_done = set()
    for r in g.rows:
        b = f"{r.B} (noisy)" if g.noisy(r.B) else str(r.B)
        if r.B in g.floors and r.B not in floor_done:
            floor_done.add(r.B)
            floor_lines = [(f"floor: {g.floor_kind}", g.floors[r.B])]
            if r.B in g.sym_floors:
                floor_lines.append(("symmetric floor: 4 GEMMs", g.sym_floors[r.B]))
            for label, (f_s, f_spread) in floor_lines:
                lines.append(
                    f"| {b} | *{label}* | {f_s * 1e3:.1f} | {_pct(f_spread)} | – | 100% | – |"
                    + (" – | – |" if gpu else "")
                    + " – | – | – | – | – |"
                )
        e = _eager(g, r.B)
        speed = f"{e.seconds / r.seconds:.2f}x" if e else "–"
        mem = memory_ratio(r.peak_mib, e.peak_mib if e else None) or "–"
        rate_value = None if r.tflops is None else (r.tflops if gpu else r.tflops * 1e3)
        name = f"**{r.impl}**" if r.family == "fastcl" else r.impl
        if r.clip_path == "two directions":  # the backend computes no column statistics: 6 GEMM passes
            name += " (two directions)"
        share = _pct(r.floor_share)
        if r.B in g.sym_floors:  # CLIP: the three-GEMM floor's share, then the symmetric floor's
            share += f" / {_pct(r.sym_floor_share)}"
        lines.append(
            f"| {b} | {name} | {r.seconds * 1e3:.1f} | {_pct(r.spread) if r.spread is not None else '–'} | {speed} | "
            f"{share} | {peak_text(r.peak_mib)} |"
            + (f" {_fmt(r.scratch_mib, '.1f')} | {_fmt(r.first_peak_mib, '.1f')} |" if gpu else "")
            + f" {mem} | {_fmt(rate_value, '.1f')} | "
            f"{_pct(r.gemm_share)} | {compile_text(r.compile_s)} | {_fmt(r.abs_err, '.1e')} |"
        )
    return "\n".join(lines)


def scaling(groups: list[Group]) -> str | None:
    """Thread scaling: each (workload, B, implementation) measured at several thread counts."""
    by_key: dict[tuple, dict[int, Row]] = defaultdict(dict)
    for g in groups:
        for r in g.rows:
            if r.threads:
                by_key[(g.device, g.loss, g.P, g.Q, g.d, g.dtype, r.B, r.impl)][r.threads] = r
    counts = sorted({t for v in by_key.values() for t in v})
    multi = {k: v for k, v in by_key.items() if len(v) > 1}
    if not multi or len(counts) < 2:
        return None
    lo = counts[0]
    head = " | ".join(f"{t} thread{'s' if t != 1 else ''} (ms)" for t in counts)
    lines = [
        f"| workload | B | impl | {head} | " + " | ".join(f"speed-up {lo}→{t}" for t in counts[1:]) + " |",
        "|---|---:|---|" + "---:|" * (2 * len(counts) - 1),
    ]
    for (device, loss, P, Q, d, dtype, B, impl), v in sorted(multi.items(), key=lambda kv: (kv[0][:7], kv[0][7])):
        times = " | ".join(_fmt(v[t].seconds * 1e3 if t in v else None, ".1f") for t in counts)
        ups = " | ".join(f"{v[lo].seconds / v[t].seconds:.2f}x" if lo in v and t in v else "–" for t in counts[1:])
        noisy = " (noisy)" if any(r.noisy for r in v.values()) else ""
        lines.append(f"| {loss} P={P} Q={Q} d={d} {dtype} {device} | {B}{noisy} | {impl} | {times} | {ups} |")
    return "\n".join(lines)


def plot(g: Group, path: Path) -> None:
    """Time and peak memory against B, one line per implementation (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_impl: dict[str, list[Row]] = defaultdict(list)
    for r in g.rows:
        by_impl[r.impl].append(r)
    styles = {"reference": "--", "fastcl": "-", "peer": ":"}
    for impl, rows in sorted(by_impl.items(), key=lambda kv: (FAMILY_ORDER.get(kv[1][0].family, 9), kv[0])):
        rows.sort(key=lambda r: r.B)
        style = styles.get(rows[0].family, "-")
        width = 2.4 if rows[0].family == "fastcl" else 1.4
        ax_t.plot([r.B for r in rows], [r.seconds * 1e3 for r in rows], style, marker="o", lw=width, label=impl)
        mem = [(r.B, r.peak_mib) for r in rows if r.peak_mib is not None and r.peak_mib > 0]  # log axis
        if mem:
            ax_m.plot(*zip(*mem), style, marker="o", lw=width, label=impl)
    if g.floors:
        bs = sorted(g.floors)
        ax_t.plot(bs, [g.floors[b][0] * 1e3 for b in bs], "k-.", marker="x", lw=1.2, label="floor (3 GEMMs)")
    for ax, ylabel in ((ax_t, "forward + backward (ms)"), (ax_m, "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(g.title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(g: Group) -> str | None:
    """Where fastcl's fastest backend stands at the largest B it ran."""
    fastcl_b = {r.B for r in g.rows if r.family == "fastcl"}
    if not fastcl_b:
        return None
    B = max(fastcl_b)
    at = [r for r in g.rows if r.B == B]
    best = min((r for r in at if r.family == "fastcl"), key=lambda r: r.seconds)
    parts = [f"**{g.title}, B={B}**: fastest fastcl backend `{best.impl}`"]
    if best.floor_share is not None:
        parts.append(f"{100 * best.floor_share:.0f}% of the GEMM floor")
    e = _eager(g, B)
    if e:
        if best.seconds <= e.seconds:
            parts.append(f"{e.seconds / best.seconds:.2f}x faster than eager")
        else:
            parts.append(f"{best.seconds / e.seconds:.2f}x slower than eager")
        if memory_ratio(best.peak_mib, e.peak_mib):
            parts.append(f"{best.peak_mib / e.peak_mib:.2f}x eager's peak memory")  # type: ignore[operator]
    compiled = next((r for r in at if r.impl == "compile"), None)
    if compiled is not None:
        verb = "ahead of" if best.seconds < compiled.seconds else "behind"
        parts.append(f"{verb} `torch.compile` ({compiled.seconds / best.seconds:.2f}x its time)")
    others = [r for r in at if r.family != "fastcl" and r.impl != "eager"]
    if others:
        fastest = min(others, key=lambda r: r.seconds)
        verb = "beats" if best.seconds < fastest.seconds else "loses to"
        parts.append(
            f"{verb} the fastest other, `{fastest.impl}` (its time {fastest.seconds / best.seconds:.2f}x fastcl's)"
        )
        leanest = min((r for r in others if r.peak_mib is not None), key=lambda r: r.peak_mib, default=None)
        if leanest is not None and best.peak_mib is not None:
            parts.append(
                f"memory {peak_text(best.peak_mib)} MiB vs the leanest other, `{leanest.impl}`, "
                f"{peak_text(leanest.peak_mib)} MiB"
            )
    if e is None and g.skipped.get("eager"):
        parts.append(f"eager skipped ({g.skipped['eager']})")
    if g.noisy(B):
        parts.append("**noisy** (a spread above the threshold: ratios uncertain)")
    return ", ".join(parts) + "."


def _machine_lines(m: dict) -> list[str]:
    f = m.get("fastcl", {})
    cpu = m.get("cpu", {})
    brand = cpu.get("brand_raw") if isinstance(cpu, dict) else None
    device = f.get("cuda_device") or brand or f.get("cpu") or m.get("processor", "?")
    lines = [
        f"- `{Path(m['path']).name}`: {f.get('date') or m.get('datetime')}, device **{device}** "
        f"({f.get('cpu_count', '?')} CPUs, {f.get('torch_threads', '?')} torch threads"
        f"{', --bench-threads ' + f['threads_setting'] if f.get('threads_setting', '').isdigit() else ''}), "
        f"python {m.get('python_version', '?')}",
    ]
    start, end = f.get("loadavg_start"), f.get("loadavg_end")
    if start or end:
        said = [f"{x[0]:.1f} at {when}" for x, when in ((start, "start"), (end, "end")) if x]
        # the run's own threads are in it: alone on the machine a T-thread run ends near T
        lines.append(f"  - load average (1 min): {', '.join(said)} (the run itself included)")
    if f.get("versions"):
        lines.append("  - versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in f["versions"].items()))
    if f.get("backends"):
        lines.append("  - fastcl backends: " + "; ".join(f"{k}: {v}" for k, v in f["backends"].items()))
    return lines


def render(
    groups: list[Group],
    machines: list[dict],
    plots_dir: Path,
    out: Path,
    notes: str | None = None,
    scaling_groups: list[Group] | None = None,
) -> str:
    """The markdown text; writes one PNG per group with rows into ``plots_dir``.
    ``scaling_groups``: where the thread-scaling table comes from (default ``groups``)."""
    lines = [
        "# fastcl benchmark results",
        "",
        "Generated by `python -m benchmarks.harness report` from pytest-benchmark JSON "
        "(`pytest benchmarks --benchmark-only`; GPU: `scripts/gpu_bench.sh`). Time: forward + backward, "
        "the minimum over rounds in which all implementations of a case and its GEMM floor ran "
        "interleaved (older runs: median); spread: how far the third-fastest round lies above the "
        f"fastest; a case is *noisy* when a spread exceeds {100 * NOISY_SPREAD:.0f}% (its ratios are "
        "uncertain). Floor: the three GEMMs of a gradient-in-forward step at the case's shape "
        "(A·Cᵀ, X·C, Xᵀ·A), timed in the same rounds; share of floor = floor / time. Peak memory: CPU, extra peak RSS "
        "of a fresh process running one step; CUDA, max allocated beyond the inputs in a second step, "
        "the input gradients included (runs up to 2026-11-27 measured the first step, Triton's "
        "autotuning included); scratch: that peak less the input gradients (what the loss itself "
        "needs), beside the first step's peak. FLOP rate on "
        "8·B·N·d, and its share of the rate of one GEMM of the same shape timed in the same rounds "
        "(earlier runs timed it apart: not shown). A share is printed only where its reference was "
        "measured soundly (in the same rounds, its own spread within the threshold, samples of at least "
        "a few milliseconds, and a share a step doing its work can reach); otherwise it shows as – "
        "and the reason is listed under the table. "
        "Compile: seconds the first calls of `torch.compile` took beyond one step. Each "
        "implementation's loss value was checked against the float64 reference before timing (last "
        "column: absolute error). fastcl backends in bold.",
        "",
        "## Runs",
        "",
    ]
    for m in machines:
        lines += _machine_lines(m)
    said = [s for s in (summary(g) for g in groups) if s]
    if said:
        lines += ["", "## Where fastcl wins and loses", ""] + [f"- {s}" for s in said]
    if notes:
        lines += ["", notes.strip()]
    scaled = scaling(groups if scaling_groups is None else scaling_groups)
    if scaled:
        lines += [
            "",
            "## Thread scaling",
            "",
            "The same cases in runs at different thread counts "
            "(`scripts/bench_threads.sh`); speed-up = time at the fewest threads / time.",
            "",
            scaled,
        ]
    for g in groups:
        lines += ["", f"## {g.title}", ""]
        if g.eager_is and g.eager_is != "fastcl.reference oracle":
            lines += [f"eager = {g.eager_is}.", ""]
        if g.sym_floors:
            lines += [
                "Share of floor: of the three-GEMM floor / of the symmetric floor (four GEMMs: A·Cᵀ, A·Cᵀ "
                "again, X·C, Xᵀ·A; the fewest a symmetric step that never holds the [B, B] logits can do: "
                "both directions' LSEs precede any gradient).",
                "",
            ]
        if g.rows:
            png = plots_dir / f"{g.slug}.png"
            plot(g, png)
            lines += [table(g), "", f"![{g.title}]({os.path.relpath(png, out.parent)})"]
        else:
            lines.append("No implementation ran.")
        notes = share_notes(g)
        if notes:
            lines += ["", "Shares shown as –, measured but not sound (`benchmarks.harness.shares`):"] + notes
        if g.skipped:
            lines += ["", "Skipped:"] + [f"- `{k}`: {v}" for k, v in sorted(g.skipped.items())]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("json", nargs="+", help="pytest-benchmark JSON files with bench_losses.py records")
    p.add_argument("--out", default="benchmarks/RESULTS.md", help="markdown file to write")
    p.add_argument("--plots", default=None, help="folder for the PNG plots (default: <out dir>/plots)")
    p.add_argument("--notes", default=None, help="markdown file whose text goes under the summary")
    p.add_argument(
        "--scaling",
        nargs="*",
        default=[],
        metavar="JSON",
        help="runs at other thread counts (scripts/bench_threads.sh): used for the thread-scaling "
        "table only, next to the main runs, not for their own sections",
    )


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    plots = Path(args.plots) if args.plots else out.parent / "plots"
    groups, machines = load(args.json)
    if not any(g.rows for g in groups):
        raise SystemExit(f"no fastcl loss benchmarks in {', '.join(map(str, args.json))}")
    extra = getattr(args, "scaling", None) or []
    scaling_groups = None
    if extra:
        scaling_groups, extra_machines = load(list(args.json) + list(extra))
        machines += extra_machines[len(args.json) :]
    notes = Path(args.notes).read_text() if args.notes else None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(groups, machines, plots, out, notes, scaling_groups))
    print(f"wrote {out} and {sum(1 for g in groups if g.rows)} plots under {plots}")
    return 0
