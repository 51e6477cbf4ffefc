"""Point-to-point plumbing of ``cross_device="ring"``: blocks pass rank to rank.

Every rank sends to ``rank + 1`` and receives from ``rank - 1`` (mod ``W``) with
``torch.distributed.batch_isend_irecv``; the block that arrives at step ``t`` is the one rank
``rank - t`` owns. Two passes drive a caller's per-block work:

* :func:`circulate` (forward): step ``t`` posts the transfer of the block held now to the
  next rank and the receive of the next block, runs ``visit`` on the block held now, then
  waits; the transfer overlaps the work. ``W`` visits, ``W - 1`` hops.
* :func:`circulate_grads` (backward): the same tour, and each block's gradient accumulator
  follows it: at step ``t`` a rank adds its ``contribute``-ion for the block it holds to the
  accumulator that arrived with it (sent by the previous rank after its own work, so that
  transfer overlaps this rank's work too) and passes it on; after ``W`` hops every
  accumulator is back at its owner. ``W - 1`` block hops, ``W`` accumulator hops.

A rank holds at most two blocks (the one worked on and the one arriving) and, in backward,
two accumulators and one contribution: constant in ``W``.

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

from .. import distributed

_REASON_BYTES = 480  # one rank's status row: 1 flag byte + the start of its error message
_TAG_BLOCK, _TAG_GRAD = 0, 16  # message tags: block pieces 0.., gradient accumulators 16..


class RingFailure(RuntimeError):
    """Another rank failed during a ring pass; the message names it and its error."""


class RingComm:
    """This rank's place in the ring of ``group``: neighbours, transfers and the status check.

    ``sent_bytes`` counts the bytes this rank has sent point-to-point (for benchmarks)."""

    def __init__(self, group) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self.sent_bytes = 0

    def source(self, step: int) -> int:
        """The rank (in the group) whose block this rank holds at ``step``."""
        return (self.rank - step) % self.world

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


def circulate(comm: RingComm, own: Sequence[Tensor], visit: Callable[[int, list[Tensor]], None]):
    """Forward pass: ``visit(source, payload)`` for this rank's ``own`` payload (a list of
    contiguous tensors of the same shapes on every rank), then for each arriving one.
    Returns the exception ``visit`` raised, or None (the caller calls ``agree_on_status``)."""
    failure, cur, spare = None, list(own), None
    for step in range(comm.world):
        last = step == comm.world - 1
        if not last:
            nxt = spare or [torch.empty_like(t) for t in own]
            works = comm.exchange(cur, nxt, _TAG_BLOCK)
        if failure is None:
            try:
                visit(comm.source(step), cur)
            except Exception as exc:  # the ring goes on without work; agree_on_status reports it
                failure = exc
        if not last:
            for w in works:
                w.wait()
            spare = cur if step > 0 else None  # a received buffer is reused; own tensors never
            cur = nxt
    return failure


def circulate_grads(
    comm: RingComm,
    own: Sequence[Tensor],
    contribute: Callable[[int, list[Tensor]], list[Tensor]],
    new_grads: Callable[[], list[Tensor]],
):
    """Backward pass: ``contribute(source, payload)`` returns this rank's gradient for the
    block it holds (tensors shaped like those of ``new_grads()``, a factory of uninitialised
    accumulators); the contributions of every rank for one block add up on their way home.
    Returns ``(grads of own, failure)``: the summed gradients of this rank's ``own`` payload."""
    world = comm.world
    failure, cur, spare = None, list(own), None
    acc: list[Tensor] | None = None
    acc_in: list[Tensor] | None = None
    acc_works: list = []
    for step in range(world):
        last = step == world - 1
        if not last:
            nxt = spare or [torch.empty_like(t) for t in own]
            works = comm.exchange(cur, nxt, _TAG_BLOCK)
        part = None
        if failure is None:
            try:
                part = [p.contiguous() for p in contribute(comm.source(step), cur)]
            except Exception as exc:  # the ring goes on without work; agree_on_status reports it
                failure = exc
        if part is None:
            part = [t.zero_() for t in new_grads()]
        if step == 0:
            acc, free = part, None
        else:  # the accumulator of this block, from the previous rank
            for w in acc_works:
                w.wait()
            assert acc_in is not None  # received in the previous step
            for a, p in zip(acc_in, part, strict=True):
                a.add_(p)
            acc, free = acc_in, acc  # the one sent last step is free again
        part = None  # not alive during the next step's work
        if world > 1:
            acc_in = free or new_grads()
            assert acc is not None
            acc_works = comm.exchange(acc, acc_in, _TAG_GRAD)
        if not last:
            for w in works:
                w.wait()
            spare = cur if step > 0 else None
            cur = nxt
    for w in acc_works:
        w.wait()
    return (acc if world == 1 else acc_in), failure
