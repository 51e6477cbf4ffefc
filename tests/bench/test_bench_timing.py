"""The benchmark harness's logic, without timing anything real: the spread and noisy rule,
the interleaved rounds (order, stopping, failures) on a fake clock, the replay into
pytest-benchmark, the GEMM floor's plan and products, and the compile-friendly losses."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.harness import floor, fusable, peers, timing
from benchmarks.harness.cases import make_inputs
from fastcl import reference as R
from fastcl.testing import assert_roundoff, loss_terms

# --- spread and the noisy rule ---------------------------------------------------------


def test_spread_is_kth_fastest_over_fastest():
    assert timing.spread([1.0, 1.5, 1.02, 1.1, 5.0]) == pytest.approx(0.10)  # 3rd fastest 1.1 vs 1.0
    assert timing.spread([2.0, 2.1]) == pytest.approx(0.05)  # two rounds: the 2nd vs the 1st
    assert timing.spread([3.0, 3.0, 3.0, 9.0]) == 0.0  # one slow round does not matter
    assert timing.spread([1.0]) == math.inf and timing.spread([]) == math.inf
    # one lucky round: the minimum is not reproduced, the spread says so
    assert timing.spread([1.0, 2.0, 2.0, 2.0]) == pytest.approx(1.0)


def test_noisy_threshold():
    t = timing.NOISY_SPREAD
    assert not timing.is_noisy([0.0, t / 2, t])  # at the threshold: still trusted
    assert timing.is_noisy([0.0, t * 1.01])
    assert timing.is_noisy([math.nan]) and timing.is_noisy([math.inf])
    assert not timing.is_noisy([])


# --- interleaved rounds on a fake clock ------------------------------------------------


class FakeMachine:
    """A clock and steps that advance it: ``durations[name]`` is a list cycled per call."""

    def __init__(self, durations: dict[str, list[float]]):
        self.now = 0.0
        self.calls: list[str] = []
        self.durations = durations
        self.count = {n: 0 for n in durations}

    def clock(self) -> float:
        return self.now

    def steps(self) -> dict:
        def make(name):
            def step():
                seq = self.durations[name]
                self.now += seq[self.count[name] % len(seq)]
                self.count[name] += 1
                self.calls.append(name)

            return step

        return {n: make(n) for n in self.durations}


def test_round_order_rotates():
    names = ["a", "b", "c"]
    assert [timing.round_order(names, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert timing.round_order([], 3) == []


def test_interleave_runs_rounds_in_rotation_and_stops_when_settled():
    m = FakeMachine({"a": [1.0], "b": [2.0], "c": [3.0]})
    out = timing.interleave(m.steps(), warmup=1, min_rounds=3, max_rounds=10, budget_s=1e9, clock=m.clock)
    # warm-up round 0, then timed rounds 1..3 rotated; every name once per round
    assert m.calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert out.order == [["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert out.stopped == "settled" and out.rounds == 3
    assert out.samples == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [3.0] * 3}
    assert out.first_s == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert out.minimum("b") == 2.0 and out.spread("c") == 0.0 and not out.noisy()


def test_interleave_keeps_going_until_the_fastest_rounds_agree():
    # "a" is disturbed in its first timed rounds, then quiet: the loop waits for 3 quiet rounds
    m = FakeMachine({"a": [1.0, 3.0, 2.0, 1.5, 1.0, 1.0, 1.0], "b": [1.0]})
    out = timing.interleave(m.steps(), warmup=1, min_rounds=3, max_rounds=20, budget_s=1e9, clock=m.clock)
    assert out.stopped == "settled"
    assert out.samples["a"] == [3.0, 2.0, 1.5, 1.0, 1.0, 1.0]  # the warm-up call (1.0) is not timed
    assert out.first_s["a"] == 1.0
    assert out.rounds == 6


def test_interleave_stops_at_the_budget_or_max_rounds_and_flags_noise():
    noisy = {"a": [1.0, 2.0, 3.0], "b": [1.0]}  # "a" gets three equal fastest rounds only at round 7
    m = FakeMachine(noisy)
    out = timing.interleave(m.steps(), warmup=0, min_rounds=3, max_rounds=100, budget_s=10.0, clock=m.clock)
    assert out.stopped == "budget" and out.rounds == 4  # rounds of 2, 3, 4, 2 s: past 10 s after four
    assert out.noisy()
    m = FakeMachine(noisy)
    out = timing.interleave(m.steps(), warmup=0, min_rounds=3, max_rounds=5, budget_s=1e9, clock=m.clock)
    assert out.stopped == "max_rounds" and out.rounds == 5
    # never fewer than min_rounds, even past the budget
    m = FakeMachine(noisy)
    out = timing.interleave(m.steps(), warmup=0, min_rounds=4, max_rounds=100, budget_s=0.0, clock=m.clock)
    assert out.rounds == 4


def test_interleave_gives_an_unsettled_reference_more_rounds_after_the_budget():
    # the floor's blockings: "floor" slowed in its first rounds (a busy machine), "floor1" always
    # slower; the implementation settles at once. Past the 10 s budget the fastest blocking's
    # spread is still wide, so rounds go on until its three fastest agree
    m = FakeMachine({"impl": [1.0], "floor": [3.0, 2.0, 1.5, 1.0, 1.3, 1.0, 1.0, 1.0], "floor1": [2.5]})
    kw = dict(warmup=0, min_rounds=3, max_rounds=30, budget_s=10.0, clock=m.clock)
    out = timing.interleave(m.steps(), **kw, references=[("floor", "floor1")], reference_budget_s=30.0)
    assert out.stopped == "settled" and out.rounds == 7  # floor's 1.0, 1.0, 1.0 at rounds 4, 6, 7
    assert out.spread("floor") <= timing.NOISY_SPREAD
    assert timing.unsettled_references(out, [("floor", "floor1")]) == []
    # without references the budget ends the loop with the floor still too wide to divide by
    m = FakeMachine({"impl": [1.0], "floor": [3.0, 2.0, 1.5, 1.0, 1.3, 1.0, 1.0, 1.0], "floor1": [2.5]})
    out = timing.interleave(m.steps(), **dict(kw, clock=m.clock))
    assert out.stopped == "budget" and out.rounds == 3
    assert timing.unsettled_references(out, [("floor", "floor1")]) == ["floor"]
    # a reference that never settles: a second budget's worth of rounds, then it says so
    m = FakeMachine({"impl": [1.0], "floor": [1.0, 2.0, 2.0]})
    out = timing.interleave(m.steps(), **dict(kw, clock=m.clock), references=[("floor",)], reference_budget_s=5.0)
    assert out.stopped == "reference_budget" and 10.0 <= out.elapsed_s < 15.0 + 3.0
    # ... and never beyond max_rounds
    m = FakeMachine({"impl": [1.0], "floor": [1.0, 2.0, 2.0]})
    out = timing.interleave(m.steps(), **dict(kw, clock=m.clock, max_rounds=4), references=[("floor",)])
    assert out.stopped == "budget" and out.rounds == 4


def test_interleave_drops_a_failing_step_and_keeps_its_error():
    m = FakeMachine({"a": [1.0], "b": [1.0]})
    steps = m.steps()

    def broken():
        raise RuntimeError("boom")

    steps["bad"] = broken
    out = timing.interleave(steps, warmup=1, min_rounds=3, max_rounds=10, budget_s=1e9, clock=m.clock)
    assert isinstance(out.errors["bad"], RuntimeError) and "bad" not in out.samples
    assert out.samples == {"a": [1.0] * 3, "b": [1.0] * 3}


def test_interleave_repeats_short_reference_steps():
    """A reference step shorter than min_sample_s runs several times per turn (calibrated on
    its last warm-up call); its sample is the mean of those calls. Others run once."""
    m = FakeMachine({"impl": [3.0], "floor": [0.5, 0.25]})  # floor: 0.5 s warm, then 0.25 s calls
    out = timing.interleave(
        m.steps(), warmup=1, min_rounds=3, max_rounds=3, budget_s=1e9, min_sample_s={"floor": 2.0}, clock=m.clock
    )
    assert out.repeats == {"impl": 1, "floor": 4}  # ceil(2.0 / 0.5)
    assert m.count == {"impl": 1 + 3, "floor": 1 + 3 * 4}
    assert out.samples["floor"] == pytest.approx([(0.25 + 0.5 + 0.25 + 0.5) / 4] * 3)
    assert out.samples["impl"] == [3.0] * 3 and out.order[0] == ["floor", "impl"]
    # capped, and 1 without a warm-up call to calibrate on
    assert timing.repeats_for(1e-6, 2.0) == timing.MAX_REPEATS and timing.repeats_for(None, 2.0) == 1
    assert timing.repeats_for(5.0, 2.0) == 1 and timing.repeats_for(0.5, 2.0, max_repeats=3) == 3
    m = FakeMachine({"floor": [0.5]})
    out = timing.interleave(m.steps(), warmup=0, min_rounds=1, max_rounds=1, min_sample_s={"floor": 2.0}, clock=m.clock)
    assert out.repeats == {"floor": 1}


def test_impl_and_case_fields_are_what_every_benchmark_records():
    m = FakeMachine({"a": [1.0, 1.0, 1.2], "b": [2.0, 2.5, 3.0], "floor": [0.5, 0.9]})
    out = timing.interleave(m.steps(), warmup=0, min_rounds=3, max_rounds=3, budget_s=1e9, clock=m.clock)
    a = timing.impl_fields(out, "a")
    assert (a["min_s"], a["median_s"], a["spread"], a["first_s"]) == (1.0, 1.0, pytest.approx(0.2), 1.0)
    case = timing.case_fields(out, ["a"], threads=2, loadavg_before=(1, 2, 3), loadavg_after=[4, 5, 6])
    # noisy is about the implementations named (here "a", spread 20 %), not the references
    assert case == dict(
        noisy=True,
        rounds=3,
        stopped="max_rounds",
        timed_s=pytest.approx(out.elapsed_s),
        noisy_threshold=timing.NOISY_SPREAD,
        threads=2,
        loadavg_before=[1, 2, 3],
        loadavg_after=[4, 5, 6],
    )
    quiet = FakeMachine({"a": [1.0], "floor": [0.5, 0.9]})
    out = timing.interleave(quiet.steps(), warmup=0, min_rounds=3, max_rounds=3, budget_s=1e9, clock=quiet.clock)
    assert not timing.case_fields(out, ["a"], threads=1, loadavg_before=(), loadavg_after=())["noisy"]


# --- when a share of a reference may be printed ------------------------------------------


def test_share_problem_rules():
    from benchmarks.harness import shares

    ok = dict(spread=0.01, sample_s=0.01)
    assert shares.floor_share_problem(0.9, **ok) is None
    assert shares.floor_share_problem(None, **ok) is None  # nothing measured, nothing to print
    # the numbers (SupCon B=64: 233-244 % of the floor, 128-1020 % of the GEMM rate)
    assert "more than a step doing its work can reach" in shares.floor_share_problem(2.44, **ok)
    assert "more than a step doing its work can reach" in shares.gemm_share_problem(10.2, in_rounds=True, **ok)
    assert shares.gemm_share_problem(1.28, in_rounds=True, **ok) is None  # a 3-pass step at its floor: 8/6
    assert "apart from the case's interleaved rounds" in shares.gemm_share_problem(0.5, in_rounds=False, **ok)
    assert "rounds disagree (spread 11% > 5%)" in shares.floor_share_problem(0.8, spread=0.11, sample_s=0.01)
    assert "rounds disagree" in shares.floor_share_problem(0.8, spread=None, sample_s=0.01)
    assert "samples of 1.20 ms" in shares.floor_share_problem(0.8, spread=0.0, sample_s=0.0012)
    assert shares.floor_share_problem(0.8, spread=0.0, sample_s=None) is None  # older runs: not recorded


def test_gemm_step_times_one_product_into_a_kept_output():
    from benchmarks.harness import metrics

    step = metrics.gemm_step(6, 10, 4, "float64")
    first = step()
    assert step() is first  # the same output buffer every call: no allocation is timed
    a, c = step.inputs
    torch.testing.assert_close(first, a @ c)
    assert step.flops == 2 * 6 * 10 * 4
    assert metrics.gemm_columns(2**20, 10**6) == 2**26 // 2**20  # a large product: a column slice
    assert metrics.tflops(2e12, 2.0) == 1.0 and metrics.tflops(1.0, None) is None


def test_replay_timer_gives_each_round_its_duration():
    clock = timing.ReplayTimer([0.3, 0.1, 0.2])
    durations = []
    for _ in range(3):
        start = clock()
        durations.append(clock() - start)
    assert durations == pytest.approx([0.3, 0.1, 0.2])


def test_replay_into_pytest_benchmark(benchmark):
    timing.replay(benchmark, [0.3, 0.1, 0.2])
    if benchmark.disabled:
        pytest.skip("pytest-benchmark is disabled in this run")
    stats = benchmark.stats.stats
    assert (stats.rounds, stats.min, stats.median, stats.max) == (
        3,
        pytest.approx(0.1),
        pytest.approx(0.2),
        pytest.approx(0.3),
    )


# --- the GEMM floor --------------------------------------------------------------------


def test_floor_plan_blocks_and_scale():
    whole = floor.plan_floor(64, 640, 32)
    assert (whole.rows, whole.blocks, whole.timed_blocks, whole.scale) == (64, 1, 1, 1.0)
    # the S/X buffer stays within max_elements however large B x N gets
    big = floor.plan_floor(8192, 81920, 128)
    assert big.buffer_elements <= floor.FLOOR_MAX_ELEMENTS and big.rows * big.blocks >= 8192
    assert big.rows < 8192
    # beyond max_flops only a prefix of full blocks runs and the time is scaled up
    part = floor.plan_floor(1000, 100, 10, max_elements=100 * 64, max_flops=floor.floor_flops(200, 100, 10))
    assert part.rows == 64 and part.blocks == 16 and part.timed_blocks == 3
    assert part.timed_rows == 192 and part.scale == pytest.approx(1000 / 192)
    # short last block, everything timed
    full = floor.plan_floor(100, 50, 8, max_elements=30 * 50)
    assert (full.rows, full.blocks, full.timed_blocks, full.timed_rows, full.scale) == (30, 4, 4, 100, 1.0)
    with pytest.raises(ValueError):
        floor.plan_floor(0, 10, 10)


def test_floor_plans_tall_and_short_blocks():
    # small problems fit one block either way: one plan
    assert [p.rows for p in floor.floor_plans(64, 640, 32)] == [64]
    tall, short = floor.floor_plans(4096, 40960, 128)
    assert tall.rows == floor.FLOOR_MAX_ELEMENTS // 40960 and short.rows == tall.rows // 8
    assert tall.buffer_elements <= floor.FLOOR_MAX_ELEMENTS and short.buffer_elements <= tall.buffer_elements
    # a block is never shorter than one row, however large N is
    assert all(p.rows >= 1 for p in floor.floor_plans(8, 10**8, 4))


def test_fastest_floor_scales_each_blocking_to_the_batch():
    plans = floor.named_floor_plans(4096, 40960, 128)
    assert list(plans) == ["floor", "floor1"]
    part = floor.named_floor_plans(1000, 100, 10, max_elements=100 * 64, max_flops=floor.floor_flops(200, 100, 10))
    # a blocking timed on a prefix of its blocks is compared at the whole batch's time
    assert part["floor"].scale > 1
    samples = {"floor": [2.0, 1.0], "floor1": [1.5], "cpp": [0.1]}
    name, seconds = floor.fastest_floor(plans, samples)
    assert (name, seconds) == min(((n, min(samples[n]) * plans[n].scale) for n in plans), key=lambda x: x[1])
    assert floor.fastest_floor(plans, {"cpp": [0.1]}) is None


@pytest.mark.parametrize("B, N, max_elements", [(12, 40, 10**6), (13, 40, 4 * 40)])
def test_floor_step_computes_the_three_products(B, N, max_elements):
    plan = floor.plan_floor(B, N, 8, max_elements=max_elements)
    step = floor.floor_step(plan, "float64")
    da, dc = step()
    a, c = step.inputs
    want_da, want_dc = floor.floor_reference(a, c)
    torch.testing.assert_close(da, want_da)
    torch.testing.assert_close(dc, want_dc)
    da2, dc2 = step()  # a second step starts the accumulator afresh
    torch.testing.assert_close(dc2, want_dc)


def test_share_of_floor():
    assert floor.share_of_floor(0.9, 1.0) == pytest.approx(0.9)
    assert floor.share_of_floor(None, 1.0) is None and floor.share_of_floor(1.0, None) is None


# --- the compile-friendly formulations equal the oracles --------------------------------

SHAPES = {"supmpn": (3, 2), "supcon": (3, 2), "mnrl": (1, 2), "infonce": (1, 0)}


@pytest.mark.parametrize("loss", list(fusable.LOSSES))
def test_fusable_losses_equal_the_oracles(loss):
    P, Q = SHAPES[loss]
    inputs = make_inputs(loss, 10, P, Q, 16, "float64", seed=5)
    oracle = {"supmpn": R.supmpn, "supcon": R.supcon, "mnrl": R.mnrl, "infonce": R.infonce}[loss]
    got = fusable.LOSSES[loss](**inputs, temperature=peers.TEMPERATURE)
    grads = torch.autograd.grad(got, [v for v in inputs.values() if v is not None])
    want = oracle(**inputs, temperature=peers.TEMPERATURE)
    want_grads = torch.autograd.grad(want, [v for v in inputs.values() if v is not None])
    # float64 sums of d + N + B terms; logits (and the gradients' cancelling terms) of size 1/tau
    terms, size = loss_terms(10, 10 * (1 + P + Q), 16), 1 / peers.TEMPERATURE
    assert_roundoff(got, want, torch.float64, terms=terms, magnitude=size)
    assert_roundoff(list(grads), list(want_grads), torch.float64, terms=terms, magnitude=size)


# --- one case of benchmarks/bench_losses.py, end to end on a tiny shape ----------------


def test_run_case_checks_times_and_reports_each_implementation(monkeypatch):
    from benchmarks import bench_losses as BL
    from fastcl.ops.dispatch import BackendUnavailableError

    def wrong(loss, t):  # a different loss: must fail the value check, never be timed
        return lambda: (t["anchor"] * 0).sum() + 123.0

    def refuses(loss, t):  # passes the check, then dispatch-style refusal while timed
        calls = []

        def fn():
            calls.append(1)
            if len(calls) > 1:
                raise BackendUnavailableError("backend 'x' cannot take these inputs")
            return peers.IMPLS["eager"].build(loss, t)()

        return fn

    extra = {
        "wrong": peers.Impl("wrong", "peer", ("mnrl",), wrong),
        "refuses": peers.Impl("refuses", "peer", ("mnrl",), refuses),
    }
    monkeypatch.setattr(peers, "IMPLS", {**peers.IMPLS, **extra})
    monkeypatch.setattr(BL, "TIMING", dict(warmup=1, min_rounds=2, max_rounds=2, budget_s=0.0))
    base = dict(loss="mnrl", B=8, P=1, Q=1, d=16, dtype="float32", device="cpu")
    cases = [dict(base, backend=b) for b in ("eager", "torch", "wrong", "refuses")]
    run = BL.run_case(cases, cpu_memory={BL.workload_name(cases[0]) + "|eager": 1.5})
    assert run.outcomes["eager"] == ("ok", None) and run.outcomes["torch"] == ("ok", None)
    kind, exc = run.outcomes["wrong"]
    assert kind == "error" and isinstance(exc, peers.PeerMismatchError)
    assert run.outcomes["refuses"] == ("skip", "backend 'x' cannot take these inputs")
    assert set(run.samples) == {"eager", "torch"} and all(len(s) == 2 for s in run.samples.values())
    info = run.info["eager"]
    assert info["peak_mib"] == 1.5 and info["abs_err"] < 1e-5 and info["min_s"] == min(run.samples["eager"])
    assert info["floor_share_measured"] == pytest.approx(run.case_info["floor_s"] / info["min_s"])
    # a share is recorded where its reference was sound, else None with the reason
    for ref in ("floor", "gemm"):
        sound = info[f"{ref}_share_problem"] is None
        assert info[f"{ref}_share"] == (info[f"{ref}_share_measured"] if sound else None)
    # the GEMM rate comes from the same rounds as the implementations, not a separate measurement
    case = run.case_info
    assert case["gemm_in_rounds"] and case["gemm_tflops"] > 0 and case["gemm_repeats"] >= 1
    assert info["gemm_share_measured"] == pytest.approx(info["tflops"] / case["gemm_tflops"])
    # the references are repeated within their turn until a sample lasts MIN_REFERENCE_SAMPLE_S
    from benchmarks.harness.shares import MIN_REFERENCE_SAMPLE_S

    # (how many: calibrated on a warm-up call, see test_interleave_repeats_short_reference_steps)
    assert 1 <= case["floor_repeats"] <= timing.MAX_REPEATS and case["floor_sample_s"] > 0
    if case["floor_sample_s"] < MIN_REFERENCE_SAMPLE_S:  # a floor this tiny can stay short even so
        assert info["floor_share_problem"] and info["floor_share"] is None
    assert run.case_info["rounds"] == 2 and run.case_info["floor_scale"] == 1.0
    assert run.case_info["threads"] == torch.get_num_threads()
    assert len(run.case_info["loadavg_before"]) == 3 and "noisy" in run.case_info
