"""Size limits of the Triton backend (refused with a reason, never wrong), without allocating gigabytes.

The logit-tile kernels address candidate blocks with 64-bit row offsets (the TTIR check is
in ``tests/kernels/test_triton_aot.py``); the backward GEMM uses 32-bit offsets, so the plan caps
its chunks under 2**31 elements and the backend refuses anchor blocks beyond that, with a
reason (zero-stride expanded tensors stand in for the big inputs).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fastcl.kernels import plan  # noqa: E402
from fastcl.ops import _triton  # noqa: E402
from fastcl.ops.contract import TAG_ALL, LSEProblem  # noqa: E402

LIMIT = 2**31


@pytest.mark.parametrize("B, N, d", [(1, 2**24, 4096), (2**21, 2**20, 8), (4096, 2**20, 768), (8, 100, 16)])
@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_backward_chunks_stay_under_2_31_elements(B, N, d, arch):
    for elt in (2, 4):
        align = 128
        width = plan.chunk_width(B, N, d, elt, align, arch)
        assert width * d < LIMIT and B * width < LIMIT, (width, B, d)
        assert width % align == 0
        assert width >= min(N, 64)


def test_backend_refuses_anchor_blocks_of_2_31_elements():
    d = 4096
    big = torch.zeros(1, d, dtype=torch.bfloat16).expand(LIMIT // d, d)  # 2**31 elements, no memory
    cands = torch.zeros(1, d, dtype=torch.bfloat16).expand(10, d)
    tags = torch.full((10,), TAG_ALL, dtype=torch.int32)
    problem = LSEProblem(big, (cands, cands[:0]), (tags, tags[:0]))
    reasons = _triton.BACKEND.unsupported(problem)
    assert any("2**31" in r and "split the anchors" in r for r in reasons), reasons
    small = LSEProblem(big[:-1], (cands, cands[:0]), (tags, tags[:0]))
    assert not any("2**31" in r for r in _triton.BACKEND.unsupported(small))
    assert plan.size_reasons(LIMIT // d - 1, d) == [] and plan.size_reasons(LIMIT // d, d)
