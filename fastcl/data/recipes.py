"""Data recipes of the papers (docs/training.md, "Presets").

Inputs are NLI rows (``premise``, ``hypothesis``, ``label``): a ``datasets.Dataset`` from
:mod:`fastcl.data.nli` or any iterable of such dicts. Outputs are plain lists of dicts,
random choices are drawn from an explicit ``random.Random`` / seed, so every recipe is
reproducible (and a resumed training run sees the same data).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

POS_FILLS = ("anchor", "entailment_copy", "mask", "drop")
NEG_FILLS = ("sample", "mask", "drop")
LIAO_CAPS = ("3p3n", "allpalln")
PUNCTUATION = (".", ",", "!", "?", ";", ":")


def _rows(nli) -> list[tuple[str, str, str]]:
    if hasattr(nli, "column_names"):  # datasets.Dataset: columnar access is much faster
        return list(zip(nli["premise"], nli["hypothesis"], nli["label"]))
    return [(r["premise"], r["hypothesis"], r["label"]) for r in nli]


def group_by_premise(nli) -> dict[str, dict[str, list[str]]]:
    """``{premise: {"entailment": [...], "contradiction": [...], "neutral": [...]}}`` in first-seen order."""
    groups: dict[str, dict[str, list[str]]] = {}
    for p, h, lab in _rows(nli):
        g = groups.setdefault(p, {"entailment": [], "neutral": [], "contradiction": []})
        g[lab].append(h)
    return groups


def simcse_triplets(nli) -> list[dict[str, str]]:
    """SimCSE-sup ``(anchor, positive, negative)`` triplets: per premise, its entailments and
    contradictions are paired in order (``zip``); premises lacking either are skipped."""
    out = []
    for premise, g in group_by_premise(nli).items():
        for ent, con in zip(g["entailment"], g["contradiction"]):
            out.append({"anchor": premise, "positive": ent, "negative": con})
    if not out:
        raise ValueError("no premise has both an entailment and a contradiction: no SimCSE triplets")
    return out


def supmpn_groups(
    nli,
    num_positives: int = 5,
    num_negatives: int = 5,
    pos_fill: str = "anchor",
    neg_fill: str = "sample",
    seed: int = 0,
    min_positives: int = 1,
) -> list[dict]:
    """SupMPN examples: one per premise, ``P`` positives (entailments) and ``Q`` negatives
    (contradictions); neutral hypotheses are unused. Real items fill the first slots (in
    data order, truncated to P / Q).

    Fill policies for premises with fewer real items:
        pos_fill: ``anchor`` (copy the premise, the paper's wording), ``entailment_copy``
            (repeat the real entailments cyclically), ``mask`` (keep the real count, pad and
            mask), ``drop`` (skip the premise).
        neg_fill: ``sample`` (entailment or contradiction hypotheses of *other* premises,
            never neutral ones; seeded, without replacement within an example), ``mask``,
            ``drop``.
    Premises with fewer than ``min_positives`` real entailments are skipped (a premise with
    none would otherwise learn only from copies of itself).

    Returns dicts ``{"anchor": str, "positives": [P str], "negatives": [Q str],
    "pos_mask": [P bool], "neg_mask": [Q bool]}``; padded slots hold ``""``.
    """
    if pos_fill not in POS_FILLS:
        raise ValueError(f"pos_fill={pos_fill!r}; expected one of {POS_FILLS}")
    if neg_fill not in NEG_FILLS:
        raise ValueError(f"neg_fill={neg_fill!r}; expected one of {NEG_FILLS}")
    for name, v in (
        ("num_positives", num_positives),
        ("num_negatives", num_negatives),
        ("min_positives", min_positives),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "num_positives" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'num_positives' else 0}, got {v!r}")
    groups = group_by_premise(nli)
    rng = random.Random(seed)
    premises = list(groups)
    # sampling pool for negatives: the entailment and contradiction hypotheses of every
    # premise, with the premise they belong to. Never neutral ones: the paper fills from
    # other premises' entailments or contradictions (neutral pairs are unused throughout).
    pool = [(p, h) for p in premises for lab in ("entailment", "contradiction") for h in groups[p][lab]]
    out = []
    for premise in premises:
        g = groups[premise]
        ents, cons = g["entailment"][:num_positives], g["contradiction"][:num_negatives]
        if len(g["entailment"]) < min_positives:
            continue
        if len(ents) < num_positives and pos_fill == "drop":
            continue
        if len(cons) < num_negatives and neg_fill == "drop":
            continue
        pos_mask = [True] * len(ents)
        missing = num_positives - len(ents)
        if missing:
            if pos_fill == "anchor":
                fill, valid = [premise] * missing, True
            elif pos_fill == "entailment_copy" and ents:
                fill, valid = [ents[i % len(ents)] for i in range(missing)], True
            elif pos_fill == "entailment_copy":
                fill, valid = [premise] * missing, True  # no entailment to copy: fall back to the anchor
            else:
                fill, valid = [""] * missing, False
            ents = ents + fill
            pos_mask += [valid] * missing
        neg_mask = [True] * len(cons)
        missing = num_negatives - len(cons)
        if missing:
            if neg_fill == "sample":
                fill = _sample_other(pool, premise, missing, rng)
                neg_mask += [True] * len(fill)
                if len(fill) < missing:  # tiny corpora: not enough other hypotheses
                    neg_mask += [False] * (missing - len(fill))
                    fill = fill + [""] * (missing - len(fill))
            else:
                fill = [""] * missing
                neg_mask += [False] * missing
            cons = cons + fill
        out.append(
            {"anchor": premise, "positives": ents, "negatives": cons, "pos_mask": pos_mask, "neg_mask": neg_mask}
        )
    if not out:
        raise ValueError(
            f"no SupMPN example left: no premise has >= {min_positives} entailment(s)"
            + (
                f" and {num_positives} entailments / {num_negatives} contradictions (fill policy 'drop')"
                if "drop" in (pos_fill, neg_fill)
                else ""
            )
        )
    return out


def _sample_other(pool: Sequence[tuple[str, str]], premise: str, k: int, rng: random.Random) -> list[str]:
    """``k`` distinct hypotheses of premises other than ``premise`` (rejection sampling)."""
    chosen: list[str] = []
    seen: set[int] = set()
    tries = 0
    while len(chosen) < k and tries < 50 * k + 100:
        tries += 1
        i = rng.randrange(len(pool))
        if i in seen or pool[i][0] == premise or pool[i][1] in chosen:
            continue
        seen.add(i)
        chosen.append(pool[i][1])
    return chosen


def supmpn_capacity(nli) -> tuple[int, int]:
    """The largest real (entailment, contradiction) counts of any premise: P/Q beyond these
    need a fill policy."""
    groups = group_by_premise(nli)
    return (
        max((len(g["entailment"]) for g in groups.values()), default=0),
        max((len(g["contradiction"]) for g in groups.values()), default=0),
    )


def liao_in_batch(rows: Sequence[dict], cap: str = "allpalln", rng: random.Random | None = None) -> dict:
    """Liao's in-batch construction for one batch of NLI rows (kept in data order).

    Anchors are the premises of the entailment rows; candidates are the batch's hypotheses
    (one per row). Anchor ``a`` (row ``r``) has positives = row ``r``'s hypothesis plus the
    other entailment hypotheses of the identical premise; negatives = every other hypothesis.
    ``cap="3p3n"`` keeps row ``r``'s own entailment and samples the others up to 3 positives
    and 3 negatives without replacement (unsampled ones leave both sets); ``"allpalln"``
    takes all (its denominator is the whole batch).

    Returns ``{"anchor_rows": [A] row indices, "pos_index": [A][P] candidate indices,
    "neg_index": [A][Q] candidate indices}`` (ragged lists; the collator pads and masks).
    """
    if cap not in LIAO_CAPS:
        raise ValueError(f"cap={cap!r}; expected one of {LIAO_CAPS}")
    if cap == "3p3n" and rng is None:
        raise ValueError("cap='3p3n' samples: pass rng=random.Random(seed)")
    anchors, pos_index, neg_index = [], [], []
    for r, row in enumerate(rows):
        if row["label"] != "entailment":
            continue
        same = [
            c
            for c, other in enumerate(rows)
            if c != r and other["label"] == "entailment" and other["premise"] == row["premise"]
        ]
        pos_set = set(same) | {r}
        negs = [c for c in range(len(rows)) if c not in pos_set]
        if cap == "3p3n":
            same = rng.sample(same, min(2, len(same)))
            negs = rng.sample(negs, min(3, len(negs)))
        anchors.append(r)
        pos_index.append([r] + same)
        neg_index.append(negs)
    return {"anchor_rows": anchors, "pos_index": pos_index, "neg_index": neg_index}


def insert_punctuation(sentence: str, k: int, rng: random.Random, marks: Sequence[str] = PUNCTUATION) -> str:
    """EdaCSE augmentation: insert ``n ~ U{1..k}`` marks (each uniform from ``marks``) as
    separate tokens at gaps drawn uniformly among the ``len(words) + 1`` gaps (both ends
    included, with replacement) of the whitespace-split sentence."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (max insertions) must be an int >= 1, got {k!r}")
    if not marks:
        raise ValueError("marks must not be empty")
    words = sentence.split()
    n = rng.randint(1, k)
    gaps = sorted((rng.randint(0, len(words)) for _ in range(n)), reverse=True)
    for g in gaps:  # right to left, so earlier gap positions stay valid
        words.insert(g, rng.choice(marks))
    return " ".join(words)
