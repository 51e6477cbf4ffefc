"""Triton kernels of fastcl, importable as ``fastcl.kernels`` (never as top-level ``kernels``).

Set ``TRITON_INTERPRET=1`` *before* importing this package to run the kernels on CPU tensors
through the interpreter. Modules and launchers (``torch.library`` ops in the ``fastcl_triton``
namespace): docs/triton.md.
"""

from ._common import INTERPRET
from .head import MAX_OWN
from .lse import (
    Extensions,
    head_backward,
    head_forward,
    lse_backward,
    lse_forward,
    prefix_reasons,
)
from .plan import release_scratch, size_reasons

__all__ = [
    "INTERPRET",
    "MAX_OWN",
    "Extensions",
    "head_backward",
    "head_forward",
    "lse_backward",
    "lse_forward",
    "prefix_reasons",
    "release_scratch",
    "size_reasons",
]
