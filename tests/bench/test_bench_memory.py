"""The batched CPU memory probe the benchmark files share: several probe servers at once,
results in the order of the cases, a failed case as None, and the API steps' one factory."""

from __future__ import annotations

import pytest

from benchmarks.harness import api_cases
from benchmarks.harness.memory import cpu_extra_peak_mib_parallel


def test_parallel_probe_keeps_case_order_and_reports_failures_as_none():
    # InfoNCE at B x B logits: the larger batch needs more memory than the smaller one
    small = dict(loss="infonce", backend="eager", B=256, d=16)
    large = dict(small, B=2048)
    broken = dict(small, backend="no-such-backend")
    peaks = cpu_extra_peak_mib_parallel("benchmarks.harness.cases:loss_step", [large, broken, small], workers=2)
    assert len(peaks) == 3 and peaks[1] is None
    logits_mib = 2048 * 2048 * 4 / 2**20
    assert peaks[0] > logits_mib > peaks[2] >= 0, peaks


def test_parallel_probe_of_no_cases_starts_nothing():
    assert cpu_extra_peak_mib_parallel("benchmarks.harness.cases:loss_step", []) == []


def test_api_step_builds_the_named_step_and_refuses_others():
    step = api_cases.api_step("supcon_labels_step", backend="torch", N=16, d=8, num_labels=4)
    step()  # one forward + backward
    with pytest.raises(ValueError, match="unknown step"):
        api_cases.api_step("supcon_labels_inputs", N=16, d=8, num_labels=4)


def test_probe_counts_the_cpp_block_buffer_kept_between_calls():
    """The cpp backend keeps a block buffer (<= 16 MiB) between calls; the probe's warm-up
    call must not hide it from the measured step: InfoNCE at B = N = 1024 sweeps one
    [1024, 1024] float32 block (4 MiB), which the reported peak includes (less the RSS
    counters' per-thread batching of up to 64 pages; hidden, it read 0.0 MiB)."""
    from tests.helpers.backends import require

    require("cpp")
    (peak,) = cpu_extra_peak_mib_parallel(
        "benchmarks.harness.cases:loss_step", [dict(loss="infonce", backend="cpp", B=1024, d=16)], workers=1
    )
    assert peak is not None and peak >= 0.9 * 1024 * 1024 * 4 / 2**20, peak
