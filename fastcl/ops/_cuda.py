"""The ``"cuda"`` backend: the masked-LSE primitive in CUDA, independent of Triton.

Sources: ``csrc/cuda/lse_cuda.cpp`` (torch glue, ``TORCH_LIBRARY_IMPL(fastcl, CUDA)``),
``csrc/cuda/lse_rows.cu`` (row kernels: LSE, head, gradient weights, own-positive fold,
normalisation backward) and ``csrc/cuda/lse_forward_tc.cu`` (WMMA tensor-core forward for
float16/bfloat16). The op schemas are those of the ``cpp`` backend's library
(``csrc/registration.cpp``), which is built first; this library only adds CUDA kernels to
the same ops, so :class:`CudaLSE` is :class:`~fastcl.ops._cpp.CppLSE` on CUDA tensors.

Built lazily with ninja/nvcc through ``torch.utils.cpp_extension`` the first time the
backend is asked whether it is available, and only when a CUDA device exists; the build
is cached per source hash, torch/CUDA version and GPU architecture (``fastcl.ops._build``).
"""

from __future__ import annotations

import torch

from . import _cpp
from ._build import Extension
from .contract import LSEProblem

DTYPES = _cpp.DTYPES


def _arch_list() -> str:
    """The GPU architectures to build for: ``TORCH_CUDA_ARCH_LIST`` or the visible devices'."""
    import os

    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{a}.{b}" for a, b in caps)


def _extension() -> Extension:
    return Extension(
        name="fastcl_cuda",
        sources=["cuda/lse_cuda.cpp", "cuda/lse_rows.cu", "cuda/lse_forward_tc.cu"],
        cflags=["-O3"],
        cuda_cflags=["-O3", "-std=c++17", "-lineinfo"],
        describe="CUDA",
        key_extra=_arch_list(),
    )


EXTENSION: Extension | None = None  # made on first use: the key needs the device list


def no_device_reason() -> str | None:
    """Why no CUDA device can be used from this torch, or None."""
    if torch.version.cuda is None:
        return f"the CUDA backend needs a CUDA build of torch (this is {torch.__version__}, CPU only)"
    if not torch.cuda.is_available():
        return "the CUDA backend needs a CUDA device (torch.cuda.is_available() is False)"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "the CUDA backend is compiled with nvcc, which was not found (set CUDA_HOME)"
    return None


def unavailable() -> str | None:
    """Why the ``cuda`` backend cannot run here (builds it on the first call), or None."""
    global EXTENSION
    why = no_device_reason()
    if why:
        return why
    why = _cpp.unavailable()  # the op schemas live in the C++ library
    if why:
        return f"the CUDA backend registers its kernels on the C++ library's ops, which is unavailable: {why}"
    if EXTENSION is None:
        EXTENSION = _extension()
    return EXTENSION.error()


class CudaLSE(_cpp.CppLSE):
    """The ``"cuda"`` implementation: the same ops and outputs as ``cpp``, on CUDA tensors."""

    name = "cuda"

    def unsupported(self, problem: LSEProblem) -> list[str]:
        why = []
        tensors = (problem.anchor, *problem.blocks, *problem.tags)
        if any(t.device.type != "cuda" for t in tensors):
            why.append(f"the cuda backend runs on CUDA tensors only, got {problem.device}")
        elif problem.dtype in (torch.float16, torch.bfloat16) and torch.cuda.get_device_capability(problem.device) < (8, 0):
            why.append("the cuda backend's 16-bit tensor-core path needs sm_80 or newer")
        if problem.dtype not in DTYPES:
            why.append(f"the cuda backend takes float32/float64/bfloat16/float16, got {problem.dtype}")
        if any(t.dtype != torch.int32 for t in problem.tags):
            why.append("the cuda backend takes int32 tags")
        return why


OPS = {"lse": CudaLSE()}
