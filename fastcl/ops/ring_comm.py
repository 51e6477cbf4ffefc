"""Point-to-point plumbing of ``cross_device="ring"``: blocks pass rank to rank, in pieces.

Every rank sends to ``rank + 1`` and receives from ``rank - 1`` (mod ``W``) with
``torch.distributed.batch_isend_irecv``. A rank's *payload* (its candidate block, tags, ...)
is a list of tensors; for the trip it is cut into ``pieces`` row ranges
(``torch.tensor_split`` along dim 0 of every tensor, so tensors with as many rows split
alike). A pass is one local step and then ``pieces`` rounds of ``W - 1`` hops:

* step 0: the rank works on its own payload, whole (it never travels to itself);
* round ``j``, hop ``t = 1 .. W-1``: it works on piece ``j`` of rank ``rank - t``'s payload.

While it works on one item the next one is in flight: the piece it holds goes on to the
next rank, or, at the end of a round (and during step 0), its own piece ``j + 1`` (``0``)
starts the next round. Rounds therefore chain without a gap, and a rank holds two pieces
(the one worked on and the one arriving) at any ``W >= 2``. Two passes drive a caller's work:

* :func:`circulate` (forward): ``visit(source, piece, payload)``.
* :func:`circulate_grads` (backward): the same tour; ``contribute(source, piece, payload)``
  returns this rank's gradient of what it holds. Piece ``j`` of rank ``s`` collects the
  contributions of ranks ``s + 1 .. s + W - 1`` in an accumulator that travels with it (the
  one that arrives from the previous rank during a hop is added to at the next one, so its
  transfer overlaps work too) and is added at home to the owner's own contribution.
  A rank holds two pieces, two accumulators (one leaving, one arriving) and one contribution.

Memory beyond the inputs, per rank: that many *pieces*, not blocks, whatever ``W`` is,
and a ring of two holds as much as a larger one from ``pieces = 2`` on (with whole blocks,
``pieces = 1``, nothing is in flight while a ring of two works on the other rank's block,
so it holds less than a larger ring: constant only from ``W = 3``). Traffic: ``W - 1`` hops
of every piece in each pass and ``W - 1`` of every accumulator. ``fastcl.config``'s
``ring_pieces`` (``FASTCL_RING_PIECES``, default 2) sets ``pieces``.

Failures: a ``visit``/``contribute`` that raises does not leave the ring. The rank records
the exception, does no more work and keeps forwarding what arrives, so every send and
receive of the pass is still matched (the group stays usable) and no rank waits forever;
at the end of the pass :meth:`RingComm.agree_on_status` (a small all-gather, read on the
host) makes the failed rank re-raise its own exception and every other rank raise a
``RingFailure`` naming it and its error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import config, distributed

_REASON_BYTES = 480  # one rank's status row: 1 flag byte + the start of its error message
_TAG_BLOCK, _TAG_GRAD = 0, 16  # message tags: payload tensors 0.., gradient accumulators 16..

Visit = Callable[[int, "int | None", list[Tensor]], None]
Contribute = Callable[[int, "int | None", list[Tensor]], list[Tensor]]


class RingFailure(RuntimeError):
    """Another rank failed during a ring pass; the message names it and its error."""


class RingComm:
    """This rank's place in the ring of ``group``: neighbours, piece count, transfers and the
    status check. ``sent_bytes`` counts the bytes this rank has sent point-to-point."""

    def __init__(self, group) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self.pieces = config.get().ring_pieces
        self.sent_bytes = 0

    def source(self, hop: int) -> int:
        """The rank (in the group) whose payload this rank holds ``hop`` hops from home."""
        return (self.rank - hop) % self.world

    def exchange(self, send: Sequence[Tensor], recv: Sequence[Tensor], tag: int) -> list:
        """Post ``send[k]`` to the next rank and ``recv[k]`` from the previous one (message tag
        ``tag + k``; empty tensors are skipped on both sides alike); returns the works."""
        ops = []
        for k, (s, r) in enumerate(zip(send, recv, strict=True)):
            if s.numel() == 0:
                continue
            self.sent_bytes += s.numel() * s.element_size()
            ops.append(dist.P2POp(dist.isend, s, self.next, self.group, tag + k))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + k))
        return dist.batch_isend_irecv(ops) if ops else []

    def agree_on_status(self, failure: BaseException | None, where: str) -> None:
        """End of a pass: raise on every rank if any rank failed in it (see the module docstring)."""
        row = torch.zeros(_REASON_BYTES, dtype=torch.uint8)
        if failure is not None:
            text = f"{type(failure).__name__}: {failure}".encode()[: _REASON_BYTES - 1]
            row[0] = 1
            row[1 : 1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        device = distributed.handshake_device(self.group)
        table = row.to(device).new_empty(self.world * _REASON_BYTES)
        distributed.all_gather_into(table, row.to(device), self.group)
        rows = table.view(self.world, _REASON_BYTES).cpu()
        failed = [r for r in range(self.world) if rows[r, 0]]
        if failure is not None:
            raise failure
        if failed:
            first = rows[failed[0], 1:]
            reason = bytes(first[first != 0].tolist()).decode(errors="replace")
            raise RingFailure(
                f"fastcl ring: rank(s) {failed} failed during the {where} pass (rank {failed[0]}: {reason}); "
                "every rank stops here instead of waiting"
            )


def schedule(world: int, pieces: int) -> list[tuple[int, int | None]]:
    """``(hop, piece)`` of every step of a pass: ``(0, None)`` (the own payload, whole), then
    ``(t, j)`` for ``j`` in ``0 .. pieces-1`` and ``t`` in ``1 .. world-1``."""
    return [(0, None)] + [(t, j) for j in range(pieces) for t in range(1, world)]


def split(payload: Sequence[Tensor], pieces: int) -> list[list[Tensor]]:
    """The ``pieces`` row ranges of a payload: piece ``j`` holds range ``j`` of every tensor
    (contiguous views of contiguous tensors)."""
    return [list(p) for p in zip(*(torch.tensor_split(t, pieces) for t in payload), strict=True)]


class _Buffers:
    """Receive buffers for pieces, reused: each holds the rows of the largest piece (piece 0,
    where ``tensor_split`` puts the extra rows) and lends a piece views of as many rows, so
    uneven pieces never make a buffer of their own. One spare is kept, never more: a
    second one would sit idle through the next step's work (the backward sends
    contributions, not buffers, at hop 1)."""

    def __init__(self, largest: Sequence[Tensor]) -> None:
        self.largest = list(largest)
        self.free: list[list[Tensor]] = []

    def take(self, like: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """``(buffer, views of it shaped like like)``; give the buffer back when done."""
        base = self.free.pop() if self.free else [torch.empty_like(t) for t in self.largest]
        return base, [b[: t.shape[0]] for b, t in zip(base, like, strict=True)]

    def give(self, base: list[Tensor] | None) -> None:
        if base is not None and not self.free:
            self.free.append(base)


def _tour(comm: RingComm, own: Sequence[Tensor], work: Visit) -> None:
    """Drive ``work(hop, piece, payload)`` over the :func:`schedule`, each item's work
    overlapping the transfer of the next one (two piece buffers: the one worked on and the
    one arriving)."""
    pieces = split(own, comm.pieces)
    buffers = _Buffers(pieces[0])
    steps = schedule(comm.world, comm.pieces)
    cur, cur_base = list(own), None  # own tensors are never a buffer
    for i, (hop, piece) in enumerate(steps):
        upcoming = steps[i + 1] if i + 1 < len(steps) else None
        if upcoming is not None:
            next_hop, next_piece = upcoming
            assert next_piece is not None  # only step 0 is whole
            outgoing = pieces[next_piece] if next_hop == 1 else cur  # start a round, or pass it on
            base, incoming = buffers.take(pieces[next_piece])
            works = comm.exchange(outgoing, incoming, _TAG_BLOCK)
        work(hop, piece, cur)
        if upcoming is not None:
            for w in works:
                w.wait()
            buffers.give(cur_base)
            cur, cur_base = incoming, base


def circulate(comm: RingComm, own: Sequence[Tensor], visit: Visit) -> BaseException | None:
    """Forward pass: ``visit(source, piece, payload)`` for this rank's ``own`` payload (a list
    of contiguous tensors of the same shapes on every rank; ``piece`` None: whole), then for
    every piece of every other rank's. Returns the exception ``visit`` raised, or None (the
    caller calls ``agree_on_status``)."""
    failure: BaseException | None = None

    def work(hop: int, piece: int | None, payload: list[Tensor]) -> None:
        nonlocal failure
        if failure is None:
            try:
                visit(comm.source(hop), piece, payload)
            except Exception as exc:  # the ring goes on without work; agree_on_status reports it
                failure = exc

    _tour(comm, own, work)
    return failure


def circulate_grads(
    comm: RingComm, own: Sequence[Tensor], contribute: Contribute, zeros: Callable[[], list[Tensor]]
) -> tuple[list[Tensor], BaseException | None]:
    """Backward pass: ``contribute(source, piece, payload)`` returns this rank's gradient of
    the payload (piece) it holds, tensors shaped like those of ``zeros()`` (the own payload's
    gradients, zeroed) or their row ranges; every rank's contributions to a piece add up on
    its way home. Returns ``(the summed gradients of own, failure)``."""
    failure: BaseException | None = None
    total: list[Tensor] = []
    grads: list[list[Tensor]] = []  # total's pieces: home accumulators add into them
    accs: _Buffers | None = None
    # the accumulator in flight: (works, its buffer, views, the piece if it comes home),
    # and the one whose send is among those works (a buffer, or a contribution)
    pending: tuple[list, list[Tensor], list[Tensor], int | None] | None = None
    sent: tuple[list[Tensor] | None, list[Tensor]] | None = None

    def settle() -> tuple[list[Tensor], list[Tensor]] | None:
        """Wait for the transfers in flight; add an accumulator that came home, else return it."""
        nonlocal pending, sent
        if pending is None:
            return None
        works, base, views, home = pending
        pending = None
        for w in works:
            w.wait()
        assert accs is not None and sent is not None
        accs.give(sent[0])
        sent = None
        if home is None:
            return base, views
        for t, v in zip(grads[home], views, strict=True):
            t.add_(v)
        accs.give(base)
        return None

    def work(hop: int, piece: int | None, payload: list[Tensor]) -> None:
        nonlocal failure, total, grads, accs, pending, sent
        part = None
        if failure is None:
            try:
                part = [p.contiguous() for p in contribute(comm.source(hop), piece, payload)]
            except Exception as exc:  # the ring goes on without work; agree_on_status reports it
                failure = exc
        if piece is None:  # the own payload, whole: the result
            total = part if part is not None else zeros()
            grads = split(total, comm.pieces)
            accs = _Buffers(grads[0])
            return
        assert accs is not None
        if part is None:
            part = [torch.zeros_like(t) for t in grads[piece]]
        arrived = settle()
        if arrived is None:  # hop 1: this rank is the piece's first visitor
            base, acc = None, part
        else:
            base, acc = arrived
            for a, p in zip(acc, part, strict=True):
                a.add_(p)
        part = None  # not alive during the next step's work
        in_base, incoming = accs.take(grads[piece])
        works = comm.exchange(acc, incoming, _TAG_GRAD)
        pending = (works, in_base, incoming, piece if hop == comm.world - 1 else None)
        sent = (base, acc)

    _tour(comm, own, work)
    settle()
    return total, failure
