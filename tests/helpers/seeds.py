"""Per-case seeds that change every run and come back with ``FASTCL_TEST_SEED``."""

from __future__ import annotations

import zlib

import torch


def case_seed(*key: object) -> int:
    """A seed for one parametrised case: the run's torch seed (printed in the report header,
    fixed by ``FASTCL_TEST_SEED``) mixed with a stable digest of ``key`` (``hash`` of a
    string changes per process, so a failure could not be replayed)."""
    return (torch.initial_seed() + zlib.crc32(repr(key).encode())) % 2**31
