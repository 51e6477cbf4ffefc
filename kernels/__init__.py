"""Triton kernels of fastcl, importable as ``fastcl.kernels`` (never as top-level ``kernels``).

Triton decides between compiled and interpreted execution when a kernel module is
imported: set ``TRITON_INTERPRET=1`` *before* importing this package to run the kernels
on CPU tensors through the interpreter.
"""
