"""C++ sources of fastcl (``fastcl._csrc``), compiled lazily with ninja on first use.

This file only exists so that the sources ship with the package; see ``fastcl.ops._cpp``.
"""
