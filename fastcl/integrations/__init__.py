"""Adapters to training frameworks, each an optional extra.

- ``fastcl.integrations.sentence_transformers`` (``pip install 'fastcl[st]'``): fastcl's
  fused losses with sentence-transformers' loss interface, for ``SentenceTransformerTrainer``.
- ``fastcl.integrations.open_clip``: open_clip's ``ClipLoss`` and ``SigLipLoss`` (open-clip-torch
  3.3's arguments and results) on fastcl's fused kernels; needs only torch.

Importing this package imports no framework; each submodule imports its own on demand.
"""
