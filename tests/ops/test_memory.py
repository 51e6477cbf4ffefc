"""Memory is the point: the fused backends never allocate a B x N buffer.

At B = 4096, P = Q = 5 the candidate set has N = 40960 columns, so one float32 copy of the
logits is 4096 * 40960 * 4 B = 671 MB. The extra peak RSS of a fused forward + backward
(measured in a fresh process) must stay far below that, while the eager reference, run
the same way, must exceed it: that proves the meter sees such a buffer.
"""

from __future__ import annotations

import pytest

from benchmarks.harness.memory import cpu_extra_peak_bytes
from tests.helpers.backends import backends_under_test, require

B, P, Q, D = 4096, 5, 5, 32
LOGITS_BYTES = B * B * (P + Q) * 4
CASE = dict(loss="supmpn", B=B, P=P, Q=Q, d=D)


def test_meter_sees_a_bxn_buffer():
    eager = cpu_extra_peak_bytes("benchmarks.harness.cases:loss_step", dict(CASE, backend="eager"))
    assert eager > LOGITS_BYTES, f"eager reference peaked at only {eager / 2**20:.0f} MiB"


@pytest.mark.parametrize("backend", [b for b in backends_under_test() if b in ("torch", "cpp")])
def test_fused_backend_has_no_bxn_buffer(backend):
    require(backend)
    extra = cpu_extra_peak_bytes("benchmarks.harness.cases:loss_step", dict(CASE, backend=backend))
    inputs = B * (1 + P + Q) * D * 4
    # O((B + N) d): normalised copies, gradients and a few bounded tiles (about 100 MB);
    # any B x N buffer alone would add 671 MB
    assert extra < LOGITS_BYTES / 2, f"{backend}: extra peak {extra / 2**20:.0f} MiB (inputs {inputs / 2**20:.0f} MiB)"


# The image-text and filtered losses: one float32 [B, B] logits block at B = 8192 is 256 MiB
# (open_clip's SigLIP keeps several); GIST's written-out scores [B, 4B] at B = 4096 are 256 MiB.
# CLIP's symmetric step keeps the columns' partials, O(threads * B), besides its row tiles.
SIGLIP = dict(B=8192, d=32)
GIST = dict(B=4096, d=32, g=16)
SQUARE_BYTES = 8192 * 8192 * 4


def test_meter_sees_the_peers_logits():
    peer = cpu_extra_peak_bytes("tests.ops.memory_cases:siglip_step", dict(SIGLIP, backend="open_clip"))
    assert peer > SQUARE_BYTES, f"open_clip's SigLIP peaked at only {peer / 2**20:.0f} MiB"
    written = cpu_extra_peak_bytes("tests.ops.memory_cases:gist_step", dict(GIST, backend="reference"))
    assert written > SQUARE_BYTES, f"the written-out GIST peaked at only {written / 2**20:.0f} MiB"


@pytest.mark.parametrize("backend", [b for b in backends_under_test() if b in ("torch", "cpp")])
@pytest.mark.parametrize("loss", ["siglip", "clip", "gist"])
def test_image_text_and_filtered_losses_have_no_bxn_buffer(backend, loss):
    require(backend)
    case = GIST if loss == "gist" else SIGLIP  # CLIP: the same square [B, B] logits as SigLIP
    extra = cpu_extra_peak_bytes(f"tests.ops.memory_cases:{loss}_step", dict(case, backend=backend))
    assert extra < SQUARE_BYTES / 2, f"{loss} on {backend}: extra peak {extra / 2**20:.0f} MiB"
