"""The benchmark suite's plumbing on tiny inputs: peers compute the same loss (and the check
catches one that does not), the correctness-at-scale module, the report generator and CLI."""

from __future__ import annotations

import json

import pytest
import torch

from fastcl.bench import correctness, peers, report
from fastcl.bench.cases import make_inputs
from fastcl.ops.dispatch import BackendUnavailableError

SHAPES = {"supmpn": (3, 2), "supcon": (3, 2), "mnrl": (1, 2), "infonce": (1, 0)}
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
    ref = {k: v.detach().double().requires_grad_() for k, v in inputs.items() if v is not None}
    from fastcl.bench.cases import LOSSES

    LOSSES[loss][1](**ref, temperature=peers.TEMPERATURE).backward()
    for k, v in ref.items():
        assert correctness.rel_err(inputs[k].grad, v.grad) < 1e-4, k


def test_check_value_rejects_a_different_loss():
    inputs = make_inputs("supmpn", 12, 3, 2, 16, seed=1)
    # SupCon keeps the anchor's other positives in the denominator: a different loss
    wrong = peers.build("pml-supcon", "supcon", inputs)
    with pytest.raises(peers.PeerMismatchError, match="pml-supcon computes supmpn"):
        peers.check_value("pml-supcon", "supmpn", wrong, inputs)
    right = peers.build("pml-ntxent", "supmpn", inputs)
    assert peers.check_value("pml-ntxent", "supmpn", right, inputs)["abs_err"] < 1e-5
    with pytest.raises(peers.PeerMismatchError):
        peers.check_value("nan", "supmpn", lambda: torch.tensor(float("nan")), inputs)


def test_unavailable_says_why():
    assert "does not compute supmpn" in peers.unavailable("st-mnrl", "supmpn", "cpu")
    assert "CUDA only" in peers.unavailable("inf-cl", "infonce", "cpu")
    assert "unknown implementation" in peers.unavailable("nope", "infonce", "cpu")
    assert peers.unavailable("eager", "supcon", "cpu") is None


def test_correctness_module_on_tiny_workload():
    recs = correctness.check_workload("mnrl", 16, 1, 2, 8, "float32", "cpu", ["eager", "torch", "st-cmnrl", "inf-cl"])
    status = {r["impl"]: r["status"] for r in recs}
    assert status == {"eager": "ok", "torch": "ok", "st-cmnrl": "ok", "inf-cl": "skipped"}


def _fake_run(tmp_path):
    """A pytest-benchmark JSON shaped like bench_losses.py's output."""
    def bench(impl, family, B, seconds, peak):
        return {"name": f"x-{impl}-{B}", "stats": {"median": seconds},
                "extra_info": {"workload": f"supmpn B={B} P=5 Q=5 d=64 float32 cpu", "impl": impl, "family": family,
                               "loss": "supmpn", "B": B, "P": 5, "Q": 5, "d": 64, "dtype": "float32", "device": "cpu",
                               "peak_mib": peak, "tflops": 1e-3, "gemm_share": 0.5, "abs_err": 1e-7}}
    doc = {
        "datetime": "2026-11-23T12:00:00", "machine_info": {"python_version": "3.11", "fastcl": {
            "date": "2026-11-23T12:00:00+00:00", "cpu_count": 2, "torch_threads": 2, "loadavg_start": [3.0, 2, 1],
            "loadavg_end": [4.0, 2, 1], "versions": {"torch": "2.13"}, "backends": {"cpp": "not built"}}},
        "benchmarks": [bench("eager", "reference", 128, 0.2, 100.0), bench("torch", "fastcl", 128, 0.1, 10.0),
                       bench("pml-ntxent", "peer", 128, 0.4, 120.0), bench("eager", "reference", 512, 0.8, 400.0),
                       bench("torch", "fastcl", 512, 0.5, 20.0), {"name": "gradcache", "stats": {"median": 1.0},
                                                                  "extra_info": {"mode": "cached"}}],
        "fastcl_skipped": [{"workload": "supmpn B=128 P=5 Q=5 d=64 float32 cpu", "impl": "cpp",
                            "reason": "fastcl backend 'cpp': not built"}],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    return path


def test_report_tables_plots_and_cli(tmp_path):
    from fastcl.__main__ import main as cli

    path = _fake_run(tmp_path)
    out = tmp_path / "RESULTS.md"
    assert cli(["bench-report", str(path), "--out", str(out), "--plots", str(tmp_path / "plots")]) == 0
    text = out.read_text()
    assert "| 128 | **torch** | 100.0 | 2.00x | 10.0 | 0.100x |" in text
    assert "| 512 | eager | 800.0 | 1.00x | 400.0 | 1.000x |" in text
    assert "`cpp`: B=128: fastcl backend 'cpp': not built" in text
    assert "1.60x faster than eager" in text and "0.05x eager's peak memory" in text
    assert "load average (1 min): 3.0 at start, 4.0 at end" in text
    png = tmp_path / "plots" / "cpu-supmpn-P5-Q5-d64-float32.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](plots/cpu-supmpn-P5-Q5-d64-float32.png)" in text


def test_report_refuses_json_without_loss_records(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"benchmarks": [], "machine_info": {}}))
    with pytest.raises(SystemExit, match="no fastcl loss benchmarks"):
        report.main(report.argparse.Namespace(json=[str(path)], out=str(tmp_path / "R.md"), plots=None, notes=None))
