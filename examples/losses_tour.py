"""A tour of fastcl's losses on random embeddings (CPU, a few seconds).

    python examples/losses_tour.py            # B = 256, d = 768
    python examples/losses_tour.py --tiny     # B = 16, d = 64 (what tests/examples runs)

Every loss takes raw embeddings (normalised inside), returns a 0-d loss in the input dtype
and gives gradients with respect to the raw embeddings. Formulas: docs/losses.md; what each
loss computes, precisely: docs/contracts.md.
"""

from __future__ import annotations

import argparse

import torch

import fastcl.losses as L


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small sizes, for a smoke run")
    args = p.parse_args(argv)
    B, P, Q, d = (16, 3, 3, 64) if args.tiny else (256, 5, 5, 768)
    torch.manual_seed(0)

    # SupMPN: P positives and Q hard negatives per anchor
    anchor = torch.randn(B, d, requires_grad=True)
    positives = torch.randn(B, P, d, requires_grad=True)
    negatives = torch.randn(B, Q, d, requires_grad=True)
    loss = L.supmpn_loss(anchor, positives, negatives, temperature=0.05)
    loss.backward()
    print(f"supmpn_loss                {loss.item():.4f}")

    # padded slots: False in the mask; an anchor without a valid positive contributes nothing
    pos_mask = torch.rand(B, P) > 0.3
    pos_mask[:, 0] = True
    print(f"supcon_loss, masked        {L.supcon_loss(anchor, positives, negatives, pos_mask=pos_mask).item():.4f}")

    # modules, with an optional learnable temperature; SimCSE-sup: one hard negative per anchor
    mnrl = L.MNRLoss(temperature=0.05, learn_temperature=True)
    print(f"MNRLoss, 1 hard negative   {mnrl(anchor, positives[:, 0], negatives[:, 0]).item():.4f}")

    # SupCon from class labels (SupContrast / pytorch-metric-learning): [B, V, d] views
    features = torch.randn(B, 2, d, requires_grad=True)
    labels = torch.randint(0, 4, (B,))
    loss = L.supcon_loss(features, labels=labels, temperature=0.1)
    loss.backward()
    print(f"supcon_loss, labels        {loss.item():.4f}")

    # sentence-transformers 6's MNRL options: GTE's four directions in one partition, with
    # hard-negative weighting of the in-batch negatives
    q, doc, neg = (torch.randn(B, d, requires_grad=True) for _ in range(3))
    loss = L.mnrl_loss(
        q,
        doc,
        neg,
        temperature=0.05,
        directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
        partition_mode="joint",
        hardness_mode="in_batch_negatives",
        hardness_strength=9.0,
    )
    loss.backward()
    print(f"mnrl_loss, GTE directions  {loss.item():.4f}")

    # Matryoshka, fused: the weighted sum of the loss on each prefix of the embedding
    dims = tuple(m for m in (d, d // 2, d // 4, d // 8) if m > 0)
    weights = (1.0,) * (len(dims) - 1) + (0.5,)
    loss = L.mnrl_loss(q, doc, neg, temperature=0.05, matryoshka_dims=dims, matryoshka_weights=weights)
    want = sum(w * L.mnrl_loss(q[:, :m], doc[:, :m], neg[:, :m], temperature=0.05) for m, w in zip(dims, weights))
    assert torch.allclose(loss, want, rtol=1e-4), (loss, want)
    print(f"mnrl_loss, Matryoshka {dims}  {loss.item():.4f} (= the sum over prefixes)")


if __name__ == "__main__":
    main()
