"""Peak-memory meters: CUDA's max-allocated counter, and peak RSS of a fresh CPU process.

CPU memory is measured in a *subprocess* so earlier allocations of the calling process do
not hide or inflate the peak: the child builds the inputs, resets the kernel's high-water
mark (``/proc/self/clear_refs``), runs the work and reports ``peak RSS - RSS before``.

    python -m benchmarks.harness.memory benchmarks.harness.cases:loss_step '{"loss": "supmpn", "B": 1024, ...}'

The probes run ``python -m benchmarks.harness.memory`` with the repository root on
``PYTHONPATH`` (:func:`repo_env`), so they work from any working directory and a factory
may live in ``benchmarks`` or ``tests``.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset the process's RSS high-water mark to its current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def measure_extra_rss(run, warmup: bool = True) -> int:
    """Bytes of peak RSS above the RSS before ``run()`` (call in a fresh process).

    A first, unmeasured call loads the math libraries' code and thread pools, which would
    otherwise count as the workload's memory.
    """
    import gc

    if warmup:
        run()
    gc.collect()
    reset_peak_rss()
    before = _status_kib("VmRSS")
    run()
    return (_status_kib("VmHWM") - before) * 1024


# glibc: every block above 64 KiB is its own mapping, returned to the kernel when freed, so
# the measured step cannot reuse heap left over from its warm-up run unseen; a fixed
# threshold also stops glibc from raising it after the warm-up frees (which made a step's
# peak swing between 20 and 113 MiB from run to run). The cpp backend keeps a block buffer
# of up to 16 MiB between calls (docs/csrc.md): the warm-up would hide it from the measured
# step, so the probes allocate it per call (the step's peak is the same either way).
_PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "_FASTCL_TEST_CPP_KEEP_BYTES": "0"}


REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_env(base: dict | None = None) -> dict:
    """``base`` (default: our environment) with the repository root first on ``PYTHONPATH``:
    a fresh Python process started from any directory imports ``benchmarks`` (and ``tests``)."""
    import os

    env = dict(os.environ if base is None else base)
    paths = [str(REPO_ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _probe_env(threads: int | None) -> dict:
    """A probe's environment: ours with the repository on ``PYTHONPATH`` (:func:`repo_env`),
    ``_PROBE_ENV`` and, if given, its intra-op thread count (OMP/MKL_NUM_THREADS, read when
    torch starts)."""
    env = {**repo_env(), **_PROBE_ENV}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def cpu_extra_peak_bytes(factory: str, kwargs: dict, timeout: float = 600, threads: int | None = None) -> int:
    """Run ``factory(**kwargs)()`` in a fresh Python process and return its extra peak RSS.

    ``factory`` is ``"module:function"``; the function builds its inputs and returns the
    zero-argument callable to measure. ``threads``: the probe's intra-op thread count
    (default inherited; the cpp backend's tile budget has a per-thread floor, docs/csrc.md).
    """
    cmd = [sys.executable, "-m", "benchmarks.harness.memory", factory, json.dumps(kwargs)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_probe_env(threads))
    if out.returncode != 0:
        raise RuntimeError(f"memory probe failed ({' '.join(cmd)}):\n{out.stderr[-4000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["extra_peak_bytes"])


def cpu_extra_peak_bytes_many(
    factory: str, cases: list[dict], preload: tuple[str, ...] = (), timeout: float = 1800, threads: int | None = None
) -> list[int | None]:
    """:func:`cpu_extra_peak_bytes` for many cases, paying Python's and the libraries' start-up once.

    One fresh Python process imports ``factory``'s module and ``preload`` and runs no
    tensor work; for each case it forks a child, which is therefore a fresh process with
    no earlier allocations (and no OpenMP pool to inherit), builds that case and reports
    its extra peak RSS. ``None`` where the child failed (the benchmark reports why).
    ``threads``: the intra-op thread count of the probes (OMP/MKL_NUM_THREADS, read when
    torch starts; per-thread scratch buffers make memory depend on it), default inherited.
    """
    payload = json.dumps({"factory": factory, "cases": cases, "preload": list(preload)})
    cmd = [sys.executable, "-m", "benchmarks.harness.memory", "--many"]
    out = subprocess.run(cmd, input=payload, capture_output=True, text=True, timeout=timeout, env=_probe_env(threads))
    if out.returncode != 0:
        raise RuntimeError(f"memory probe server failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_peak_bytes"]


def cpu_extra_peak_mib_parallel(
    factory: str, cases: list[dict], preload: tuple[str, ...] = (), threads: int | None = None, workers: int = 2
) -> list[float | None]:
    """:func:`cpu_extra_peak_bytes_many` on ``workers`` probe servers at once, in MiB.

    The benchmarks call this once per file, before any timing starts (peak RSS does not
    depend on CPU load, so the probes may share the cores). Each case still runs in its own
    fresh (forked) process; results come back in the order of ``cases``, ``None`` where a
    probe, or its whole server, failed.
    """
    from concurrent.futures import ThreadPoolExecutor

    if not cases:
        return []
    workers = max(1, min(workers, len(cases)))
    chunks = [cases[i::workers] for i in range(workers)]

    def probe(chunk: list[dict]) -> list[int | None]:
        try:
            return cpu_extra_peak_bytes_many(factory, chunk, preload=preload, threads=threads)
        except (RuntimeError, subprocess.TimeoutExpired):  # the benchmarks report what they can
            return [None] * len(chunk)

    out: list[float | None] = [None] * len(cases)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, peaks in enumerate(pool.map(probe, chunks)):
            out[i::workers] = [None if p is None else p / 2**20 for p in peaks]
    return out


def _serve_many(request: dict) -> list[int | None]:
    import os

    module, func = request["factory"].split(":")
    factory = getattr(importlib.import_module(module), func)
    for name in request["preload"]:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional peer that is not installed: its cases skip
            pass
    results = []
    for case in request["cases"]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: a fresh process for this case only
            os.close(read)
            try:
                value = measure_extra_rss(factory(**case))
            except BaseException:  # reported as None; the benchmark says why
                value = None
            os.write(write, json.dumps(value).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            text = f.read()
        os.waitpid(pid, 0)
        results.append(json.loads(text) if text else None)
    return results


def cuda_extra_peak_bytes(run) -> int:
    """Peak CUDA memory allocated by ``run()`` beyond what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _main(argv: list[str]) -> None:
    if argv == ["--many"]:
        print(json.dumps({"extra_peak_bytes": _serve_many(json.loads(sys.stdin.read()))}))
        return
    module, func = argv[0].split(":")
    run = getattr(importlib.import_module(module), func)(**json.loads(argv[1]))
    print(json.dumps({"extra_peak_bytes": measure_extra_rss(run)}))


if __name__ == "__main__":
    _main(sys.argv[1:])
