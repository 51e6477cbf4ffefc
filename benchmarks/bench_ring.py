"""Cross-device negatives, gather against ring, on the CPU with gloo (issue 34).

SupMPN (``P`` positives and ``Q`` negatives per anchor, ``B`` anchors per rank, width ``d``)
on ``W`` = 2 and 4 processes, ``cross_device="gather"`` and ``"ring"`` in the same processes
(``fastcl.bench.ring_cpu``: values checked equal first): time per step (the slowest rank's,
minimum of interleaved rounds), bytes sent per rank in one step, extra peak RSS per rank
(the largest rank's). Issue 34's targets: the ring's extra memory per rank constant in ``W``
(within 10 % from W = 2 to 4) and its CPU step within 1.2x of the gather's at W = 4 for
SupMPN B = 1024, d = 768. docs/distributed.md explains the trade-off; its table of numbers
is filled from this benchmark on an idle machine.

    pytest benchmarks/bench_ring.py --benchmark-only
    python benchmarks/bench_ring.py                      # the same, JSON lines on stdout

It spawns its own processes and takes minutes at the default case, so the main job
(``pytest benchmarks --benchmark-only``) skips it unless this file is named on the command
line or ``FASTCL_BENCH_RING=1``.

``FASTCL_BENCH_RING_WORLDS`` (default ``2,4``), ``FASTCL_BENCH_RING_CASE`` (default
``B=1024,P=5,Q=5,d=768``), ``FASTCL_BENCH_RING_DTYPE`` (``float32``),
``FASTCL_BENCH_RING_BACKEND`` (``auto``: cpp where it builds), ``FASTCL_BENCH_RING_ROUNDS``
(5 timed rounds after one warm-up), ``FASTCL_BENCH_RING_THREADS`` (intra-op threads per rank;
default the usable cores divided by ``W``). At the default case one step at W = 4 is a few
seconds on 16 cores; with fewer cores use a smaller case, e.g. ``B=256,P=5,Q=5,d=768``.
"""

from __future__ import annotations

import json
import os

import pytest

from fastcl.bench import ring_cpu
from fastcl.bench.timing import replay

WORLDS = [int(w) for w in os.environ.get("FASTCL_BENCH_RING_WORLDS", "2,4").split(",")]
CASE = {
    k: int(v)
    for k, v in (kv.split("=") for kv in os.environ.get("FASTCL_BENCH_RING_CASE", "B=1024,P=5,Q=5,d=768").split(","))
}
DTYPE = os.environ.get("FASTCL_BENCH_RING_DTYPE", "float32")
BACKEND = os.environ.get("FASTCL_BENCH_RING_BACKEND", "auto")
ROUNDS = int(os.environ.get("FASTCL_BENCH_RING_ROUNDS", "5"))
THREADS = int(os.environ.get("FASTCL_BENCH_RING_THREADS", "0")) or None

_RUNS: dict[int, dict] = {}


def measure(world: int) -> dict:
    """One spawn per world size, both modes inside (cached for the module)."""
    if world not in _RUNS:
        _RUNS[world] = ring_cpu.run(world=world, dtype=DTYPE, backend=BACKEND, rounds=ROUNDS, threads=THREADS, **CASE)
    return _RUNS[world]


def _selected(config) -> bool:
    """This file named on the command line, or ``FASTCL_BENCH_RING=1``."""
    return os.environ.get("FASTCL_BENCH_RING") == "1" or any("bench_ring" in str(a) for a in config.args)


@pytest.mark.parametrize("mode", ring_cpu.MODES)
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"W{w}")
def test_cross_device_step(request, benchmark, bench_record, bench_skip, world, mode):
    workload = f"supmpn-{DTYPE} B={CASE['B']} P={CASE['P']} Q={CASE['Q']} d={CASE['d']} W={world} (per rank)"
    if not _selected(request.config):
        bench_skip(workload, mode, "multi-process: run pytest benchmarks/bench_ring.py, or set FASTCL_BENCH_RING=1")
    result = measure(world)
    got = result["modes"][mode]
    bench_record(
        benchmark,
        workload=workload,
        impl=mode,
        min_s=got["min_s"],
        spread=got["spread"],
        peak_mib=got["extra_peak_mib"],
        sent_bytes=got["sent_bytes"],
        world=world,
        threads=result["threads"],
        rounds=len(got["samples_s"]),
        stopped="rounds",
    )
    replay(benchmark, got["samples_s"])


if __name__ == "__main__":
    for w in WORLDS:
        print(json.dumps(measure(w)))
