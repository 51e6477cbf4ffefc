"""Triton kernels of fastcl, importable as ``fastcl.kernels`` (never as top-level ``kernels``).

Triton decides between compiled and interpreted execution when a kernel module is
imported: set ``TRITON_INTERPRET=1`` *before* importing this package to run the kernels
on CPU tensors through the interpreter.

Modules: ``_common`` (jit helpers, keyword launches, recording), ``plan`` (tile tables,
splits, chunks, scratch buffers), ``lse_fwd`` / ``lse_bwd`` (masked cosine-LSE forward / backward),
``lse_prefixes`` (Matryoshka dims: every prefix from one pass over ``d``),
``matmul`` (the backward's GEMM with epilogues), ``aot`` (ahead-of-time compile of the recorded launches for sm_80 / sm_90). The launchers are
``torch.library`` ops in the ``fastcl_triton`` namespace.
"""

from ._common import INTERPRET
from .lse_bwd import lse_backward
from .lse_fwd import lse_forward
from .lse_prefixes import lse_backward_prefixes, lse_forward_prefixes, prefix_reasons
from .plan import size_reasons

__all__ = [
    "INTERPRET",
    "lse_forward",
    "lse_backward",
    "lse_forward_prefixes",
    "lse_backward_prefixes",
    "prefix_reasons",
    "size_reasons",
]
