"""The ``"cuda"`` backend, independent of Triton: ``csrc/cuda/`` adds CUDA kernels to the ops of
the ``cpp`` backend's library, so :class:`CudaLSE` is :class:`~fastcl.ops._cpp.CppLSE` on CUDA
tensors; built lazily with nvcc (docs/csrc.md).
"""

from __future__ import annotations

import os

import torch

from . import _cpp
from ._build import Extension
from .backend import input_reasons
from .contract import LSEProblem


def _arch_list() -> str:
    """The GPU architectures to build for: ``TORCH_CUDA_ARCH_LIST`` or the visible devices'."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{a}.{b}" for a, b in caps)


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


class CudaLSE(_cpp.CppLSE):
    """The ``"cuda"`` backend: the same ops and outputs as ``cpp``, on CUDA tensors."""

    name = "cuda"
    device_type = "cuda"
    forms_own_logits = False  # its lse_fused reads them (refuses own_logits=True)

    def unavailable(self) -> str | None:
        """Why the CUDA library cannot run here (builds it on the first call), or None."""
        global EXTENSION
        why = no_device_reason()
        if why:
            return why
        why = _cpp.BACKEND.unavailable()  # the op schemas live in the C++ library
        if why:
            return f"the CUDA backend registers its kernels on the C++ library's ops, which is unavailable: {why}"
        if EXTENSION is None:
            EXTENSION = Extension(
                name="fastcl_cuda",
                sources=["cuda/lse_cuda.cpp", "cuda/lse_rows.cu", "cuda/lse_forward_tc.cu"],
                cflags=["-O3"],
                cuda_cflags=["-O3", "-std=c++17", "-lineinfo"],
                describe="CUDA",
                key_extra=_arch_list(),
            )
        return EXTENSION.error()

    def unsupported(self, problem: LSEProblem) -> list[str]:
        why = input_reasons(problem, backend=self.name, device_type=self.device_type)
        sixteen_bit = problem.dtype in (torch.float16, torch.bfloat16)
        if not why and sixteen_bit and torch.cuda.get_device_capability(problem.device) < (8, 0):
            why.append("the cuda backend's 16-bit tensor-core path needs sm_80 or newer")
        return why


BACKEND = CudaLSE()
