"""pytest-benchmark JSON -> ``RESULTS.md`` tables and PNG plots (time and memory vs batch size).

    python -m fastcl.bench report .benchmarks/fastcl-latest.json [gpu.json ...] \\
        --out benchmarks/RESULTS.md --plots benchmarks/plots [--notes NOTES.md]
    python -m fastcl bench-report ...          # the same through the fastcl CLI

Reads the records written by ``benchmarks/bench_losses.py`` (``extra_info``: workload,
impl, B, peak memory, TFLOP/s, GEMM share, loss value vs reference) and the skips with
their reasons (``fastcl_skipped``). One section per device and workload family (loss, P,
Q, d, dtype): a table of every batch size and implementation with ratios to eager, the
skipped implementations with reasons, and one PNG with time and peak memory against B.
A summary says where fastcl's best backend wins or loses against eager and the others.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

FAMILY_ORDER = {"reference": 0, "fastcl": 1, "peer": 2}


@dataclass
class Row:
    impl: str
    family: str
    B: int
    seconds: float
    peak_mib: float | None
    tflops: float | None
    gemm_share: float | None
    abs_err: float | None


@dataclass
class Group:
    """One workload family on one device: every (B, implementation) measured and skipped."""

    device: str
    loss: str
    P: int
    Q: int
    d: int
    dtype: str
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # impl -> reason (first seen)

    @property
    def title(self) -> str:
        return f"{self.loss} P={self.P} Q={self.Q} d={self.d} {self.dtype} ({self.device})"

    @property
    def slug(self) -> str:
        return f"{self.device}-{self.loss}-P{self.P}-Q{self.Q}-d{self.d}-{self.dtype}"


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

    def group(device, loss, P, Q, d, dtype) -> Group:
        key = (device, loss, P, Q, d, dtype)
        if key not in groups:
            groups[key] = Group(*key)
        return groups[key]

    for path in paths:
        doc = json.loads(Path(path).read_text())
        machines.append({"path": str(path), "datetime": doc.get("datetime"), **doc.get("machine_info", {})})
        for b in doc.get("benchmarks", []):
            e = b.get("extra_info", {})
            if "workload" not in e or "B" not in e:
                continue  # another benchmark file's records (e.g. gradcache)
            g = group(e["device"], e["loss"], e["P"], e["Q"], e["d"], e["dtype"])
            g.rows.append(Row(e["impl"], e.get("family", "?"), e["B"], b["stats"]["median"], e.get("peak_mib"),
                              e.get("tflops"), e.get("gemm_share"), e.get("abs_err")))
        for s in doc.get("fastcl_skipped", []):
            w = parse_workload(s["workload"])
            g = group(w["device"], w["loss"], w["P"], w["Q"], w["d"], w["dtype"])
            g.skipped.setdefault(s["impl"], f"B={w['B']}: {s['reason']}")
    for g in groups.values():
        g.rows.sort(key=lambda r: (r.B, FAMILY_ORDER.get(r.family, 9), r.impl))
    ordered = sorted(groups.values(), key=lambda g: (g.device, g.loss, g.P, g.Q, g.d, g.dtype))
    return ordered, machines


def _eager(g: Group, B: int) -> Row | None:
    return next((r for r in g.rows if r.B == B and r.impl == "eager"), None)


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def table(g: Group) -> str:
    """Markdown table: one line per (B, implementation), ratios to eager at that B."""
    gpu = g.device == "cuda"
    rate = "TFLOP/s" if gpu else "GFLOP/s"
    lines = [
        f"| B | impl | time (ms) | speed vs eager | peak (MiB) | memory vs eager | {rate} | share of GEMM | loss error |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in g.rows:
        e = _eager(g, r.B)
        speed = f"{e.seconds / r.seconds:.2f}x" if e else "–"
        # below 1 MiB the RSS meter sees page-level noise, not the workload: no ratio
        mem = f"{r.peak_mib / e.peak_mib:.3f}x" if e and e.peak_mib and e.peak_mib >= 1 and r.peak_mib is not None else "–"
        rate_value = None if r.tflops is None else (r.tflops if gpu else r.tflops * 1e3)
        share = None if r.gemm_share is None else 100 * r.gemm_share
        name = f"**{r.impl}**" if r.family == "fastcl" else r.impl
        lines.append(
            f"| {r.B} | {name} | {r.seconds * 1e3:.1f} | {speed} | {_fmt(r.peak_mib, '.1f')} | {mem} | "
            f"{_fmt(rate_value, '.1f')} | {_fmt(share, '.0f')}% | {_fmt(r.abs_err, '.1e')} |"
        )
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
    e = _eager(g, B)
    if e:
        if best.seconds <= e.seconds:
            parts.append(f"{e.seconds / best.seconds:.2f}x faster than eager")
        else:
            parts.append(f"{best.seconds / e.seconds:.2f}x slower than eager")
        if e.peak_mib and e.peak_mib >= 1 and best.peak_mib is not None:
            parts.append(f"{best.peak_mib / e.peak_mib:.2f}x eager's peak memory")
    others = [r for r in at if r.family != "fastcl" and r.impl != "eager"]
    if others:
        fastest = min(others, key=lambda r: r.seconds)
        verb = "beats" if best.seconds < fastest.seconds else "loses to"
        parts.append(f"{verb} the fastest other, `{fastest.impl}` (its time {fastest.seconds / best.seconds:.2f}x fastcl's)")
        leanest = min((r for r in others if r.peak_mib is not None), key=lambda r: r.peak_mib, default=None)
        if leanest is not None and best.peak_mib is not None:
            parts.append(f"memory {best.peak_mib:.0f} MiB vs the leanest other, `{leanest.impl}`, {leanest.peak_mib:.0f} MiB")
    if e is None and g.skipped.get("eager"):
        parts.append(f"eager skipped ({g.skipped['eager']})")
    return ", ".join(parts) + "."


def _machine_lines(m: dict) -> list[str]:
    f = m.get("fastcl", {})
    cpu = m.get("cpu", {})
    brand = cpu.get("brand_raw") if isinstance(cpu, dict) else None
    device = f.get("cuda_device") or brand or f.get("cpu") or m.get("processor", "?")
    lines = [
        f"- `{Path(m['path']).name}`: {f.get('date') or m.get('datetime')}, device **{device}** "
        f"({f.get('cpu_count', '?')} CPUs, {f.get('torch_threads', '?')} torch threads), "
        f"python {m.get('python_version', '?')}",
    ]
    start, end = f.get("loadavg_start"), f.get("loadavg_end")
    if start or end:
        said = [f"{x[0]:.1f} at {when}" for x, when in ((start, "start"), (end, "end")) if x]
        lines.append(f"  - load average (1 min): {', '.join(said)} (other processes shared the cores)")
    if f.get("versions"):
        lines.append("  - versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in f["versions"].items()))
    if f.get("backends"):
        lines.append("  - fastcl backends: " + "; ".join(f"{k}: {v}" for k, v in f["backends"].items()))
    return lines


def render(groups: list[Group], machines: list[dict], plots_dir: Path, out: Path, notes: str | None = None) -> str:
    """The markdown text; writes one PNG per group with rows into ``plots_dir``."""
    lines = [
        "# fastcl benchmark results", "",
        "Generated by `python -m fastcl.bench report` from pytest-benchmark JSON "
        "(`pytest benchmarks --benchmark-only`; GPU: `scripts/gpu_bench.sh`). Time: median of "
        "forward + backward. Peak memory: CPU, extra peak RSS of a fresh process running one step; "
        "CUDA, max allocated beyond the inputs. FLOP rate on 8·B·N·d, and its share of the rate of "
        "one GEMM of the same shape measured in the same run. Each implementation's loss value was "
        "checked against the float64 reference before timing (last column: absolute error). "
        "fastcl backends in bold.",
        "", "## Runs", "",
    ]
    for m in machines:
        lines += _machine_lines(m)
    said = [s for s in (summary(g) for g in groups) if s]
    if said:
        lines += ["", "## Where fastcl wins and loses", ""] + [f"- {s}" for s in said]
    if notes:
        lines += ["", notes.strip()]
    for g in groups:
        lines += ["", f"## {g.title}", ""]
        if g.rows:
            png = plots_dir / f"{g.slug}.png"
            plot(g, png)
            lines += [table(g), "", f"![{g.title}]({os.path.relpath(png, out.parent)})"]
        else:
            lines.append("No implementation ran.")
        if g.skipped:
            lines += ["", "Skipped:"] + [f"- `{k}`: {v}" for k, v in sorted(g.skipped.items())]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("json", nargs="+", help="pytest-benchmark JSON files with bench_losses.py records")
    p.add_argument("--out", default="benchmarks/RESULTS.md", help="markdown file to write")
    p.add_argument("--plots", default=None, help="folder for the PNG plots (default: <out dir>/plots)")
    p.add_argument("--notes", default=None, help="markdown file whose text goes under the summary")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    plots = Path(args.plots) if args.plots else out.parent / "plots"
    groups, machines = load(args.json)
    if not any(g.rows for g in groups):
        raise SystemExit(f"no fastcl loss benchmarks in {', '.join(map(str, args.json))}")
    notes = Path(args.notes).read_text() if args.notes else None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(groups, machines, plots, out, notes))
    print(f"wrote {out} and {sum(1 for g in groups if g.rows)} plots under {plots}")
    return 0


# ``python -m fastcl bench-report``: registered in fastcl/__main__.py COMMANDS
def add_parser(sub) -> None:
    add_arguments(sub.add_parser("bench-report", help="benchmark JSON -> RESULTS.md tables and plots"))


def run(args) -> int:
    return main(args)
