"""Workloads of the user-facing API options against the peer that offers them today.

* ``supcon_labels_step``: SupCon from class labels (``fastcl.losses.supcon_labels_loss``)
  against pytorch-metric-learning's ``SupConLoss`` (which builds ``N x N`` logits and masks).
* ``mnrl_directions_step``: sentence-transformers 6 MNRL with extra ``directions`` /
  ``partition_mode`` / hardness (``fastcl.losses.mnrl_loss``) against
  ``sentence_transformers`` ``MultipleNegativesRankingLoss`` on the same embeddings.
* ``matryoshka_step``: MNRL with ``matryoshka_dims`` (one fused pass over ``d``) against
  sentence-transformers' ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)`` on the same
  embeddings (its cached-loss hook: K chunked losses, each with its own backward).

Each returns a zero-argument callable doing one forward + backward, the form
``benchmarks.harness.memory`` and the benchmarks time and measure.
"""

from __future__ import annotations

import torch

TEMPERATURE = 0.1
SUPCON_IMPLS = ("pml-supcon", "reference", "torch", "cpp", "triton")
MNRL_IMPLS = ("st-mnrl", "reference", "torch", "cpp", "triton")


def _leaf(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen, dtype=torch.float32, device=device).to(dtype).requires_grad_()


def supcon_labels_inputs(N: int, d: int, num_labels: int, views: int = 2, dtype=torch.float32, device="cpu", seed=0):
    """``features [N // views, views, d]`` and labels ``[N // views]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B = N // views
    features = _leaf(gen, B, views, d, dtype=dtype, device=device)
    labels = torch.randint(0, num_labels, (B,), generator=gen, device=device)
    return features, labels


def supcon_labels_fn(impl: str, features, labels, temperature: float = TEMPERATURE):
    """``() -> loss`` for ``impl``: a fastcl backend or ``"pml-supcon"``."""
    if impl == "pml-supcon":
        from pytorch_metric_learning.losses import SupConLoss

        peer = SupConLoss(temperature=temperature)
        V = features.shape[1]
        return lambda: peer(torch.cat(torch.unbind(features, dim=1)), labels.repeat(V))
    from fastcl.losses import supcon_labels_loss

    return lambda: supcon_labels_loss(features, labels, temperature=temperature, backend=impl)


def supcon_labels_step(
    backend: str, N: int, d: int, num_labels: int, views: int = 2, dtype: str = "float32", device: str = "cpu"
):
    features, labels = supcon_labels_inputs(N, d, num_labels, views, getattr(torch, dtype), device)
    fn = supcon_labels_fn(backend, features, labels)

    def step():
        features.grad = None
        fn().backward()

    return step


GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def mnrl_directions_inputs(B: int, d: int, Q: int = 1, dtype=torch.float32, device="cpu", seed=0):
    """``[query, positive, negative_1..Q]`` columns, each ``[B, d]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [_leaf(gen, B, d, dtype=dtype, device=device) for _ in range(2 + Q)]


def mnrl_directions_fn(
    impl: str,
    columns,
    *,
    directions=GTE,
    partition_mode="joint",
    hardness_mode=None,
    hardness_strength=0.0,
    temperature: float = 0.05,
):
    """``() -> loss`` for ``impl``: a fastcl backend or ``"st-mnrl"`` (sentence-transformers)."""
    opts = dict(
        directions=directions,
        partition_mode=partition_mode,
        hardness_mode=hardness_mode,
        hardness_strength=hardness_strength,
    )
    if impl == "st-mnrl":
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

        peer = MultipleNegativesRankingLoss(None, scale=1.0 / temperature, **opts)
        return lambda: peer.compute_loss_from_embeddings(columns, None)
    from fastcl.losses import mnrl_loss

    negatives = torch.stack(columns[2:], dim=1) if len(columns) > 2 else None
    return lambda: mnrl_loss(columns[0], columns[1], negatives, temperature=temperature, backend=impl, **opts)


def mnrl_directions_step(
    backend: str,
    B: int,
    d: int,
    Q: int = 1,
    hardness_mode: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
):
    columns = mnrl_directions_inputs(B, d, Q, getattr(torch, dtype), device)
    fn = mnrl_directions_fn(
        backend, columns, hardness_mode=hardness_mode, hardness_strength=5.0 if hardness_mode else 0.0
    )

    def step():
        for c in columns:
            c.grad = None
        fn().backward()

    return step


MATRYOSHKA_DIMS = (768, 512, 256, 128, 64)


class _EmbeddingSize(torch.nn.Sequential):
    """What the peer's constructors ask of a model when the loss runs on embeddings: its
    embedding size and a first module (not a ``StaticEmbedding``)."""

    def __init__(self, d: int):
        super().__init__(torch.nn.Identity())
        self.d = d

    def get_embedding_dimension(self) -> int:
        return self.d


def matryoshka_fn(impl: str, columns, dims=MATRYOSHKA_DIMS, temperature: float = 0.05, mini_batch_size: int = 32):
    """``() -> loss`` for ``impl``: a fastcl backend (or ``"auto"``), ``"<backend>-per-prefix"``
    (K separate fastcl losses on the truncated embeddings: what the fused pass saves) or
    ``"st-matryoshka-cmnrl"``.

    The peer's step runs its own backward (sentence-transformers' cached protocol): with
    grad enabled the columns' ``.grad`` is filled and the value comes back detached.
    """
    if impl == "st-matryoshka-cmnrl":
        from sentence_transformers.sentence_transformer.losses import (
            CachedMultipleNegativesRankingLoss,
            MatryoshkaLoss,
        )

        model = _EmbeddingSize(columns[0].shape[1])
        inner = CachedMultipleNegativesRankingLoss(model, scale=1.0 / temperature, mini_batch_size=mini_batch_size)
        MatryoshkaLoss(model, inner, list(dims))  # decorates inner.calculate_loss
        return lambda: inner.calculate_loss([[c] for c in columns], None, with_backward=torch.is_grad_enabled())
    from fastcl.losses import mnrl_loss

    negatives = torch.stack(columns[2:], dim=1) if len(columns) > 2 else None
    if impl.endswith("-per-prefix"):
        backend = impl.removesuffix("-per-prefix")
        return lambda: sum(
            mnrl_loss(columns[0][:, :m], columns[1][:, :m], None if negatives is None else negatives[..., :m],
                      temperature=temperature, backend=backend)
            for m in dims
        )  # fmt: skip
    return lambda: mnrl_loss(
        columns[0], columns[1], negatives, temperature=temperature, backend=impl, matryoshka_dims=tuple(dims)
    )


def matryoshka_step(backend: str, B: int, d: int, Q: int = 1, dims=MATRYOSHKA_DIMS, dtype="float32", device="cpu"):
    columns = mnrl_directions_inputs(B, d, Q, getattr(torch, dtype), device)
    fn = matryoshka_fn(backend, columns, dims)

    def step():
        for c in columns:
            c.grad = None
        loss = fn()
        if loss.requires_grad:  # the peer has run its backward already
            loss.backward()

    return step


STEPS = ("supcon_labels_step", "mnrl_directions_step", "matryoshka_step")


def api_step(step: str, **case):
    """``<step>(**case)``: one factory for a batch of memory probes over every workload here."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; expected one of {STEPS}")
    return globals()[step](**case)
