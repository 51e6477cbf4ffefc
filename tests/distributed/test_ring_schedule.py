"""The ring's schedule, pieces and their knob, in one process (no group needed)."""

from __future__ import annotations

import pytest
import torch

from fastcl import config
from fastcl.ops import ring_comm


def test_schedule_visits_own_payload_then_every_piece_of_every_other_rank():
    assert ring_comm.schedule(1, 3) == [(0, None)]
    assert ring_comm.schedule(3, 2) == [(0, None), (1, 0), (2, 0), (1, 1), (2, 1)]


def test_pieces_split_every_tensor_alike_and_cover_it():
    g = torch.Generator().manual_seed(0)
    block, tags, count = torch.randn(7, 4, generator=g), torch.arange(7), torch.tensor([5])
    pieces = ring_comm.split([block, tags, count], 3)
    assert [p[0].shape[0] for p in pieces] == [3, 2, 2]  # piece 0 is the largest (receive buffers)
    assert [p[2].numel() for p in pieces] == [1, 0, 0]  # a one-row tensor travels with piece 0 only
    assert all(p[0].is_contiguous() for p in pieces)
    assert torch.equal(torch.cat([p[0] for p in pieces]), block)
    assert torch.equal(torch.cat([p[1] for p in pieces]), tags)


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_bad_piece_count_is_refused(monkeypatch, raw):
    monkeypatch.setenv("FASTCL_RING_PIECES", raw)
    try:
        with pytest.raises(ValueError, match="FASTCL_RING_PIECES"):
            config.reload()
    finally:
        monkeypatch.undo()
        config.reload()


def test_piece_count_default_and_override():
    assert config.Config().ring_pieces == 2
    with config.override(ring_pieces=5):
        assert config.get().ring_pieces == 5
