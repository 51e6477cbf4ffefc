"""Adapters to training frameworks, each an optional extra.

- ``fastcl.integrations.sentence_transformers`` (``pip install 'fastcl[st]'``): fastcl's
  fused losses with sentence-transformers' loss interface, for ``SentenceTransformerTrainer``.

Importing this package imports no framework; each submodule imports its own on demand.
"""
