"""Ahead-of-time compilation of the Triton kernels for sm_80 (A100) and sm_90 (H100), no GPU needed.

Runs in a process *without* ``TRITON_INTERPRET=1`` (the interpreter replaces the kernels):

* every specialisation the launchers can produce (``fastcl.kernels.aot.all_specs``, the
  list ``launch`` checks real launches against) goes through the Triton frontend for both
  targets: a type or shape error in any flag combination fails here;
* every kernel is compiled to a cubin for both targets with its most demanding tuning
  config (largest pipelined tiles); the test fails on a compile error, on shared memory
  over the device limit (A100 163 KiB, H100 227 KiB), on a tensor-core kernel without MMA
  instructions in its PTX, or on local-memory loads/stores in the PTX; ptxas spills are
  reported as a warning (``python -m fastcl.kernels.aot`` prints the full table; the
  numbers are in docs/triton.md).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("AOT compilation needs compiled Triton: run without TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from fastcl.kernels import _common, aot  # noqa: E402
from fastcl.ops import dispatch  # noqa: E402
from fastcl.ops.contract import TAG_ALL, LSEProblem  # noqa: E402


def _tables():
    for spec in aot.representatives():
        for arch in aot.ARCHS:
            for cfg in spec.kernel.configs(arch, spec.dclass):
                yield spec, arch, cfg


def _smem_estimate(cfg: _common.Cfg) -> int:
    """Bytes of pipelined operand tiles (16-bit), the quantity that grows with a config."""
    k = cfg.kwargs
    if "BK" not in k:
        return 0
    return (k["BM"] + k["BN"]) * k["BK"] * 2 * cfg.num_stages


def _most_demanding():
    """``(spec, arch, cfg)``: per kernel and arch, the 16-bit representative's largest config."""
    out = {}
    for spec in aot.representatives():
        if spec.dclass != "16":
            continue
        for arch in aot.ARCHS:
            cfg = max(spec.kernel.configs(arch, spec.dclass), key=_smem_estimate)
            out[(spec.kernel_name, arch)] = (spec, arch, cfg)
    return list(out.values())


def test_block_sizes_are_multiples_of_16():
    for spec, arch, cfg in _tables():
        for name, value in cfg.kwargs.items():
            if name.startswith("B") and name != "BR":
                assert value % 16 == 0, f"{spec.kernel_name} {arch} {cfg}: {name}={value}"


@pytest.mark.parametrize("arch", aot.ARCHS)
def test_every_specialisation_passes_the_frontend(arch):
    specs = aot.all_specs()
    assert len({s.key for s in specs}) == len(specs)
    errors = [r for r in (aot.compile_one(s, arch, s.kernel.configs(arch, s.dclass)[0], frontend_only=True)
                          for s in specs) if r.error]
    assert not errors, "\n".join(f"{r.spec}: {r.error}" for r in errors)


@pytest.mark.parametrize("spec, arch, cfg", _most_demanding(), ids=lambda x: getattr(x, "kernel_name", str(x)))
def test_kernel_compiles_for_target(spec, arch, cfg):
    r = aot.compile_one(spec, arch, cfg)
    assert not r.error, r.error
    assert r.shared <= r.shared_limit, f"{r.shared} bytes of shared memory > {r.shared_limit}"
    if r.needs_mma:
        assert r.mma, f"no tensor-core instruction ({aot.MMA_PATTERNS[arch]}) in the PTX"
    assert r.local_ptx == 0, f"{r.local_ptx} ld.local/st.local in the PTX"
    assert r.registers > 0
    if r.spill_bytes:
        warnings.warn(f"{r.kernel} {arch} {r.config}: ptxas spills {r.spill_bytes} bytes", stacklevel=1)
    print(f"\n{r.kernel} {arch} {r.config}: {r.registers} regs, {r.spill_bytes} B spills, "
          f"{r.shared / 1024:.1f} KiB smem, {r.mma or 'no mma'}")


def test_triton_backend_unavailable_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    why = dispatch.describe()["triton"]
    assert "no CUDA device" in why and "TRITON_INTERPRET" in why
    a = torch.randn(3, 4)
    problem = LSEProblem(a, (a, a[:0]), (torch.full((3,), TAG_ALL, dtype=torch.int32),
                                           torch.empty(0, dtype=torch.int32)))
    with pytest.raises(dispatch.BackendUnavailableError, match="no CUDA device"):
        dispatch.choose(problem, backend="triton")
    assert dispatch.choose(problem).name != "triton"  # never chosen for CPU tensors
