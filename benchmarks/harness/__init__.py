"""The benchmark harness, outside the library (``fastcl`` never imports it).

Shared by the benchmark files beside it, the tests (``tests/bench``, the memory tests) and
``scripts/``: the loss cases and every implementation compared (``cases``, ``peers``,
``fusable``, ``api_cases``), the GEMM floor (``floor``), interleaved timing (``timing``,
``case_runs``, ``shares``, ``metrics``), fresh-process memory probes (``memory``),
correctness at scale (``correctness``), the ring's measurements (``ring_cpu``,
``ring_blocks``), launch accounting (``launches``) and the report (``report``).

    python -m benchmarks.harness report .benchmarks/fastcl-latest.json --out benchmarks/RESULTS.md
    python -m benchmarks.harness correctness --device cuda

Run from the repository root (or with it on ``PYTHONPATH``); the memory probes put it there
for their own child processes.
"""
