"""Ahead-of-time compilation of the Triton kernels for sm_80 (A100) and sm_90 (H100), no GPU needed.

Runs in a process *without* ``TRITON_INTERPRET=1`` (the interpreter replaces the kernels):

* every launch the launchers make (``fastcl.kernels.aot.all_launches``: recorded from dry
  runs of the launchers) goes through the Triton frontend for both targets: a type or
  shape error in any flag combination fails here; its row offsets are 64-bit;
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

from fastcl.kernels import aot  # noqa: E402
from fastcl.ops import dispatch  # noqa: E402
from fastcl.ops.contract import TAG_ALL, LSEProblem  # noqa: E402

LAUNCHES = aot.all_launches()


def _tables():
    for launch in aot.representatives(LAUNCHES):
        for arch in aot.ARCHS:
            for cfg in aot.configs(launch, arch):
                yield launch, arch, cfg


def _smem_estimate(cfg) -> int:
    """Bytes of pipelined operand tiles (16-bit), the quantity that grows with a config."""
    k = cfg.kwargs
    if "BK" not in k:
        return 0
    return (k["BM"] + k["BN"]) * k["BK"] * 2 * cfg.num_stages


def _most_demanding():
    """``(spec, arch, cfg)``: per kernel and arch, the 16-bit representative's largest config."""
    out = {}
    for launch in aot.representatives(LAUNCHES):
        if launch.dclass != "16":
            continue
        for arch in aot.ARCHS:
            cfg = max(aot.configs(launch, arch), key=_smem_estimate)
            out[(launch.kernel, arch)] = (launch, arch, cfg)
    return list(out.values())


def test_block_sizes_are_multiples_of_16():
    for launch, arch, cfg in _tables():
        for name, value in cfg.kwargs.items():
            if name.startswith("B") and name != "BR":
                assert value % 16 == 0, f"{launch.kernel} {arch} {cfg}: {name}={value}"


def test_recorded_launches_cover_every_flag():
    """The dry runs reach every constexpr value the launchers can set (both values of each
    flag of the LSE kernels, every dtype), so the AOT list is complete."""
    assert len({x.key for x in LAUNCHES}) == len(LAUNCHES)
    seen: dict[tuple[str, str], set] = {}
    for launch in LAUNCHES:
        for name, value in launch.constexprs:
            seen.setdefault((launch.kernel, name), set()).add(value)
    for (kernel, name), values in seen.items():
        if name != "PRECISION":
            assert values == {True, False}, f"{kernel}.{name} only {values}"
    assert {x.dclass for x in LAUNCHES if x.kernel == "_lse_fwd_kernel"} == {"16", "32", "64"}
    assert {dict(x.signature)["A"] for x in LAUNCHES if x.kernel == "_lse_fwd_kernel"} == {
        "*bf16",
        "*fp16",
        "*fp32",
        "*fp64",
    }


@pytest.mark.parametrize("arch", aot.ARCHS)
def test_every_launch_passes_the_frontend(arch):
    errors = [
        r for r in (aot.compile_one(x, arch, aot.configs(x, arch)[0], frontend_only=True) for x in LAUNCHES) if r.error
    ]
    assert not errors, "\n".join(f"{r.spec}: {r.error}" for r in errors)


# The kernels that address whole candidate blocks; the backward GEMM sees bounded chunks
# (tests/kernels/test_triton_limits.py checks the bounds).
ROW_STRIDE_KERNELS = (
    "_row_norms_kernel",
    "_own_logits_kernel",
    "_lse_fwd_kernel",
    "_lse_ds_kernel",
    "_prefix_norms_kernel",
    "_prefix_fwd_kernel",
    "_prefix_ds_kernel",
)


def test_row_offsets_are_64_bit():
    """Row index x stride is computed in int64 (a block with N * d >= 2**31 elements must not
    wrap around): no int32 tensor multiply is left in the kernels that address blocks."""
    for launch in aot.representatives(LAUNCHES):
        if launch.kernel not in ROW_STRIDE_KERNELS:
            continue
        ir = aot.ttir(launch, "sm90")
        muls = [line.strip() for line in ir.splitlines() if "arith.muli" in line]
        wide = [m for m in muls if "xi64>" in m]
        narrow = [m for m in muls if "xi32>" in m]
        assert wide, f"{launch.kernel}: no 64-bit offset arithmetic"
        assert not narrow, f"{launch.kernel}: 32-bit tensor multiplies {narrow[:3]}"


@pytest.mark.parametrize("aligned", [False, True], ids=["any-sizes", "x16-sizes"])
@pytest.mark.parametrize("launch, arch, cfg", _most_demanding(), ids=lambda x: getattr(x, "kernel", str(x)))
def test_kernel_compiles_for_target(launch, arch, cfg, aligned):
    """Both specialisations Triton makes at run time: sizes of any value (the most registers)
    and multiples of 16 (d = 768: pipelined loads, the most shared memory; with sizes of any
    value the loads stay single-buffered and the shared-memory check would prove nothing)."""
    r = aot.compile_one(launch, arch, cfg, aligned=aligned)
    assert not r.error, r.error
    assert r.shared <= r.shared_limit, f"{r.shared} bytes of shared memory > {r.shared_limit}"
    if r.needs_mma:
        assert r.mma, f"no tensor-core instruction ({aot.MMA_PATTERNS[arch]}) in the PTX"
    assert r.local_ptx == 0, f"{r.local_ptx} ld.local/st.local in the PTX"
    assert r.registers > 0
    if r.spill_bytes:
        warnings.warn(
            f"{r.kernel} {arch} {r.config} aligned={aligned}: ptxas spills {r.spill_bytes} bytes", stacklevel=1
        )
    print(
        f"\n{r.kernel} {arch} {r.config} aligned={aligned}: {r.registers} regs, {r.spill_bytes} B spills, "
        f"{r.shared / 1024:.1f} KiB smem, {r.mma or 'no mma'}"
    )


def test_triton_backend_unavailable_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    why = dispatch.describe()["triton"]
    assert "no CUDA device" in why and "TRITON_INTERPRET" in why
    a = torch.randn(3, 4)
    problem = LSEProblem(
        a, (a, a[:0]), (torch.full((3,), TAG_ALL, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
    )
    with pytest.raises(dispatch.BackendUnavailableError, match="no CUDA device"):
        dispatch.choose(problem, backend="triton")
    assert dispatch.choose(problem).name != "triton"  # never chosen for CPU tensors
