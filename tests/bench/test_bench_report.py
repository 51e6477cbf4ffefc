"""The benchmark suite's plumbing on tiny inputs: peers compute the same loss (and the check
catches one that does not), the correctness-at-scale module, the report generator and CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks.harness import correctness, peers, report
from benchmarks.harness.cases import make_inputs
from fastcl.ops.dispatch import BackendUnavailableError
from fastcl.testing import assert_roundoff, roundoff

SHAPES = {
    "supmpn": (3, 2),
    "supcon": (3, 2),
    "mnrl": (1, 2),
    "infonce": (1, 0),
    "clip": (1, 0),
    "siglip": (1, 0),
    "gist": (1, 1),
}
# float32 round-off of the B = 12, d = 16 problems below: a logit sums d terms, a row
# N <= 12 * 6 candidates, a candidate's gradient B anchors; logits of size 1/tau make it an
# absolute error of the loss and a relative one of the gradients (fastcl.testing.roundoff)
TINY_TERMS = 16 + 12 * 6 + 12
TINY_ROUNDOFF = roundoff(torch.float32, TINY_TERMS, 1 / peers.TEMPERATURE)
# torch.compile takes ~40 s per loss on a loaded 2-core machine: the benchmark covers it
FAST_IMPLS = [n for n in peers.IMPLS if n != "compile"]


def _pairs():
    for name in FAST_IMPLS:
        for loss in peers.IMPLS[name].losses:
            yield pytest.param(name, loss, id=f"{name}-{loss}")


@pytest.mark.parametrize("name, loss", list(_pairs()))
def test_peer_matches_reference_value_and_gradient(name, loss):
    why = peers.unavailable(name, loss, "cpu")
    if why:
        pytest.skip(why)
    P, Q = SHAPES[loss]
    inputs = make_inputs(loss, 12, P, Q, 16, seed=3)
    fn = peers.build(name, loss, inputs)
    try:
        peers.check_value(name, loss, fn, inputs)
    except BackendUnavailableError as exc:  # e.g. compiled Triton refuses CPU tensors
        pytest.skip(str(exc))
    fn().backward()
    ref = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in inputs.items() if v is not None}
    from benchmarks.harness.cases import LOSSES, hyper

    LOSSES[loss][1](**ref, **hyper(loss)).backward()
    for k, v in ref.items():
        if v.requires_grad:  # GIST's guide embeddings take no gradient
            assert correctness.rel_err(inputs[k].grad, v.grad) <= TINY_ROUNDOFF, k


def test_check_value_rejects_a_different_loss():
    inputs = make_inputs("supmpn", 12, 3, 2, 16, seed=1)
    # SupCon keeps the anchor's other positives in the denominator: a different loss
    wrong = peers.build("pml-supcon", "supcon", inputs)
    with pytest.raises(peers.PeerMismatchError, match="pml-supcon computes supmpn"):
        peers.check_value("pml-supcon", "supmpn", wrong, inputs)
    right = peers.build("pml-ntxent", "supmpn", inputs)
    assert peers.check_value("pml-ntxent", "supmpn", right, inputs)["abs_err"] <= TINY_ROUNDOFF
    with pytest.raises(peers.PeerMismatchError):
        peers.check_value("nan", "supmpn", lambda: torch.tensor(float("nan")), inputs)


def test_unavailable_says_why():
    assert "does not compute supmpn" in peers.unavailable("st-mnrl", "supmpn", "cpu")
    assert "CUDA only" in peers.unavailable("inf-cl", "infonce", "cpu")
    assert "unknown implementation" in peers.unavailable("nope", "infonce", "cpu")
    assert peers.unavailable("eager", "supcon", "cpu") is None


def test_graphs_builder_computes_the_loss_and_its_gradients():
    """``triton-graphs`` is ``triton`` under ``torch.compile(mode="reduce-overhead")``, CUDA
    only; the same builder around the ``torch`` backend runs here (no graphs on the CPU) and
    must give eager's loss and gradients."""
    assert "CUDA only" in peers.unavailable("triton-graphs", "supmpn", "cpu")
    assert peers.IMPLS["triton-graphs"].backend == "triton"
    t = make_inputs("supmpn", 16, 2, 1, 8, "float32", "cpu")
    leaves = {k: v for k, v in t.items() if v is not None}
    runs = []
    for build in (peers._graphs_builder("torch"), peers.IMPLS["eager"].build):
        for v in leaves.values():
            v.grad = None
        loss = build("supmpn", t)()
        loss.backward()
        runs.append((loss.detach(), {k: v.grad.clone() for k, v in leaves.items()}))
    (l0, g0), (l1, g1) = runs
    # two float32 orders of the same sums (compiled and eager; another BLAS path on another
    # host): logits are d-term dot products of size 1/tau, each row sums N candidates, each
    # candidate's gradient B anchors; a logit's error eps/tau is an absolute error of the
    # loss and a relative one of the softmax weights, hence of the gradients
    terms, inv_tau = 8 + 16 * 3 + 16, 1 / peers.TEMPERATURE
    assert_roundoff(l0, l1, terms=terms, magnitude=inv_tau, msg="loss")
    for k in leaves:
        assert_roundoff(g0[k], g1[k], terms=terms, magnitude=g1[k].abs().max().item() * inv_tau, msg=k)


def test_correctness_module_on_tiny_workload():
    recs = correctness.check_workload("mnrl", 16, 1, 2, 8, "float32", "cpu", ["eager", "torch", "st-cmnrl", "inf-cl"])
    status = {r["impl"]: r["status"] for r in recs}
    assert status == {"eager": "ok", "torch": "ok", "st-cmnrl": "ok", "inf-cl": "skipped"}
    assert {r["reference_impl"] for r in recs} == {"oracle"}


def test_correctness_beyond_the_oracle_uses_torch_in_float64(monkeypatch):
    """Past MAX_EAGER_REFERENCE_ELEMENTS the reference is the chunked torch backend in
    float64; it must still catch a wrong implementation (here: a loss 1 % too large)."""
    monkeypatch.setattr(peers, "MAX_EAGER_REFERENCE_ELEMENTS", 10)
    recs = correctness.check_workload("supmpn", 12, 2, 1, 8, "float32", "cpu", ["eager", "cpp"])
    assert {r["reference_impl"] for r in recs} == {"torch-float64"}
    assert [r["status"] for r in recs] == ["ok", "ok"]
    build = peers.build

    def one_percent_off(*args):
        fn = build(*args)
        return lambda: fn() * 1.01

    monkeypatch.setattr(peers, "build", one_percent_off)
    recs = correctness.check_workload("supmpn", 12, 2, 1, 8, "float32", "cpu", ["cpp"])
    assert recs[0]["status"] == "FAIL"


def test_correctness_counts_the_gradients_storage_floor(monkeypatch):
    """fp16 gradients of a large mean fall below fp16's normal range (the first GPU run: 0.7
    relative error for every implementation at B = 8192). Here huge rows give the same
    subnormal gradients at B = 64: the floor (the exact gradient rounded to fp16) exceeds the
    tolerance, cpp sits on it and passes; gradients 1.5x too large still fail."""
    make = correctness.make_inputs

    def huge_rows(*args):
        return {k: None if v is None else (v.detach() * 2.0**13).requires_grad_() for k, v in make(*args).items()}

    monkeypatch.setattr(correctness, "make_inputs", huge_rows)
    (rec,) = correctness.check_workload("mnrl", 64, 1, 1, 16, "float16", "cpu", ["cpp"])
    assert rec["status"] == "ok", rec
    assert max(rec["grad_storage_floor"].values()) > rec["grad_rtol"]
    build = peers.build

    def grads_too_large(*args):
        fn = build(*args)

        def run():
            loss = fn()
            return loss + 0.5 * (loss - loss.detach())  # same value, gradients x 1.5

        return run

    monkeypatch.setattr(peers, "build", grads_too_large)
    (rec,) = correctness.check_workload("mnrl", 64, 1, 1, 16, "float16", "cpu", ["cpp"])
    atol, rtol = rec["value_tol"]  # the value still passes: the gradients fail
    assert rec["status"] == "FAIL" and rec["abs_err"] <= atol + rtol * abs(rec["reference"]), rec


def test_correctness_losses_pick_and_order_the_workloads(tmp_path):
    """--losses keeps the named losses in the given order (a GPU run checks the ones an
    earlier, cut-off run did not reach first) and refuses a name with no workload."""
    parser = argparse.ArgumentParser()
    correctness.add_arguments(parser)
    out = tmp_path / "c.json"
    args = parser.parse_args(
        ["--device", "cpu", "--scale", "0.001", "--dtypes", "float32", "--impls", "cpp", "--losses", "supcon,mnrl"]
    )
    args.out = str(out)
    assert correctness.main(args) == 0
    assert [r["loss"] for r in json.loads(out.read_text())["records"]] == ["supcon", "mnrl"]
    with pytest.raises(SystemExit, match="no workload for"):
        correctness.main(parser.parse_args(["--device", "cpu", "--losses", "gclsr"]))


def _fake_run(tmp_path, threads=2, name="run.json", interleaved=True, speed=1.0):
    """A pytest-benchmark JSON shaped like bench_losses.py's output (``interleaved=False``:
    the older, median-timed records without spread or floor)."""

    def bench(impl, family, B, seconds, peak, noisy=False, **more):
        seconds /= speed
        e = {
            "workload": f"supmpn B={B} P=5 Q=5 d=64 float32 cpu",
            "impl": impl,
            "family": family,
            "loss": "supmpn",
            "B": B,
            "P": 5,
            "Q": 5,
            "d": 64,
            "dtype": "float32",
            "device": "cpu",
            "peak_mib": peak,
            "tflops": 1e-3,
            "gemm_share": 0.5,
            "abs_err": 1e-7,
            "threads": threads,
        }
        if interleaved:
            e.update(
                min_s=seconds,
                spread=0.01,
                noisy=noisy,
                floor_s=0.05 / speed,
                floor_spread=0.02,
                floor_share=0.05 / seconds / speed,
                rounds=4,
                gemm_in_rounds=True,
                gemm_spread=0.01,
                **more,
            )
        return {
            "name": f"x-{impl}-{B}",
            "stats": {"median": seconds * 1.5 if interleaved else seconds, "min": seconds},
            "extra_info": e,
        }

    doc = {
        "datetime": "2026-11-23T12:00:00",
        "machine_info": {
            "python_version": "3.11",
            "fastcl": {
                "date": "2026-11-23T12:00:00+00:00",
                "cpu_count": 2,
                "torch_threads": threads,
                "loadavg_start": [3.0, 2, 1],
                "loadavg_end": [4.0, 2, 1],
                "versions": {"torch": "2.13"},
                "backends": {"cpp": "not built"},
            },
        },
        "benchmarks": [
            bench("eager", "reference", 128, 0.2, 100.0),
            bench("torch", "fastcl", 128, 0.1, 10.0),
            bench("compile", "reference", 128, 0.125, 50.0, compile_s=12.5),
            bench("pml-ntxent", "peer", 128, 0.4, 120.0),
            bench("eager", "reference", 512, 0.8, 400.0, noisy=True),
            bench("torch", "fastcl", 512, 0.5, 20.0),
            {"name": "gradcache", "stats": {"median": 1.0}, "extra_info": {"mode": "cached"}},
        ],
        "fastcl_skipped": [
            {
                "workload": "supmpn B=128 P=5 Q=5 d=64 float32 cpu",
                "impl": "cpp",
                "reason": "fastcl backend 'cpp': not built",
            }
        ],
    }
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_report_tables_plots_and_cli(tmp_path):
    from benchmarks.harness.__main__ import main as cli

    path = _fake_run(tmp_path)
    out = tmp_path / "RESULTS.md"
    assert cli(["report", str(path), "--out", str(out), "--plots", str(tmp_path / "plots")]) == 0
    text = out.read_text()
    # time = min of interleaved rounds (not the median), spread, share of the floor, compile seconds
    assert "| 128 | *floor: 3 GEMMs* | 50.0 | 2% | – | 100% |" in text
    assert "| 128 | **torch** | 100.0 | 1% | 2.00x | 50% | 10.0 | 0.100x |" in text
    assert "| 128 | compile | 125.0 | 1% | 1.60x | 40% | 50.0 | 0.500x | 1.0 | 50% | 12.5 |" in text
    # a case with a spread above the threshold is marked on each of its lines
    assert "| 512 (noisy) | eager | 800.0 | 1% | 1.00x | 6% | 400.0 | 1.000x |" in text
    assert "| 512 (noisy) | **torch** |" in text and "| 128 (noisy)" not in text
    assert "`cpp`: B=128: fastcl backend 'cpp': not built" in text
    assert "1.60x faster than eager" in text and "0.05x eager's peak memory" in text
    assert "10% of the GEMM floor" in text and "**noisy**" in text
    assert "(cpu, 2 threads)" in text
    assert "load average (1 min): 3.0 at start, 4.0 at end" in text
    png = tmp_path / "plots" / "cpu-supmpn-P5-Q5-d64-float32.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](plots/cpu-supmpn-P5-Q5-d64-float32.png)" in text
    assert "Thread scaling" not in text


def test_report_prints_a_share_only_where_its_reference_was_sound(tmp_path):
    """A run on a busy machine printed shares of 128-1020 % of the GEMM rate and 233-244 % of
    the floor at small shapes. Such shares show as – with the reason under the table."""
    path = _fake_run(tmp_path)
    doc = json.loads(path.read_text())
    rows = {(b["extra_info"].get("impl"), b["extra_info"].get("B")): b["extra_info"] for b in doc["benchmarks"]}
    # B=128 torch: a floor share no step doing the floor's GEMMs can reach, GEMM rate sound
    rows["torch", 128].update(floor_share=2.44, gemm_share=1.2)
    # B=128 compile: a GEMM rate the run measured apart from its rounds (as before 2026-11-27)
    rows["compile", 128].update(gemm_share=10.2, gemm_in_rounds=False)
    # B=512: the floor's own rounds disagree; the GEMM share was judged when recorded
    for impl in ("eager", "torch"):
        rows[impl, 512].update(floor_spread=0.11)
    rows["torch", 512].update(gemm_share=None, gemm_share_measured=3.0, gemm_share_problem="recorded reason")
    path.write_text(json.dumps(doc))
    groups, _ = report.load([path])
    (g,) = groups
    text = report.table(g)
    assert "| 128 | **torch** | 100.0 | 1% | 2.00x | – | 10.0 | 0.100x | 1.0 | 120% |" in text
    assert "| 128 | compile | 125.0 | 1% | 1.60x | 40% | 50.0 | 0.500x | 1.0 | – | 12.5 |" in text
    assert "| 512 (noisy) | eager | 800.0 | 1% | 1.00x | – | 400.0 |" in text
    notes = "\n".join(report.share_notes(g))
    assert "share of floor not shown (B=128 `torch`): 244% of the floor is more than a step doing its work" in notes
    assert "share of GEMM not shown (B=128 `compile`): the GEMM rate was timed apart from the case's" in notes
    assert "share of floor not shown (B=512 `eager`, B=512 `torch`): the floor's fastest rounds disagree" in notes
    assert "share of GEMM not shown (B=512 `torch`): recorded reason." in notes
    assert "1020%" not in text and "244%" not in text
    # the summary line does not quote an unsound share either
    g.rows = [r for r in g.rows if r.B == 128]
    assert "of the GEMM floor" not in report.summary(g)
    out = tmp_path / "RESULTS.md"
    report.main(report.argparse.Namespace(json=[str(path)], out=str(out), plots=None, notes=None))
    assert "Shares shown as –, measured but not sound" in out.read_text()


def test_report_prints_no_zero_peak_or_compile_time_it_did_not_measure(tmp_path):
    """A peak that was not measured (None) or below the RSS meter's resolution (a kept buffer
    read as 0.0) prints as n/a / < 1 with no ratio; a row of an implementation that compiled
    nothing in its case prints compile n/a, never 0.0."""
    path = _fake_run(tmp_path)
    doc = json.loads(path.read_text())
    rows = {(b["extra_info"].get("impl"), b["extra_info"].get("B")): b["extra_info"] for b in doc["benchmarks"]}
    rows["torch", 128].update(peak_mib=None)
    rows["pml-ntxent", 128].update(peak_mib=0.0)
    rows["compile", 128].update(compile_s=None)  # its graph compiled by an earlier case
    path.write_text(json.dumps(doc))
    groups, _ = report.load([path])
    (g,) = groups
    text = report.table(g)
    assert "| 128 | **torch** | 100.0 | 1% | 2.00x | 50% | n/a | – |" in text
    assert "| 128 | pml-ntxent | 400.0 | 1% | 0.50x | 12% | < 1 | – |" in text
    assert "| 128 | compile | 125.0 | 1% | 1.60x | 40% | 50.0 | 0.500x | 1.0 | 50% | n/a |" in text
    assert "| 0.0 |" not in text and "0.000x" not in text
    g.rows = [r for r in g.rows if r.B == 128]
    assert "eager's peak memory" not in report.summary(g)  # fastcl's best (torch) was not measured
    # the helpers the terminal summary (benchmarks/conftest.py) prints with
    assert report.peak_text(None) == "n/a" and report.peak_text(0.0) == "< 1" and report.peak_text(12.0) == "12.0"
    assert report.memory_ratio(0.0, 100.0) is None and report.memory_ratio(None, 100.0) is None
    assert report.memory_ratio(10.0, 0.4) is None and report.memory_ratio(10.0, 100.0) == "0.100x"
    assert report.compile_text(None) == "n/a" and report.compile_text(0.04) == "0.0"


def test_compile_time_is_recorded_only_where_the_case_compiled():
    from benchmarks import bench_losses as BL

    compile_impl, cudagraph, eager = (peers.IMPLS[n] for n in ("compile", "triton-cudagraph", "eager"))
    assert BL.compiled_here(compile_impl, 3, 4)  # a new graph: this case compiled it
    assert not BL.compiled_here(compile_impl, 4, 4)  # the loss's dynamic graph from an earlier case
    assert BL.compiled_here(compile_impl, None, None)  # no counter: cannot tell, counted as compiled
    assert BL.compiled_here(cudagraph, 4, 4)  # a CUDA graph is captured per case
    assert not BL.compiled_here(eager, 3, 4)
    before = BL._dynamo_graphs()
    assert before is not None  # the counter the rule reads exists in this torch
    fn = torch.compile(lambda x: (x * 3).sum(), dynamic=True)
    fn(torch.ones(4))
    assert BL._dynamo_graphs() > before
    mid = BL._dynamo_graphs()
    fn(torch.ones(6))  # the same dynamic graph
    assert BL._dynamo_graphs() == mid


def test_report_summary_compares_with_compile(tmp_path):
    groups, _ = report.load([_fake_run(tmp_path)])
    (g,) = groups
    line = report.summary(g)  # at the largest B fastcl ran (512): no compile record there
    assert "`torch`" in line and "torch.compile" not in line
    g.rows = [r for r in g.rows if r.B == 128]
    line = report.summary(g)
    assert "ahead of `torch.compile` (1.25x its time)" in line and "50% of the GEMM floor" in line


def test_report_reads_older_median_records(tmp_path):
    groups, _ = report.load([_fake_run(tmp_path, interleaved=False)])
    text = report.table(groups[0])
    assert "| 128 | **torch** | 100.0 | – | 2.00x | – | 10.0 | 0.100x |" in text
    assert "floor: 3 GEMMs" not in text and "noisy" not in text


def test_report_thread_scaling_across_runs(tmp_path):
    one = _fake_run(tmp_path, threads=1, name="t1.json")
    two = _fake_run(tmp_path, threads=2, name="t2.json", speed=1.6)
    out = tmp_path / "RESULTS.md"
    report.main(report.argparse.Namespace(json=[str(one), str(two)], out=str(out), plots=None, notes=None))
    text = out.read_text()
    assert "## supmpn P=5 Q=5 d=64 float32 (cpu, 1 thread)" in text
    assert "## supmpn P=5 Q=5 d=64 float32 (cpu, 2 threads)" in text
    assert (tmp_path / "plots" / "cpu-supmpn-P5-Q5-d64-float32-t1.png").exists()
    assert (tmp_path / "plots" / "cpu-supmpn-P5-Q5-d64-float32-t2.png").exists()
    assert "## Thread scaling" in text
    assert "| supmpn P=5 Q=5 d=64 float32 cpu | 128 | torch | 100.0 | 62.5 | 1.60x |" in text
    assert "| supmpn P=5 Q=5 d=64 float32 cpu | 512 (noisy) | eager | 800.0 | 500.0 | 1.60x |" in text


def test_report_refuses_json_without_loss_records(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"benchmarks": [], "machine_info": {}}))
    with pytest.raises(SystemExit, match="no fastcl loss benchmarks"):
        report.main(report.argparse.Namespace(json=[str(path)], out=str(tmp_path / "R.md"), plots=None, notes=None))


def test_report_scaling_runs_only_feed_the_scaling_table(tmp_path):
    one = _fake_run(tmp_path, threads=1, name="t1.json")
    two = _fake_run(tmp_path, threads=2, name="t2.json", speed=1.6)
    out = tmp_path / "RESULTS.md"
    report.main(report.argparse.Namespace(json=[str(two)], scaling=[str(one)], out=str(out), plots=None, notes=None))
    text = out.read_text()
    assert "(cpu, 2 threads)" in text and "(cpu, 1 thread)" not in text
    assert "| supmpn P=5 Q=5 d=64 float32 cpu | 128 | torch | 100.0 | 62.5 | 1.60x |" in text
    assert "`t1.json`" in text and "`t2.json`" in text  # both runs listed
    assert (tmp_path / "plots" / "cpu-supmpn-P5-Q5-d64-float32.png").exists()


@pytest.mark.parametrize("name", ["cce", "liger-flce"])
@pytest.mark.parametrize("loss", ["mnrl", "infonce"])
def test_linear_cross_entropy_peers_compute_the_loss(monkeypatch, name, loss):
    """cut-cross-entropy and Liger run on CUDA only; their adapters (normalised anchors
    against normalised candidates / tau, targets = own positive) are checked here against
    the reference with stand-ins that compute exactly their documented contract:
    ``linear_cross_entropy(e, c, targets)`` and ``LigerFusedLinearCrossEntropyLoss()(w, x, y)``
    are ``cross_entropy(e @ c.T, targets)`` (mean)."""
    import sys
    import types

    def lce(e, c, targets):
        return torch.nn.functional.cross_entropy(e @ c.T, targets)

    class Liger(torch.nn.Module):
        def forward(self, lin_weight, _input, target):
            return lce(_input, lin_weight, target)

    monkeypatch.setitem(sys.modules, "cut_cross_entropy", types.SimpleNamespace(linear_cross_entropy=lce))
    liger = types.ModuleType("liger_kernel.transformers.fused_linear_cross_entropy")
    liger.LigerFusedLinearCrossEntropyLoss = Liger
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", types.ModuleType("liger_kernel.transformers"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.fused_linear_cross_entropy", liger)
    P, Q = SHAPES[loss]
    inputs = make_inputs(loss, 12, P, Q, 16, seed=5)
    fn = peers.IMPLS[name].build(loss, inputs)  # past the CUDA-only gate: the adapter itself
    assert peers.check_value(name, loss, fn, inputs)["abs_err"] <= TINY_ROUNDOFF
    assert peers.unavailable(name, loss, "cpu") == f"{name} runs on CUDA only"
