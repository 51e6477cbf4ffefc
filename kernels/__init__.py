"""Triton kernels of fastcl, importable as ``fastcl.kernels`` (never as top-level ``kernels``).

Set ``TRITON_INTERPRET=1`` *before* importing this package to run the kernels on CPU tensors
through the interpreter. Modules and launchers (``torch.library`` ops in the ``fastcl_triton``
namespace): docs/triton.md.
"""

from ._common import INTERPRET
from .lse_bwd import lse_backward
from .lse_fwd import lse_forward
from .lse_prefixes import lse_backward_prefixes, lse_forward_prefixes, prefix_reasons
from .own_logits import own_logits
from .plan import size_reasons

__all__ = [
    "INTERPRET",
    "lse_forward",
    "lse_backward",
    "own_logits",
    "lse_forward_prefixes",
    "lse_backward_prefixes",
    "prefix_reasons",
    "size_reasons",
]
