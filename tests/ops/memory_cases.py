"""Steps the memory tests measure in fresh processes (``benchmarks.harness.memory``): one forward +
backward of the image–text and filtered losses, fastcl's or the peer's that builds the logits."""

from __future__ import annotations

import torch


def _leaves(*shapes, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def siglip_step(backend: str, B: int, d: int):
    """``backend``: a fastcl backend, or ``"open_clip"`` (the peer: ``[B, B]`` logits)."""
    img, txt = _leaves((B, d), (B, d))
    if backend == "open_clip":
        from tests.helpers.open_clip import open_clip_loss

        peer = open_clip_loss().SigLipLoss()
        fn = lambda: peer(img, txt, torch.tensor(10.0), torch.tensor(-10.0))  # noqa: E731
    else:
        import fastcl.losses as L

        fn = lambda: L.siglip_loss(img, txt, 10.0, -10.0, backend=backend)  # noqa: E731
    return lambda: fn().backward()


def clip_step(backend: str, B: int, d: int):
    """CLIP's symmetric step (``LSEProblem.columns``: the rows' and the columns' LSEs in one
    pass) on a fastcl backend that computes column statistics (``symmetric.takes``)."""
    img, txt = _leaves((B, d), (B, d))
    import fastcl.losses as L
    from fastcl.ops import symmetric

    assert symmetric.takes(backend, img, txt, True, 1e-8) == backend, f"{backend} does not take the symmetric step"
    return lambda: L.clip_loss(img, txt, 10.0, backend=backend).backward()


def gist_step(backend: str, B: int, d: int, g: int):
    """GIST with one hard negative; ``backend``: a fastcl backend or ``"reference"`` (the
    blocks written out as sentence-transformers does: ``[B, 4B]`` scores)."""
    a, p, n = _leaves((B, d), (B, d), (B, d))
    with torch.no_grad():
        guide = tuple(torch.randn(B, g) for _ in range(3))
    import fastcl.losses as L
    from fastcl import reference as R

    if backend == "reference":
        fn = lambda: R.gist(a, p, n, guide=guide, margin=0.1)  # noqa: E731
    else:
        fn = lambda: L.gist_loss(a, p, n, guide=guide, margin=0.1, backend=backend)  # noqa: E731
    return lambda: fn().backward()
