"""The benchmarks' settings, from pytest options (``benchmarks/conftest.py``: ``pytest benchmarks
--help``, section "fastcl benchmarks"), fixed once when pytest configures, before any
benchmark module is imported. Imported outside a benchmark run (``tests/bench``), the
defaults hold.

Two settings fall back to an environment variable when their option is not given, because
the GPU lease script sets them that way: ``FASTCL_BENCH_IMPLS`` and ``FASTCL_BENCH_BUDGET_S``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from benchmarks.harness import timing

# the environment variables scripts/gpu_lease.sh sets (their option wins when given)
IMPLS_ENV = "FASTCL_BENCH_IMPLS"
BUDGET_ENV = "FASTCL_BENCH_BUDGET_S"


RING_CASE = {"B": 1024, "P": 5, "Q": 5, "d": 768}


def _ring_case(text: str | None) -> dict[str, int]:
    """``B=1024,P=5,Q=5,d=768`` (any subset; the rest keep their defaults)."""
    case = dict(RING_CASE)
    for item in _csv(text):
        key, _, value = item.partition("=")
        if key not in RING_CASE or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--bench-ring-case={text!r}: expected keys B, P, Q, d with positive integer values")
        case[key] = int(value)
    return case


def _csv(text: str | None) -> tuple[str, ...]:
    return tuple(s.strip() for s in (text or "").split(",") if s.strip())


def _grid(text: str | None) -> tuple[tuple[int, int, int], ...]:
    if not text:
        return ()
    cases = []
    for case in text.split(";"):
        values = _ints("--bench-st-grid", case)
        if len(values) != 3:
            raise ValueError(f"--bench-st-grid={text!r}: expected cases B,Q,d separated by ';'")
        cases.append(values)
    return tuple(cases)


def _ints(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(s) for s in _csv(text))
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected comma-separated positive integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name}={text!r}: expected comma-separated positive integers")
    return values


@dataclass(frozen=True)
class BenchOptions:
    threads: int | None = None  # None: PyTorch's default (all cores)
    json: str | None = None  # None: .benchmarks/fastcl-latest.json; "off": no file
    impls: tuple[str, ...] = ()  # (): every implementation
    memory: bool = True
    memory_workers: int = 2
    targets: bool = False
    budget_s: float = timing.BUDGET_S
    min_rounds: int = timing.MIN_ROUNDS
    max_rounds: int = timing.MAX_ROUNDS
    heavy_rounds: int = 2  # bench_losses.py's heavy CPU cases (seconds per step): timed rounds
    gc_batches: tuple[int, ...] = (64, 256, 1024)
    gc_chunk: int = 64
    gc_paired_batch: int = 256
    st_grid: tuple[tuple[int, int, int], ...] = ()  # bench_st.py (B, Q, d) cases; (): its own grid
    gist_step: tuple[int, ...] = (512, 64)  # bench_gist_step.py: batch, mini-batch
    ring: bool = False  # bench_ring.py runs in the main job too
    ring_worlds: tuple[int, ...] = (2, 4)
    ring_case: dict[str, int] = field(default_factory=lambda: dict(RING_CASE))
    ring_loss: str = "supmpn"  # bench_ring.py: "supmpn" or "siglip" (benchmarks.harness.ring_cpu)
    ring_dtype: str = "float32"
    ring_backend: str = "auto"
    ring_rounds: int = 5
    ring_threads: int | None = None  # None: the usable cores divided by W
    sources: dict[str, str] = field(default_factory=dict)  # setting -> where it came from


CURRENT = BenchOptions()


def add_options(parser) -> None:
    """The benchmarks' pytest options (``pytest_addoption``)."""
    g = parser.getgroup("fastcl benchmarks")
    g.addoption("--bench-threads", type=int, help="PyTorch intra-op threads for the whole run (default: all cores)")
    g.addoption("--bench-json", help="where the results go (default .benchmarks/fastcl-latest.json; 'off': nowhere)")
    g.addoption("--bench-impls", help=f"comma-separated implementations to run (default: all; else ${IMPLS_ENV})")
    g.addoption("--bench-no-memory", action="store_true", help="skip the memory probes")
    g.addoption("--bench-memory-workers", type=int, default=2, help="memory probe servers at once (default 2)")
    g.addoption(
        "--bench-targets", action="store_true", help="add the CPU-target cases of bench_losses.py (csrc, GIST B=512)"
    )
    g.addoption(
        "--bench-budget-s", type=float, help=f"seconds of timed rounds per case (default 5; else ${BUDGET_ENV})"
    )
    g.addoption("--bench-min-rounds", type=int, default=timing.MIN_ROUNDS, help="timed rounds at least")
    g.addoption("--bench-max-rounds", type=int, default=timing.MAX_ROUNDS, help="timed rounds at most")
    g.addoption(
        "--bench-heavy-rounds",
        type=int,
        default=2,
        help="timed rounds of bench_losses.py's heavy CPU cases (8*B*N*d >= 2^38 FLOPs: image-text B = 16384, "
        "GIST B = 4096; after one warm-up round, no budget; default 2, at most --bench-max-rounds)",
    )
    g.addoption("--bench-gc-batches", default="64,256,1024", help="bench_gradcache.py batch sizes")
    g.addoption("--bench-gc-chunk", type=int, default=64, help="bench_gradcache.py rows per cached chunk")
    g.addoption("--bench-gc-paired-batch", type=int, default=256, help="bench_gradcache.py paired-overhead batch")
    g.addoption("--bench-st-grid", help='bench_st.py cases "B,Q,d;B,Q,d" (default: its grid)')
    g.addoption("--bench-gist-step", default="512,64", help="bench_gist_step.py's batch,mini-batch (default 512,64)")
    g.addoption("--bench-ring", action="store_true", help="run bench_ring.py (multi-process) in the main job too")
    g.addoption("--bench-ring-worlds", default="2,4", help="bench_ring.py process counts (default 2,4)")
    g.addoption("--bench-ring-case", help="bench_ring.py sizes per rank (default B=1024,P=5,Q=5,d=768)")
    g.addoption(
        "--bench-ring-loss", default="supmpn", choices=("supmpn", "siglip"), help="bench_ring.py loss (default supmpn)"
    )
    g.addoption("--bench-ring-dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    g.addoption(
        "--bench-ring-backend", default="auto", help="bench_ring.py backend (default auto: cpp where it builds)"
    )
    g.addoption("--bench-ring-rounds", type=int, default=5, help="bench_ring.py timed rounds after one warm-up")
    g.addoption("--bench-ring-threads", type=int, help="bench_ring.py threads per rank (default: cores / W)")


def from_pytest(config) -> BenchOptions:
    """The settings of this run, checked (a bad value stops the run before any benchmark)."""
    get = config.getoption
    sources = {}
    impls = get("--bench-impls")
    if impls is None and os.environ.get(IMPLS_ENV):
        impls, sources["impls"] = os.environ[IMPLS_ENV], IMPLS_ENV
    budget = get("--bench-budget-s")
    if budget is None and os.environ.get(BUDGET_ENV):
        try:
            budget, sources["budget_s"] = float(os.environ[BUDGET_ENV]), BUDGET_ENV
        except ValueError:
            raise ValueError(f"{BUDGET_ENV}={os.environ[BUDGET_ENV]!r}: expected a number of seconds") from None
    opts = BenchOptions(
        threads=get("--bench-threads"),
        json=get("--bench-json"),
        impls=_csv(impls),
        memory=not get("--bench-no-memory"),
        memory_workers=get("--bench-memory-workers"),
        targets=get("--bench-targets"),
        budget_s=timing.BUDGET_S if budget is None else budget,
        min_rounds=get("--bench-min-rounds"),
        max_rounds=get("--bench-max-rounds"),
        heavy_rounds=get("--bench-heavy-rounds"),
        gc_batches=_ints("--bench-gc-batches", get("--bench-gc-batches")),
        gc_chunk=get("--bench-gc-chunk"),
        gc_paired_batch=get("--bench-gc-paired-batch"),
        st_grid=_grid(get("--bench-st-grid")),
        gist_step=_ints("--bench-gist-step", get("--bench-gist-step")),
        ring=get("--bench-ring"),
        ring_worlds=_ints("--bench-ring-worlds", get("--bench-ring-worlds")),
        ring_case=_ring_case(get("--bench-ring-case")),
        ring_loss=get("--bench-ring-loss"),
        ring_dtype=get("--bench-ring-dtype"),
        ring_backend=get("--bench-ring-backend"),
        ring_rounds=get("--bench-ring-rounds"),
        ring_threads=get("--bench-ring-threads"),
        sources=sources,
    )
    positive = ("threads", "memory_workers", "min_rounds", "max_rounds", "heavy_rounds", "gc_chunk", "gc_paired_batch")
    for name in (*positive, "ring_rounds", "ring_threads"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise ValueError(f"--bench-{name.replace('_', '-')}={value}: expected a positive integer")
    if not opts.budget_s >= 0:
        raise ValueError(f"--bench-budget-s={opts.budget_s}: expected seconds >= 0")
    if len(opts.gist_step) != 2:
        raise ValueError(f"--bench-gist-step={opts.gist_step}: expected batch,mini-batch")
    return opts


def timing_settings() -> dict:
    """The interleaved loop's knobs of this run (``benchmarks.harness.timing.interleave``)."""
    return timing.settings(CURRENT.min_rounds, CURRENT.max_rounds, CURRENT.budget_s)
