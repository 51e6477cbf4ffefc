"""One gradient-cached training step, same model and batch: sentence-transformers vs fastcl.

SimCSE-supervised triplets (premise, entailment, contradiction) from NLI data,
a SentenceTransformer in float32 weights under bf16 autocast, AdamW. For each loss,
``--steps`` optimiser steps after one warm-up step: sentences/s (3 texts per triplet) and
the peak CUDA memory of a step. Losses:

* ``st-cmnrl``: ``sentence_transformers.losses.CachedMultipleNegativesRankingLoss``
* ``fastcl-cmnrl``: ``fastcl.integrations.sentence_transformers.CachedMultipleNegativesRankingLoss``

    python scripts/gpu_train_st.py --model MODEL --train-file NLI.csv --batch-size 4096 --chunk-size 512
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def triplets(source: str, n: int) -> list[dict]:
    from fastcl.data.nli import load_nli
    from fastcl.data.recipes import simcse_triplets

    rows = simcse_triplets(load_nli(source))
    if len(rows) < n:
        raise SystemExit(f"only {len(rows)} triplets in the staged sample, asked for {n}")
    return rows[:n]


def make_loss(name: str, model, chunk: int):
    if name == "st-cmnrl":
        from sentence_transformers.losses import CachedMultipleNegativesRankingLoss

        return CachedMultipleNegativesRankingLoss(model, mini_batch_size=chunk, show_progress_bar=False)
    from fastcl.integrations.sentence_transformers import CachedMultipleNegativesRankingLoss

    return CachedMultipleNegativesRankingLoss(model, mini_batch_size=chunk)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--train-file", required=True, help="NLI data (fastcl.data.load_nli: folder, csv or jsonl)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--losses", default="fastcl-cmnrl,st-cmnrl")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    from sentence_transformers import SentenceTransformer

    rows = triplets(args.train_file, args.batch_size)
    columns = [[r[k] for r in rows] for k in rows[0]]
    for name in args.losses.split(","):
        torch.manual_seed(0)
        model = SentenceTransformer(args.model, device=args.device)
        model.float()
        loss = make_loss(name, model, args.chunk_size)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
        features = [
            {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in model.tokenize(col).items()} for col in columns
        ]
        times, values = [], []
        for step in range(args.steps + 1):
            if cuda:
                torch.cuda.synchronize()
            if step == 1 and cuda:
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                value = loss(features, None)
            value.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if step:
                times.append(time.perf_counter() - t)
                values.append(float(value.detach()))
        step_s = sorted(times)[len(times) // 2]
        print(
            json.dumps(
                {
                    "loss": name,
                    "batch": args.batch_size,
                    "chunk": args.chunk_size,
                    "step_s": round(step_s, 3),
                    "sentences_per_s": round(3 * args.batch_size / step_s),
                    "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                    "losses": [round(v, 4) for v in values],
                }
            ),
            flush=True,
        )
        del model, loss, opt, features
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
