"""Gradient caching vs plain training of a small BERT on the CPU: time per step and peak memory.

One step is SimCSE-unsupervised: ``B`` sentences encoded twice (two dropout views),
``infonce_loss`` (fastcl, torch backend), backward. *Uncached* encodes each view in one
forward with grad; *cached* uses ``GradCache`` with ``CHUNK`` rows per chunk.

- Time: the loss grid's interleaved rounds (``benchmarks.harness.case_runs``): per batch size, the
  first item times the uncached and the cached step together, round by round in a rotating
  order after a warm-up step, until their fastest rounds agree or the budget ends
  (``--bench-budget-s`` ...); the record has ``min_s``, its ``spread`` and the case's
  ``noisy`` flag. On ``THREADS`` intra-op
  threads (``--bench-threads``, default all cores as in ``bench_losses.py``; on a
  shared machine two OpenMP threads spend much of a step waiting for each other whenever
  another process takes a core, so ``--bench-threads 1`` is steadier there).
- Overhead: ``test_gradcache_overhead_paired`` alternates uncached and cached steps at
  ``PAIRED_BATCH`` so that load from other processes hits both alike, and stores the
  ratio of their fastest steps (``ratio_of_minima``) in ``extra_info``.
- Memory: a fresh subprocess per (mode, batch) runs one step and reports its peak RSS
  (``VmHWM``) and the growth of that peak during the step (``step_rss_mb``: what the step
  itself needed above the model and its inputs). Stored in ``extra_info``.

Run: ``pytest benchmarks/bench_gradcache.py`` (about 2 minutes on 2 cores);
``--benchmark-json=out.json`` keeps the numbers. ``--bench-gc-batches 64,256,1024``,
``--bench-gc-chunk 64``, ``--bench-gc-paired-batch 256`` and ``--bench-threads 1`` change
the sweep. Alone:
``python -m benchmarks.bench_gradcache MODE BATCH CHUNK`` prints the memory record as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from benchmarks import options
from benchmarks.harness import case_runs

BATCHES = list(options.CURRENT.gc_batches)
CHUNK = options.CURRENT.gc_chunk
THREADS = torch.get_num_threads()  # --bench-threads, set by benchmarks/conftest.py
SEQ_LEN = 32
PAIRED_BATCH = options.CURRENT.gc_paired_batch
MODES = ("uncached", "cached")
TIMING = options.timing_settings()  # the interleaved loop's knobs (pytest options)


def small_bert():
    """BERT-tiny dimensions (2 layers, hidden 128, 2 heads, vocab 30522), random init, train mode."""
    from transformers import BertConfig, BertModel

    from fastcl.gradcache import HFEncoder

    config = BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512)
    torch.manual_seed(0)
    return HFEncoder(BertModel(config, add_pooling_layer=False), pooling="cls_before_pooler").train()


def make_batch(batch: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    return {
        "input_ids": torch.randint(1000, 30000, (batch, SEQ_LEN), generator=g),
        "attention_mask": torch.ones(batch, SEQ_LEN, dtype=torch.long),
    }


def make_step(mode: str, enc, batch: dict, chunk: int = CHUNK):
    from fastcl.gradcache import GradCache
    from fastcl.losses import infonce_loss

    encode = GradCache(enc, chunk_size=chunk) if mode == "cached" else enc

    def step():
        enc.zero_grad(set_to_none=True)
        loss = infonce_loss(encode(**batch), encode(**batch), temperature=0.05, backend="torch")
        loss.backward()

    return step


def _vm_hwm_mb() -> float:
    """Peak resident set size of this process so far (Linux ``VmHWM``), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def memory_record(mode: str, batch: int, chunk: int = CHUNK) -> dict:
    """Run in a fresh process: peak RSS before and after one step."""
    enc = small_bert()
    inputs = make_batch(batch)
    step = make_step(mode, enc, inputs, chunk)
    torch.set_num_threads(THREADS)
    before = _vm_hwm_mb()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    after = _vm_hwm_mb()
    return {
        "mode": mode,
        "batch": batch,
        "peak_rss_mb": round(after, 1),
        "step_rss_mb": round(after - before, 1),
        "first_step_s": round(seconds, 3),
    }


def measure_in_subprocess(mode: str, batch: int) -> dict:
    # the chunk travels as an argument: a fresh process has the options' defaults
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_gradcache", mode, str(batch), str(CHUNK)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=os.environ | {"PYTHONWARNINGS": "ignore"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def memory_records() -> dict:
    """Every (mode, batch) memory record, three fresh processes at a time (they are mostly
    importing; peak RSS does not depend on CPU load), before any timing starts."""
    configs = [(mode, batch) for mode in MODES for batch in BATCHES]
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(configs, pool.map(lambda c: measure_in_subprocess(*c), configs)))


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield THREADS
    torch.set_num_threads(old)


def run_case(batch: int, modes: list[str], settings: dict | None = None) -> case_runs.CaseRun:
    """The steps of ``modes`` at one batch size (each on its own, identically initialised
    encoder), timed together in interleaved rounds."""
    inputs = make_batch(batch)
    builders = {mode: (lambda mode=mode: make_step(mode, small_bert(), inputs)) for mode in modes}
    return case_runs.run_case(builders, settings=TIMING if settings is None else settings, threads=THREADS)


_RUNS = case_runs.CaseRuns()


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("mode", MODES)
def test_gradcache_step(benchmark, memory_records, request, mode, batch):
    benchmark.group = f"gradcache B={batch}"
    benchmark.extra_info.update(memory_records[mode, batch])
    benchmark.extra_info.update({"chunk": CHUNK, "seq_len": SEQ_LEN, "torch": torch.__version__})
    chosen = case_runs.selected_params(request.session, "bench_gradcache.py", "test_gradcache_step")
    modes = [p["mode"] for p in chosen if p["batch"] == batch]
    disabled = dict(warmup=0, min_rounds=1, max_rounds=1) if benchmark.disabled else None
    run = _RUNS.get(batch, lambda: run_case(batch, modes, disabled))
    benchmark.extra_info.update(case_runs.record_fields(benchmark, run, mode))


def test_gradcache_overhead_paired(benchmark, threads):
    benchmark.group = "gradcache overhead (one uncached + one cached step)"
    enc = small_bert()
    batch = make_batch(PAIRED_BATCH)
    steps = {mode: make_step(mode, enc, batch) for mode in MODES}
    times = {mode: [] for mode in MODES}

    def pair():
        for mode in MODES:
            t0 = time.perf_counter()
            steps[mode]()
            times[mode].append(time.perf_counter() - t0)

    benchmark.pedantic(pair, rounds=4, iterations=1)
    best = {mode: min(ts) for mode, ts in times.items()}
    benchmark.extra_info.update(
        {
            "batch": PAIRED_BATCH,
            "chunk": CHUNK,
            "threads": threads,
            "uncached_min_s": round(best["uncached"], 4),
            "cached_min_s": round(best["cached"], 4),
            "ratio_of_minima": round(best["cached"] / best["uncached"], 3),
        }
    )


if __name__ == "__main__":
    print(json.dumps(memory_record(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
