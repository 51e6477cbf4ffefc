"""The ``"cuda"`` backend where no GPU is needed: every ``csrc/cuda/*.cu`` compiles with
nvcc for sm_80 and sm_90 without errors, local-memory spills or stack frames, within the
static shared-memory limit; the torch glue passes a C++ syntax check; without a device the
backend says why. With a GPU (``FASTCL_TEST_DEVICE=cuda``) the same backend matrix as
``cpp`` runs it (tests/ops/test_backend_matrix.py with ``FASTCL_TEST_BACKENDS=cuda``) and
:func:`test_cuda_matches_torch_backend` below compares it with the torch backend.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fastcl.ops import _build, _cuda, dispatch
from fastcl.ops._torch_impl import TorchLSE
from fastcl.ops.contract import LSEProblem, OwnPositives, poison_outputs
from fastcl.ops.head import HeadInputs, reduction_weights

CSRC = _build.csrc_dir()
CU_FILES = sorted(p.name for p in (CSRC / "cuda").glob("*.cu"))
ARCHS = ("sm_80", "sm_90")
STATIC_SMEM_LIMIT = 48 * 1024
NVCC = shutil.which("nvcc") or (
    os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None
)

needs_nvcc = pytest.mark.skipif(NVCC is None or not os.path.exists(NVCC), reason="nvcc not found (PATH or CUDA_HOME)")


def _cuda_root() -> Path:
    """The toolkit directory (``nvcc`` may be a wrapper script elsewhere on PATH)."""
    from torch.utils.cpp_extension import CUDA_HOME

    for root in (os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_runtime.h").exists():
            return Path(root)
    return Path(NVCC).resolve().parent.parent


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``{kernel: {registers, spill_stores, spill_loads, stack, smem}}`` from ptxas output."""
    kernels: dict[str, dict[str, int]] = {}
    name = None
    for line in text.splitlines():
        m = re.search(r"Function properties for (\S+)", line) or re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = m.group(1)
            kernels.setdefault(name, {"registers": 0, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem": 0})
            continue
        if name is None:
            continue
        k = kernels[name]
        if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            k["stack"], k["spill_stores"], k["spill_loads"] = map(int, m.groups())
        if m := re.search(r"Used (\d+) registers", line):
            k["registers"] = int(m.group(1))
        if m := re.search(r"(\d+) bytes smem", line):
            k["smem"] = int(m.group(1))
    return kernels


def nvcc_cubin(source: str, arch: str, out_dir: Path) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [
        NVCC,
        "-std=c++17",
        "-O3",
        f"-arch={arch}",
        "--cubin",
        "--resource-usage",
        "-Xptxas",
        "-warn-spills,-warn-lmem-usage",
        "-I",
        str(CSRC),
        "-o",
        str(out_dir / f"{Path(source).stem}.{arch}.cubin"),
        str(CSRC / "cuda" / source),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return out, parse_resource_usage(out.stdout + out.stderr)


def test_every_cu_file_is_tested():
    assert set(CU_FILES) == {"lse_rows.cu", "lse_forward_tc.cu"}, "new .cu files: list their kernels below"


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", CU_FILES)
def test_cu_compiles_without_spills(source, arch, tmp_path):
    out, kernels = nvcc_cubin(source, arch, tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "error" not in log.lower(), log[-4000:]
    assert "spill" not in "\n".join(l for l in log.splitlines() if "warning" in l.lower()), log[-4000:]
    assert kernels, f"no kernels in ptxas output:\n{log[-2000:]}"
    for name, k in kernels.items():
        assert k["spill_stores"] == 0 and k["spill_loads"] == 0, f"{name} spills on {arch}: {k}"
        assert k["stack"] == 0, f"{name} uses local memory (stack frame) on {arch}: {k}"
        assert k["smem"] <= STATIC_SMEM_LIMIT, f"{name}: {k['smem']} bytes static shared memory on {arch}"
        assert 0 < k["registers"] <= 255, f"{name}: {k}"
    if "tc" in source:  # the tensor-core kernel really issues tensor-core MMAs
        ptx = tmp_path / f"{Path(source).stem}.{arch}.ptx"
        out = subprocess.run(
            [
                NVCC,
                "-std=c++17",
                "-O3",
                f"-arch={arch}",
                "--ptx",
                "-I",
                str(CSRC),
                "-o",
                str(ptx),
                str(CSRC / "cuda" / source),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        text = ptx.read_text()
        assert "wmma.mma.sync" in text and ".bf16" in text and ".f16" in text, f"no bf16/f16 wmma in {source}"


@needs_nvcc
def test_torch_glue_passes_a_syntax_check(tmp_path):
    """lse_cuda.cpp against this torch's headers (a CPU torch lacks one generated header,
    ``c10/cuda/impl/cuda_cmake_macros.h``, which only sets a macro: stubbed here)."""
    from torch.utils.cpp_extension import include_paths

    cuda_include = _cuda_root() / "include"
    torch_include = Path(include_paths()[0])
    if not (torch_include / "c10" / "cuda" / "CUDAGuard.h").exists() or not (cuda_include / "cuda_runtime.h").exists():
        pytest.skip("torch's c10/cuda headers or the CUDA runtime headers are missing")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    if not (torch_include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cxx = os.environ.get("CXX", "c++")
    cmd = [
        cxx,
        "-std=c++17",
        "-fsyntax-only",
        f"-I{tmp_path}",
        *(f"-I{p}" for p in include_paths()),
        f"-I{cuda_include}",
        f"-I{CSRC}",
        str(CSRC / "cuda" / "lse_cuda.cpp"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]


def test_unavailable_reason_without_a_device():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    why = dispatch.describe()["cuda"]
    assert why != "available" and "CUDA" in why
    assert _cuda.EXTENSION is None  # nothing was built, or tried


def test_parse_resource_usage():
    text = """ptxas info    : Compiling entry function '_Z1kv' for 'sm_80'
ptxas info    : Function properties for _Z1kv
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 36608 bytes smem, 440 bytes cmem[0]"""
    assert parse_resource_usage(text) == {
        "_Z1kv": {"registers": 255, "spill_stores": 4, "spill_loads": 4, "stack": 8, "smem": 36608}
    }


# ----------------------------------------------------------------- on a GPU only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fold", [False, True])
def test_cuda_matches_torch_backend(dtype, fold):
    from tests.helpers.backends import require

    require("cuda")
    g = torch.Generator().manual_seed(0)
    B, P, N1, d = 67, 2, 133, 40
    N0 = B * P + 9
    a, b0, b1 = (torch.randn(n, d, generator=g).to(dtype) for n in (B, N0, N1))
    t0 = torch.randint(-2, B, (N0,), generator=g, dtype=torch.int32)
    t1 = torch.where(torch.rand(N1, generator=g) < 0.2, -2, -1).to(torch.int32)
    pos = torch.randn(B, P, generator=g)
    mask = torch.rand(B, P, generator=g) > 0.3
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    head = HeadInputs("supmpn", pos.to(cd), mask, None, reduction_weights(mask.any(1), "mean", cd))
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    positives = OwnPositives(9, P) if fold else None
    results = []
    for dev, impl in (("cpu", TorchLSE()), ("cuda", _cuda.CudaLSE())):
        prob = LSEProblem(a.to(dev), (b0.to(dev), b1.to(dev)), (t0.to(dev), t1.to(dev)), positives=positives)
        h = HeadInputs(head.kind, head.pos_logits.to(dev), head.pos_mask.to(dev), None, head.weights.to(dev))
        tau = torch.tensor(0.07, device=dev)
        with poison_outputs():
            fused = impl.fused(prob, tau, h)
            lse, ml = impl.forward(prob, tau)
            back = impl.backward(
                prob,
                tau,
                lse,
                torch.linspace(-1, 1, B, device=dev, dtype=cd),
                torch.ones(B, P, device=dev, dtype=cd) if fold else None,
            )
        results.append((fused, lse, ml, back))
    (f_ref, lse_ref, ml_ref, b_ref), (f, lse, ml, b) = results
    close = lambda x, y: torch.testing.assert_close(x.cpu(), y, rtol=tol, atol=tol)  # noqa: E731
    for name in ("lse", "mean_logit", "loss_rows", "d_pos", "d_anchor", "g_dot_mean_logit"):
        close(getattr(f, name), getattr(f_ref, name))
    for x, y in zip(f.d_blocks, f_ref.d_blocks):
        close(x, y)
    close(lse, lse_ref)
    close(ml, ml_ref)
    close(b[0], b_ref[0])
    for x, y in zip(b[1], b_ref[1]):
        close(x, y)
