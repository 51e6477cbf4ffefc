"""The option benchmarks (bench_api.py, bench_st.py) on the loss grid's interleaved harness:
every implementation of a workload in the same rotating rounds, with spread and the noisy
flag in each record. Tiny shapes; nothing here is a measurement."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import case_runs, timing

QUICK = dict(warmup=1, min_rounds=3, max_rounds=3, budget_s=0.0)


def _assert_interleaved(run: case_runs.CaseRun, impls: list[str]) -> None:
    """Each timed round ran every implementation once, the order rotating between rounds."""
    assert run.order and all(set(impls) <= set(order) for order in run.order)
    if len(impls) > 1:  # the order rotates: no implementation always runs first
        assert len({tuple(n for n in order if n in impls) for order in run.order}) > 1
    for impl in impls:
        assert run.outcomes[impl] == ("ok", None)
        info = run.info[impl]
        assert len(run.samples[impl]) == run.case_info["rounds"] == 3
        assert info["min_s"] == min(run.samples[impl]) and info["spread"] == timing.spread(run.samples[impl])
    case = run.case_info
    assert set(case) >= {"noisy", "rounds", "stopped", "threads", "loadavg_before", "loadavg_after"}
    assert case["noisy"] == timing.is_noisy([run.info[i]["spread"] for i in impls])


def test_run_case_times_every_builder_together_and_reports_failures():
    calls = []

    def make(name, fail_at=None):
        def build():
            count = []

            def step():
                count.append(1)
                calls.append(name)
                if fail_at is not None and len(count) >= fail_at:
                    raise RuntimeError(f"{name} broke")

            return step

        return build

    class Missing(Exception):
        pass

    def unavailable():
        raise Missing("no such backend here")

    def wrong_value():
        raise AssertionError("values differ")

    run = case_runs.run_case(
        {"a": make("a"), "b": make("b"), "late": make("late", fail_at=2), "gone": unavailable, "wrong": wrong_value},
        settings=QUICK,
        threads=1,
        skip_reason=lambda exc: str(exc) if isinstance(exc, Missing) else None,
    )
    assert run.outcomes["gone"] == ("skip", "no such backend here")
    assert run.outcomes["wrong"][0] == "error" and isinstance(run.outcomes["wrong"][1], AssertionError)
    assert run.outcomes["late"][0] == "error" and "late broke" in str(run.outcomes["late"][1])
    _assert_interleaved(run, ["a", "b"])
    assert calls[:3] == ["a", "b", "late"]  # the warm-up round, all of them


def test_record_fields_replays_the_rounds_and_raises_or_skips_the_outcome():
    run = case_runs.CaseRun(
        outcomes={"ok": ("ok", None), "skip": ("skip", "why"), "err": ("error", ValueError("bad"))},
        samples={"ok": [0.3, 0.1, 0.2]},
        info={"ok": {"min_s": 0.1}},
        case_info={"noisy": False, "rounds": 3},
    )

    class Bench:
        disabled = True

        def pedantic(self, fn, **k):
            fn()

    assert case_runs.record_fields(Bench(), run, "ok") == {"min_s": 0.1, "noisy": False, "rounds": 3}
    with pytest.raises(pytest.skip.Exception, match="why"):
        case_runs.record_fields(Bench(), run, "skip")
    with pytest.raises(ValueError, match="bad"):
        case_runs.record_fields(Bench(), run, "err")
    with pytest.raises(RuntimeError, match="not part of its case's run"):
        case_runs.record_fields(Bench(), run, "absent")


def test_case_runs_make_each_workload_once():
    runs, made = case_runs.CaseRuns(), []
    for _ in range(3):
        runs.get("w", lambda: made.append(1) or case_runs.CaseRun())
    assert made == [1]


def test_bench_st_interleaves_its_implementations():
    pytest.importorskip("sentence_transformers")
    from benchmarks import bench_st

    impls = ["eager", "st_cached", "fastcl-torch"]
    run = bench_st.run_case(64, 1, 16, impls, settings=QUICK)
    _assert_interleaved(run, impls)
    assert run.case_info["threads"] == bench_st.THREADS


def test_bench_st_refuses_to_time_a_different_loss(monkeypatch):
    pytest.importorskip("sentence_transformers")
    from benchmarks import bench_st

    real = bench_st.st_step

    def off_by_one(impl, *a, value=False, **k):
        fn = real(impl, *a, value=value, **k)
        return (lambda: fn() + 1.0) if value and impl == "fastcl-torch" else fn

    monkeypatch.setattr(bench_st, "st_step", off_by_one)
    run = bench_st.run_case(32, 0, 8, ["eager", "fastcl-torch"], settings=QUICK)
    kind, exc = run.outcomes["fastcl-torch"]
    assert kind == "error" and isinstance(exc, AssertionError) and "fastcl-torch" not in run.samples


@pytest.mark.parametrize(
    "test, params, impls",
    [
        ("test_supcon_labels_fwd_bwd", dict(N=32, d=8, labels=4), ["pml-supcon", "torch"]),
        ("test_mnrl_gte_joint_fwd_bwd", dict(B=16, Q=1, d=8, hardness=None), ["st-mnrl", "torch"]),
        ("test_matryoshka_mnrl_fwd_bwd", dict(B=16, Q=1, d=768), ["st-matryoshka-cmnrl", "torch"]),
    ],
)
def test_bench_api_interleaves_each_workload(test, params, impls):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("pytorch_metric_learning")
    from benchmarks import bench_api

    run = bench_api.run_case(test, params, impls + ["triton"], settings=QUICK)
    _assert_interleaved(run, impls)
    kind, why = run.outcomes["triton"]
    if torch.cuda.is_available():
        pytest.skip("triton may run here")
    assert kind == "skip" and "triton" in why


def test_bench_gradcache_interleaves_cached_and_uncached_steps():
    pytest.importorskip("transformers")
    from benchmarks import bench_gradcache

    run = bench_gradcache.run_case(4, ["uncached", "cached"], settings=QUICK)
    _assert_interleaved(run, ["uncached", "cached"])
