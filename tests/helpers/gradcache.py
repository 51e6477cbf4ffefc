"""Shared by the gradient-caching tests and their DDP worker: a tiny BERT and the oracles."""

from __future__ import annotations

import pytest
import torch

from fastcl.gradcache import HFEncoder

VOCAB = 97


@pytest.fixture
def one_thread():
    """The tiny encoder's ops are too small to share; one thread also avoids OpenMP stalls
    (3-10x slower steps) when the CI machine's cores are busy."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny_encoder(*, dropout: float = 0.1, pooling: str = "mean", seed: int = 0, layers: int = 2) -> HFEncoder:
    """A randomly initialised 2-layer BERT (hidden 32) in train mode, wrapped with pooling."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(seed)
    model = BertModel(config, add_pooling_layer=False)
    return HFEncoder(model, pooling=pooling).train()


def make_batch(n: int, length: int = 11, seed: int = 0) -> dict:
    """Token ids and a padding mask with rows of different lengths (some padded)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (n, length), generator=g)
    lengths = torch.randint(3, length + 1, (n,), generator=g)
    attention_mask = (torch.arange(length) < lengths[:, None]).long()
    return {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask}


def chunked_graph(encode_fn, inputs: dict, chunk_size: int) -> torch.Tensor:
    """The oracle: the same chunks encoded with grad, all kept in one autograd graph."""
    n = next(iter(inputs.values())).shape[0]
    return torch.cat(
        [encode_fn(**{k: v[s : s + chunk_size] for k, v in inputs.items()}) for s in range(0, n, chunk_size)]
    )


def param_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in module.named_parameters() if p.grad is not None}
