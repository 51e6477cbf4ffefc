"""Ahead-of-time compilation of the Triton kernels for sm_80 (A100) and sm_90 (H100), no GPU needed.

Runs in a process *without* ``TRITON_INTERPRET=1`` (the interpreter replaces the kernels):

* every launch the launchers make when planning for each arch (``benchmarks.triton_tools.aot.dry_runs``)
  goes through the Triton frontend with the config the table gives it: a type or shape
  error in any flag combination fails here; the kernels that address whole blocks use 64-bit
  row offsets;
* one launch per (kernel, dtype class, config), the one with the most code, is compiled to a
  cubin for both targets and both run-time specialisations (row counts multiples of 16 or
  not; ``d`` a multiple of 16 in both), and must have: no compile error, no ptxas spills and
  no local memory, shared memory within the device limit and multi-buffered operand tiles
  where the config pipelines, the registers and shared memory for the CTAs per SM its
  persistent grid is sized for, and tensor-core instructions (``wgmma`` for the 16-bit tile
  kernels on sm_90);
* the same for the 16-bit kernels with the Triton version the GPU machines have (3.6; a
  second install made by ``scripts/setup.sh``), in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("AOT compilation needs compiled Triton: run without TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from benchmarks.triton_tools import aot  # noqa: E402
from fastcl.kernels import configs  # noqa: E402
from fastcl.ops import dispatch  # noqa: E402
from fastcl.ops.contract import TAG_ALL, LSEProblem  # noqa: E402

LAUNCHES = {arch: aot.dry_runs(arch) for arch in aot.ARCHS}
ROOT = Path(__file__).resolve().parents[2]
GPU_TRITON = ROOT / ".venv" / "triton-3.6"  # scripts/setup.sh installs the GPU machines' Triton here


def test_block_sizes_are_powers_of_two_of_at_least_16():
    for role, by_arch in configs.DEFAULTS.items():
        for arch, by_class in by_arch.items():
            for dclass, entry in by_class.items():
                for cfg in entry.values() if isinstance(entry, dict) else (entry,):
                    for name, value in cfg.kwargs.items():
                        if name != "GROUP_M":
                            assert value >= 16 and value & (value - 1) == 0, f"{role} {arch} {dclass}: {name}={value}"


@pytest.mark.parametrize("arch", aot.ARCHS)
def test_recorded_launches_cover_every_flag(arch):
    """The dry runs reach both values of every boolean flag of every kernel (and every dtype),
    so the compile list is complete."""
    launches = LAUNCHES[arch]
    seen: dict[tuple[str, str], set] = {}
    for launch in launches:
        for name, value in launch.constexprs:
            seen.setdefault((launch.kernel, name), set()).add(value)
    always = {("_head_kernel", "HEAD")}  # fixed per call site, both recorded below
    for (kernel, name), values in seen.items():
        if isinstance(next(iter(values)), bool) and (kernel, name) not in always:
            assert values == {True, False}, f"{kernel}.{name} only {values}"
    assert {dict(x.signature)["A"] for x in launches if x.kernel == "_lse_fwd_kernel"} == {
        "*bf16",
        "*fp16",
        "*fp32",
        "*fp64",
    }
    assert seen[("_head_kernel", "HEAD")] == {True, False}
    assert seen[("_lse_ds_kernel", "GO_MODE")] == {0, 1, 2}
    assert seen[("_mm_kernel", "RADIAL_SCALE")] == {0, 1, 2}
    # the primitive's extensions: every sweep, plain and Matryoshka, with no filter, a self and a
    # guide filter, and the sigmoid reduction; the row pass's clean copies and the head's poison
    # (bool flags above)
    for kernel in ("_lse_fwd_kernel", "_lse_ds_kernel"):
        for prefixes in (False, True):
            flags = [dict(x.constexprs) for x in launches if x.kernel == kernel]
            flags = [f for f in flags if f["PREFIXES"] == prefixes]
            assert {f["FILTER"] for f in flags} == {0, 1, 2}, (kernel, prefixes)
            assert {f["SIGMOID"] for f in flags} == {True, False}, (kernel, prefixes)
    assert seen[("_row_norms_kernel", "CLEAN")] == {True, False}
    assert seen[("_head_kernel", "POISONED")] == {True, False} and seen[("_head_kernel", "SIGMOID")] == {True, False}
    forms = {aot.extension(x) for x in launches if x.kernel == "_lse_fwd_kernel"}
    assert forms == {"plain", "SIGMOID=True", "FILTER=1", "FILTER=1 SIGMOID=True", "FILTER=2", "FILTER=2 SIGMOID=True"}


@pytest.mark.parametrize("arch", aot.ARCHS)
def test_every_launch_passes_the_frontend(arch):
    errors = [r for r in (aot.compile_one(x, arch, frontend_only=True) for x in LAUNCHES[arch]) if r.error]
    assert not errors, "\n".join(f"{r.spec}: {r.error}" for r in errors)


# The kernels that address whole candidate blocks; the backward GEMM sees bounded chunks
# (tests/kernels/test_triton_limits.py checks the bounds).
ROW_STRIDE_KERNELS = (
    "_row_norms_kernel",
    "_head_kernel",
    "_lse_fwd_kernel",
    "_lse_ds_kernel",
)


def test_row_offsets_are_64_bit():
    """Row index x stride is computed in int64 (a block with N * d >= 2**31 elements must not
    wrap around): no int32 tensor multiply is left in the kernels that address blocks."""
    for launch in aot.representatives(LAUNCHES["sm90"]):
        if launch.kernel not in ROW_STRIDE_KERNELS:
            continue
        ir = aot.ttir(launch, "sm90")
        muls = [line.strip() for line in ir.splitlines() if "arith.muli" in line and "tensor<" in line]
        wide = [m for m in muls if "xi64>" in m]
        narrow = [m for m in muls if "xi32>" in m]
        assert wide or not muls, f"{launch.kernel}: no 64-bit offset arithmetic"
        assert not narrow, f"{launch.kernel}: 32-bit tensor multiplies {narrow[:3]}"


def _full_compiles():
    """``(launch, arch, aligned)``: the plain forms with odd and multiple-of-16 rows; the
    extensions' forms (filters, sigmoid: epilogues of the same main loops, whose pipelining
    the plain forms prove) with odd rows only, the predicated loads that cost the most
    registers, where a spill would show (half the compiles: CI's time budget)."""
    out = []
    for arch in aot.ARCHS:
        for x in aot.representatives(LAUNCHES[arch]):
            plain = aot.extension(x) == "plain"
            out += [(x, arch, False)] + ([(x, arch, True)] if plain else [])
    return out


PIPELINED = ("_lse_fwd_kernel", "_lse_ds_kernel", "_mm_kernel")


def check_facts(r: aot.Result) -> list[str]:
    """What is wrong with one fully compiled launch (empty: nothing)."""
    bad = []
    if r.error:
        return [r.error]
    if r.spill_bytes != 0:
        bad.append(f"ptxas spills {r.spill_bytes} bytes")
    if r.local_ptx != 0:
        bad.append(f"{r.local_ptx} ld.local/st.local in the PTX")
    if r.shared > r.shared_limit:
        bad.append(f"{r.shared} bytes of shared memory > {r.shared_limit}")
    if r.ctas_per_sm < r.occupancy:
        bad.append(
            f"{r.registers} registers x {r.num_warps} warps, {r.shared} B smem: {r.ctas_per_sm} CTAs/SM < {r.occupancy}"
        )
    if r.needs_mma and not r.mma:
        bad.append(f"no tensor-core instruction ({aot.MMA_PATTERNS[r.arch]}) in the PTX")
    pointers = r.spec.split()[1]
    sixteen = "bf16" in pointers or "fp16" in pointers
    if r.needs_mma and r.arch == "sm90" and sixteen and r.mma != "wgmma.mma_async":
        bad.append("a 16-bit tile kernel without wgmma on sm_90")
    # the plain sweeps and the GEMM pipeline their loads; single-buffered by design or by
    # the compiler (docs/triton.md, "Compile facts"): the sweeps' Matryoshka segment loops,
    # fp64, a GEMM that rescales its Y rows in registers, and on sm_80 the candidates' GEMM
    # (its transposed dS operand) and the anchors' GEMM over padded candidates
    single = "Y_KSCALE=True" in r.spec or "PREFIXES=True" in r.spec or "fp64" in pointers
    if r.arch == "sm80" and r.kernel == "_mm_kernel" and ("X_T=True" in r.spec or "PAD_K=True" in r.spec):
        single = True
    if r.aligned and r.kernel in PIPELINED and not single and r.num_stages >= 2 and r.buffers < 2:
        bad.append(f"operand tiles not multi-buffered ({r.buffers:.1f} stages in shared memory)")
    return bad


@pytest.mark.parametrize(
    "launch, arch, aligned",
    _full_compiles(),
    ids=lambda x: getattr(x, "kernel", {True: "x16-rows", False: "odd-rows"}.get(x, str(x))),
)
def test_kernel_compiles_for_target(launch, arch, aligned):
    r = aot.compile_one(launch, arch, aligned=aligned)
    print(
        f"\n{r.kernel} {r.spec} {arch} {r.config} aligned={aligned}: {r.registers} regs, {r.spill_bytes} B spills, "
        f"{r.shared / 1024:.1f} KiB smem ({r.buffers:.1f} stages), {r.ctas_per_sm} CTAs/SM, {r.mma or 'no mma'}"
    )
    bad = check_facts(r)
    assert not bad, f"{r.kernel} {r.spec} {arch} {r.config}: " + "; ".join(bad)


def test_kernels_compile_with_the_gpu_machines_triton(tmp_path):
    """The 16-bit kernels (the benchmark's) with Triton 3.6, as the lent H100/H200 run them."""
    if not (GPU_TRITON / "triton").is_dir():
        pytest.fail(f"Triton 3.6 is not installed in {GPU_TRITON}: run scripts/setup.sh")
    out = tmp_path / "aot36.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(GPU_TRITON), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.triton_tools.aot",
        "--dtypes",
        "bfloat16",
        "--jobs",
        "2",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    results = json.loads(out.read_text()) if out.is_file() else []
    assert results, done.stderr[-3000:]
    assert {r["triton"] for r in results} == {"3.6.0"}
    fields = set(aot.Result.__dataclass_fields__)
    bad = {}
    for r in results:
        res = aot.Result(**{k: v for k, v in r.items() if k in fields})
        if res.registers >= 0 or res.error:
            problems = check_facts(res)
            if problems:
                bad[f"{res.kernel} {res.arch} {res.config} aligned={res.aligned}"] = problems
    assert not bad, bad
    print(f"\nTriton 3.6: {sum(r['registers'] >= 0 for r in results)} kernels compiled, all clean")


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
