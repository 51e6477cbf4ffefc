"""Kept for test modules written before the tolerances moved into the package: the one
table is ``fastcl.testing`` (shared with the benchmark's correctness check)."""

from fastcl.testing import *  # noqa: F401,F403
