"""fastcl: fused, memory-lean contrastive losses for sentence-embedding training.

    import fastcl.losses as L
    loss = L.supmpn_loss(anchor, positives, negatives, temperature=0.05)

See ``fastcl.losses`` for the public API and ``python -m fastcl.info`` for backends.
"""

__version__ = "0.1.0"
