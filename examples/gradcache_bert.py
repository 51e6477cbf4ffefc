"""Gradient caching: a contrastive loss over a batch encoded in chunks (CPU, seconds).

    python examples/gradcache_bert.py                 # 128 sentences in chunks of 16
    python examples/gradcache_bert.py --batch 4096 --chunk-size 256

``GradCache`` encodes the batch without grad, lets the fused loss form the gradient of the
embeddings, then re-encodes chunk by chunk with grad, replaying dropout exactly: encoder
memory is one chunk's, the gradient is the whole batch's. The encoder here is a tiny random
BERT; any Hugging Face ``AutoModel`` works the same way (docs/gradcache.md).
"""

from __future__ import annotations

import argparse

import torch
from transformers import BertConfig, BertModel

from fastcl.gradcache import GradCache, HFEncoder
from fastcl.losses import infonce_loss


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128, help="sentences per step")
    p.add_argument("--chunk-size", type=int, default=16, help="sentences per encoder call")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    model = BertModel(config).train()
    gc = GradCache(HFEncoder(model, pooling="mean"), chunk_size=args.chunk_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        input_ids = torch.randint(0, 100, (args.batch, 12))  # stand-in for tokenised sentences
        anchor, positive = gc(input_ids=input_ids), gc(input_ids=input_ids)  # two dropout views
        loss = infonce_loss(anchor, positive, temperature=0.05)  # SimCSE-unsup over the whole batch
        loss.backward()  # re-encodes each chunk with grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f} over {args.batch} sentences, {args.chunk_size} per chunk")


if __name__ == "__main__":
    main()
