"""Run a whole loss step (forward and backward) as one CUDA graph.

A ``triton`` loss step is a few dozen kernel launches; in eager mode each costs the host
~5-30 us, which at B = 4096 is a large share of a ~3 ms step. A CUDA graph replays them
with no Python and no launch latency. fastcl's launchers are capture-safe: they read no
device value on the host, copy nothing from the host during a step, never autotune, and
take their scratch from a per-shape cache whose buffers a capture pins (docs/triton.md,
"CUDA graphs")::

    import fastcl.losses as L
    from fastcl.graphs import capture_step

    a, p, n = (x.requires_grad_() for x in (anchor, positives, negatives))  # static inputs
    step = capture_step(lambda: L.supmpn_loss(a, p, n, temperature=0.05), leaves=(a, p, n))
    for new_a, new_p, new_n in batches:
        with torch.no_grad():  # new values, same tensors
            a.copy_(new_a), p.copy_(new_p), n.copy_(new_n)
        loss = step()  # the loss, and a.grad, p.grad, n.grad, as after loss.backward()

``torch.compile(fn, mode="reduce-overhead")`` captures the same step through Inductor
(its launchers are ``torch.library.triton_op``s it can trace). Inside a training step the
embeddings come from an encoder, so the graph usually covers encoder and loss together;
the rule is the same: static shapes, static tensors, no host reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def capture_step(loss_fn: Callable[[], Tensor], leaves: Sequence[Tensor] = (), warmup: int = 3) -> Callable[[], Tensor]:
    """Capture ``loss_fn()`` and its ``backward()`` in a CUDA graph; returns a callable that
    replays both and returns the (static) loss tensor.

    ``leaves``: the tensors whose ``.grad`` the step fills (set to None before capture, so the
    graph owns the gradient buffers; after each replay they hold this step's gradients).
    ``warmup`` eager steps on a side stream first (they compile the Triton kernels and fill
    fastcl's scratch cache, as ``torch.cuda.graphs`` requires). Every tensor the step reads
    must stay the same object between replays: update inputs in place.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("capture_step needs a CUDA device (CUDA graphs)")

    def step() -> Tensor:
        loss = loss_fn()
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            for x in leaves:
                x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()

    def replay() -> Tensor:
        graph.replay()
        return static_loss

    replay.graph = graph  # keeps the graph (and its memory pool) alive with the callable
    return replay
