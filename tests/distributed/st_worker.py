"""One rank of tests/distributed/test_st_distributed.py: sentence-transformers' gathered losses vs fastcl's.

Each rank computes, on its own embeddings, sentence-transformers' loss with
``gather_across_devices=True`` and fastcl's with the same flag (and with an explicit
``process_group``), and saves values and gradients for the parent to compare. Then a tiny
dropout-free BERT wrapped in DDP takes one step with sentence-transformers' cached MNRL and
one with fastcl's (both gathered): the all-reduced parameter gradients are saved too.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.helpers.spawn import run_rank

B, D, Q = 5, 7, 1
TIMEOUT_S = 120


def _grads(fn, embs):
    value = fn(embs)
    return value.detach(), [g.detach() for g in torch.autograd.grad(value, embs)]


def _embedding_cases(seed: int, rank: int) -> dict:
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss as STMNRL

    from fastcl.integrations import sentence_transformers as fst

    g = torch.Generator().manual_seed(seed * 100 + rank)
    triplet = [torch.randn(B, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2 + Q)]
    pair = triplet[:2]
    ident = torch.nn.Identity()
    sym = dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")
    st_mnrl = STMNRL(None, gather_across_devices=True)
    st_sym = STMNRL(None, gather_across_devices=True, **sym)
    gte = dict(directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"))
    hard = dict(
        directions=("query_to_doc", "doc_to_query"),
        partition_mode="per_direction",
        hardness_mode="all_negatives",
        hardness_strength=4.0,
    )
    st_gte = STMNRL(None, gather_across_devices=True, hardness_mode="in_batch_negatives", hardness_strength=3.0, **gte)
    st_hard = STMNRL(None, gather_across_devices=True, **hard)
    return {
        "mnrl_gte_hardness": (
            _grads(lambda e: st_gte.compute_loss_from_embeddings(e, None), triplet),
            _grads(
                fst.MultipleNegativesRankingLoss(
                    ident, gather_across_devices=True, hardness_mode="in_batch_negatives", hardness_strength=3.0, **gte
                ).compute_loss_from_embeddings,
                triplet,
            ),
        ),
        "mnrl_per_direction_hardness": (
            _grads(lambda e: st_hard.compute_loss_from_embeddings(e, None), triplet),
            _grads(
                fst.MultipleNegativesRankingLoss(
                    ident, process_group=dist.group.WORLD, **hard
                ).compute_loss_from_embeddings,
                triplet,
            ),
        ),
        "mnrl_gte_hardness_ring": (
            _grads(lambda e: st_gte.compute_loss_from_embeddings(e, None), triplet),
            _grads(
                fst.MultipleNegativesRankingLoss(
                    ident,
                    gather_across_devices=True,
                    cross_device="ring",
                    hardness_mode="in_batch_negatives",
                    hardness_strength=3.0,
                    **gte,
                ).compute_loss_from_embeddings,
                triplet,
            ),
        ),  # fmt: skip
        "mnrl_ring": (
            _grads(lambda e: st_mnrl.compute_loss_from_embeddings(e, None), triplet),
            _grads(
                fst.MultipleNegativesRankingLoss(
                    ident, gather_across_devices=True, cross_device="ring"
                ).compute_loss_from_embeddings,
                triplet,
            ),
        ),
        "mnrl": (
            _grads(lambda e: st_mnrl.compute_loss_from_embeddings(e, None), triplet),
            _grads(
                fst.MultipleNegativesRankingLoss(ident, gather_across_devices=True).compute_loss_from_embeddings,
                triplet,
            ),
        ),
        "mnrl_group": (
            _grads(lambda e: st_mnrl.compute_loss_from_embeddings(e, None), triplet),
            _grads(
                fst.MultipleNegativesRankingLoss(ident, process_group=dist.group.WORLD).compute_loss_from_embeddings,
                triplet,
            ),
        ),
        "infonce_symmetric": (
            _grads(lambda e: st_sym.compute_loss_from_embeddings(e, None), pair),
            _grads(
                fst.InfoNCELoss(ident, symmetric=True, gather_across_devices=True).compute_loss_from_embeddings, pair
            ),
        ),
    }


def _ddp_cached(model, seed: int, rank: int) -> dict:
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss as STCached
    from torch.nn.parallel import DistributedDataParallel

    from fastcl.integrations import sentence_transformers as fst
    from tests.helpers import st as common

    ddp = DistributedDataParallel(model)
    rows = common.sentences(12, seed=seed * 100 + rank)
    features = [model.preprocess(rows[i::3]) for i in range(3)]
    out = {}
    for name, loss in {
        "st": STCached(model, mini_batch_size=2, gather_across_devices=True),
        "fastcl": fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, gather_across_devices=True),
    }.items():
        loss.model = ddp  # what SentenceTransformerTrainer does once it wraps the model
        model.zero_grad()
        value = loss([dict(f) for f in features], None)
        value.backward()
        out[name] = (value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def worker(rank: int, world: int, store_path: str, out_dir: str, seed: int) -> None:
    from tests.helpers import st as common

    models = {}

    def build_model() -> None:
        # Before the group exists: transformers' save_pretrained writes only on rank 0 of a group.
        models["m"] = common.tiny_model(os.path.join(out_dir, f"model{rank}"), dropout=0.0, seed=seed)

    def body() -> dict:
        return {"embeddings": _embedding_cases(seed, rank), "ddp_cached": _ddp_cached(models["m"], seed, rank)}

    run_rank(rank, world, store_path, out_dir, body, timeout_s=TIMEOUT_S, before_group=build_model)
