"""fastcl's sentence-transformers MNRL vs sentence-transformers' MNRL and cached MNRL.

The loss stage only, on the same random float32 embeddings (anchor, positive and Q hard
negative columns, ``[B, d]`` each): forward + backward to the embeddings, which is all a
loss contributes to a training step (the encoder is the same for every implementation).

* ``eager``: ``sentence_transformers.losses.MultipleNegativesRankingLoss`` (builds the
  ``B x B(1+Q)`` logits; the reference the ratios are taken against).
* ``st_cached``: ``sentence_transformers.losses.CachedMultipleNegativesRankingLoss``'s loss
  stage (``calculate_loss(..., with_backward=True)``: logits in row chunks of
  ``mini_batch_size`` = 32, backward per chunk, as in its gradient-cached step).
* ``fastcl-<backend>``: ``fastcl.integrations.sentence_transformers.MultipleNegativesRankingLoss``
  (the same class serves the cached variant: gradient caching changes only the encoder side).

Time: the loss grid's interleaved rounds (``benchmarks.harness.case_runs``, ``benchmarks.harness.timing``):
the first item of a (B, Q, d) case times every selected implementation of it together,
round by round in a rotating order after a warm-up round, until their fastest rounds agree
or the case's budget ends; each item then hands its rounds to pytest-benchmark. The record
has the minimum over rounds (``min_s``), its spread and the case's ``noisy`` flag. On
``--bench-threads`` intra-op threads (default all cores). Before timing, each
implementation's loss value is checked against ``eager``'s. Peak memory: ``benchmarks.harness.memory``'s
meter (extra peak RSS of one step in a fresh process, after a warm-up step), with two
changes. The fresh processes fork from a ``forkserver`` that imported sentence-transformers
once (a cold import costs 5-30 s on the shared CPU, per probe). And they run with
``MALLOC_MMAP_THRESHOLD_=131072``: glibc's default *dynamic* threshold lets freed blocks of
up to 32 MiB stay resident after the warm-up step, so the measured step would reuse them
and under-report (eager's 16 MiB logits at B = 2048 read 22 to 37 MiB from run to run).

    pytest benchmarks/bench_st.py --benchmark-only          # CPU grid, ~1.5 min
    pytest benchmarks/bench_st.py --bench-no-memory           # skip the memory probes
    pytest benchmarks/bench_st.py --bench-st-grid "8192,0,64"  # other (B, Q, d)
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

pytest.importorskip("sentence_transformers")

from benchmarks import options  # noqa: E402
from benchmarks.harness import case_runs  # noqa: E402
from benchmarks.harness.memory import measure_extra_rss  # noqa: E402
from fastcl.ops import dispatch  # noqa: E402
from fastcl.testing import value_tol  # noqa: E402

# (B, Q, d): triplets (one hard negative) at MiniLM's width, and a wide batch of pairs
CPU_GRID = [
    (1024, 1, 384),
    (4096, 0, 64),
]
if options.CURRENT.st_grid:  # --bench-st-grid "8192,0,64;2048,3,384"
    CPU_GRID = [tuple(case) for case in options.CURRENT.st_grid]
MINI_BATCH_SIZE = 32
IMPLS = ["eager", "st_cached", "fastcl-torch", "fastcl-cpp"]
THREADS = torch.get_num_threads()  # --bench-threads, set by benchmarks/conftest.py
TIMING = options.timing_settings()  # the interleaved loop's knobs (pytest options)


def st_step(
    impl: str, B: int, Q: int, d: int, mini_batch_size: int = MINI_BATCH_SIZE, seed: int = 0, value: bool = False
):
    """One forward + backward of ``impl``'s MNRL on fresh ``(2 + Q)`` columns of ``[B, d]``.

    Returns the zero-argument step (also the factory of the memory probe); with
    ``value=True`` a zero-argument function returning the loss value instead (no backward).
    """
    from torch import nn

    gen = torch.Generator().manual_seed(seed)
    columns = [torch.randn(B, d, generator=gen) for _ in range(2 + Q)]

    def leaves():
        return [c.detach().requires_grad_() for c in columns]

    if impl == "eager":
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

        loss = MultipleNegativesRankingLoss(model=None)
        forward = lambda: loss.compute_loss_from_embeddings(leaves(), None)  # noqa: E731
    elif impl == "st_cached":
        from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

        # The model is only inspected at construction (it must not be a StaticEmbedding).
        loss = CachedMultipleNegativesRankingLoss(nn.Sequential(nn.Identity()), mini_batch_size=mini_batch_size)
        if value:
            return lambda: loss.calculate_loss([list(c.split(mini_batch_size)) for c in leaves()], None)
        return lambda: loss.calculate_loss([list(c.split(mini_batch_size)) for c in leaves()], None, with_backward=True)
    elif impl.startswith("fastcl-"):
        from fastcl.integrations.sentence_transformers import MultipleNegativesRankingLoss

        loss = MultipleNegativesRankingLoss(nn.Identity(), backend=impl.removeprefix("fastcl-"))
        forward = lambda: loss.compute_loss_from_embeddings(leaves())  # noqa: E731
    else:
        raise ValueError(f"unknown impl {impl!r}")
    if value:
        return forward
    return lambda: forward().backward()


_FORKSERVER = None


def _probe(case: dict) -> int:
    torch.set_num_threads(THREADS)
    return measure_extra_rss(st_step(**case))


def peak_bytes(case: dict) -> int:
    """Extra peak RSS of one ``st_step(**case)`` in a fresh process (see the module docstring)."""
    global _FORKSERVER
    if _FORKSERVER is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "sentence_transformers", "fastcl.integrations.sentence_transformers"])
        saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # read by the server at its exec, inherited by probes
        try:
            with ctx.Pool(1) as pool:  # starts the server
                pool.apply(int)
        finally:
            if saved is None:
                os.environ.pop("MALLOC_MMAP_THRESHOLD_")
            else:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
        _FORKSERVER = ctx
    with _FORKSERVER.Pool(1) as pool:  # a fresh child per probe
        return pool.apply(_probe, (case,))


def _unavailable(impl: str) -> str | None:
    if impl.startswith("fastcl-"):
        status = dispatch.describe()[impl.removeprefix("fastcl-")]
        if status != "available":
            return f"backend {impl!r}: {status}"
    return None


def _builder(case: dict, expected: float | None):
    """Checks ``case``'s loss value against eager's (``expected``), then gives its step."""

    def build():
        why = _unavailable(case["impl"])
        if why:
            raise _Unavailable(why)
        if expected is not None:  # like with like: the same loss as eager's before timing
            with torch.no_grad():
                got = float(st_step(**case, value=True)())
            # two float32 computations of the same value, each within value_tol of the exact one
            # (MNRL's default scale 20, N = (1 + Q) B candidates per row)
            atol, rtol = value_tol(
                torch.float32, B=case["B"], N=(1 + case["Q"]) * case["B"], d=case["d"], logit_scale=20.0
            )
            torch.testing.assert_close(got, expected, rtol=2 * rtol, atol=2 * atol)
        return st_step(**case)

    return build


class _Unavailable(Exception):
    pass


def run_case(B: int, Q: int, d: int, impls: list[str], settings: dict | None = None) -> case_runs.CaseRun:
    """Every implementation of one (B, Q, d) case, value-checked, then timed interleaved."""
    with torch.no_grad():
        expected = float(st_step("eager", B, Q, d, value=True)())
    builders = {impl: _builder(dict(impl=impl, B=B, Q=Q, d=d), None if impl == "eager" else expected) for impl in impls}
    return case_runs.run_case(
        builders,
        settings=TIMING if settings is None else settings,
        threads=THREADS,
        skip_reason=lambda exc: str(exc) if isinstance(exc, _Unavailable) else None,
    )


_RUNS = case_runs.CaseRuns()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B, Q, d", CPU_GRID, ids=lambda v: str(v))
def test_st_mnrl_fwd_bwd(benchmark, bench_record, request, B, Q, d, impl):
    why = _unavailable(impl)
    if why:
        pytest.skip(why)
    case = dict(impl=impl, B=B, Q=Q, d=d)
    peak = None
    if options.CURRENT.memory:
        peak = peak_bytes(case) / 2**20

    def members() -> list[str]:  # the selected implementations of this (B, Q, d)
        chosen = case_runs.selected_params(request.session, "bench_st.py", "test_st_mnrl_fwd_bwd")
        return [p["impl"] for p in chosen if (p["B"], p["Q"], p["d"]) == (B, Q, d) and not _unavailable(p["impl"])]

    disabled = dict(warmup=0, min_rounds=1, max_rounds=1) if benchmark.disabled else None
    run = _RUNS.get((B, Q, d), lambda: run_case(B, Q, d, members(), disabled))
    fields = case_runs.record_fields(benchmark, run, impl)
    bench_record(
        benchmark,
        workload=f"ST MNRL B={B} Q={Q} d={d} fp32 (eager = sentence-transformers MNRL)",
        impl=impl,
        peak_mib=peak,
        mini_batch_size=MINI_BATCH_SIZE if impl == "st_cached" else None,
        **fields,
    )
