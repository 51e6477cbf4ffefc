"""One rank of tests/distributed/test_st_distributed.py: sentence-transformers' gathered losses vs fastcl's.

Each rank computes, on its own embeddings, sentence-transformers' loss with
``gather_across_devices=True`` and fastcl's with the same flag (and with an explicit
``process_group``), and saves values and gradients for the parent to compare. Then a tiny
dropout-free BERT wrapped in DDP takes one step with sentence-transformers' cached MNRL and
one with fastcl's (both gathered): the all-reduced parameter gradients are saved too. GIST
(plain, cached, ring) runs on lookup stand-in models (``_gist_cases``).
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


def _gist_cases(seed: int, rank: int) -> tuple[int, dict]:
    """sentence-transformers' GISTEmbedLoss / CachedGISTEmbedLoss with gather_across_devices=True
    against fastcl's, on lookup stand-in models (float64): each rank's value and its table's
    (its embeddings') gradient. The guide's meanings are shared by the ranks, so it drops
    candidates of the other rank too."""
    from sentence_transformers.sentence_transformer import losses as st_losses

    from fastcl.integrations import sentence_transformers as fst
    from tests.helpers import st as common

    # the guide's texts are fixed (its cross-rank drops are checked once for all), the model's random
    shared = torch.Generator().manual_seed(1234)
    meanings = torch.randn(3, 4, generator=shared, dtype=torch.float64)
    fixed = torch.Generator().manual_seed(1235 + rank)
    n = 3 * B
    of = torch.randint(0, 3, (n,), generator=fixed)
    of[B : 2 * B] = of[:B]
    guide_table = meanings[of] + 0.6 * torch.randn(n, 4, generator=fixed, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed * 100 + rank + 7)
    model = common.lookup_model(torch.randn(n, D, generator=g, dtype=torch.float64))
    guide = common.lookup_model(guide_table, tokenizer=model.tokenizer, trainable=False)
    features = [common.row_features(range(c * B, (c + 1) * B)) for c in range(3)]

    def run(loss, columns: int):
        model.zero_grad()
        value = loss([dict(f) for f in features[:columns]], None)
        value.backward()
        return value.detach(), [model.table.grad.clone()]

    # how many of the other rank's positives the guide drops from this rank's anchor rows
    gathered = [torch.empty(B, 4, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, guide_table[B : 2 * B].contiguous())
    others = torch.cat([t for r, t in enumerate(gathered) if r != rank])
    cos = torch.nn.functional.cosine_similarity
    threshold = cos(guide_table[:B], guide_table[B : 2 * B])[:, None] - 0.1
    cross_rank_drops = int((cos(guide_table[:B, None], others[None], dim=-1) > threshold).sum())
    opts = dict(margin=0.1, temperature=0.05)
    other = dict(margin_strategy="relative", margin=0.3, contrast_anchors=False)
    on = dict(gather_across_devices=True)
    return cross_rank_drops, {
        "gist": (
            run(st_losses.GISTEmbedLoss(model, guide, **opts, **on), 3),
            run(fst.GISTEmbedLoss(model, guide, **opts, **on), 3),
        ),
        "gist_pairs_relative": (
            run(st_losses.GISTEmbedLoss(model, guide, **other, **on), 2),
            run(fst.GISTEmbedLoss(model, guide, process_group=dist.group.WORLD, **other), 2),
        ),
        "gist_ring": (
            run(st_losses.GISTEmbedLoss(model, guide, **opts, **on), 3),
            run(fst.GISTEmbedLoss(model, guide, cross_device="ring", **opts, **on), 3),
        ),
        "gist_cached": (
            run(st_losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=2, **opts, **on), 3),
            run(fst.CachedGISTEmbedLoss(model, guide, mini_batch_size=2, **opts, **on), 3),
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
        drops, gist = _gist_cases(seed, rank)
        return {
            "embeddings": _embedding_cases(seed, rank) | gist,
            "gist_cross_rank_drops": drops,
            "ddp_cached": _ddp_cached(models["m"], seed, rank),
        }

    run_rank(rank, world, store_path, out_dir, body, timeout_s=TIMEOUT_S, before_group=build_model)
