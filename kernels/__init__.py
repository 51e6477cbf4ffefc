"""Triton kernels of fastcl, importable as ``fastcl.kernels`` (never as top-level ``kernels``).

Triton decides between compiled and interpreted execution when a kernel module is
imported: set ``TRITON_INTERPRET=1`` *before* importing this package to run the kernels
on CPU tensors through the interpreter.

Modules: ``_common`` (jit helpers, tuning tables, launch specs), ``lse`` (masked
cosine-LSE forward/backward), ``matmul`` (the backward's GEMM with epilogues),
``aot`` (ahead-of-time compile table for sm_80 / sm_90).
The launchers are ``torch.library`` ops in the ``fastcl_triton`` namespace.
"""

from ._common import INTERPRET
from .lse import lse_backward, lse_forward

__all__ = ["INTERPRET", "lse_forward", "lse_backward"]
