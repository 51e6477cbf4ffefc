"""Data readers and recipes against hand-checked examples (no model, no network)."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from fastcl.data import (
    collate_groups,
    collate_liao,
    group_by_premise,
    insert_punctuation,
    liao_in_batch,
    load_nli,
    read_sentences,
    simcse_triplets,
    supmpn_capacity,
    supmpn_groups,
)

ROWS = [  # premise A: 2 entailments, 1 contradiction, 1 neutral; B: 2 contradictions; C: 1 entailment
    {"premise": "A", "hypothesis": "a1", "label": "entailment"},
    {"premise": "A", "hypothesis": "a-", "label": "contradiction"},
    {"premise": "A", "hypothesis": "a2", "label": "entailment"},
    {"premise": "A", "hypothesis": "a0", "label": "neutral"},
    {"premise": "B", "hypothesis": "b-", "label": "contradiction"},
    {"premise": "B", "hypothesis": "b--", "label": "contradiction"},
    {"premise": "C", "hypothesis": "c1", "label": "entailment"},
]


# ----------------------------------------------------------------------------- readers


def _write(path, text, gz=False):
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")


def test_senteval_reader_drops_no_gold_and_checks_alignment(tmp_path):
    _write(tmp_path / "s1.dev.gz", "P one .\nP one .\nP two .\n", gz=True)
    _write(tmp_path / "s2.dev.gz", "H1 .\nH2 .\nH3 .\n", gz=True)
    _write(tmp_path / "labels.dev.gz", "entailment\n-\nContradiction\n", gz=True)
    ds = load_nli(tmp_path, "dev")
    assert ds["premise"] == ["P one .", "P two ."]
    assert ds["hypothesis"] == ["H1 .", "H3 ."]
    assert ds["label"] == ["entailment", "contradiction"]
    with pytest.raises(FileNotFoundError, match="splits present: \\['dev'\\]"):
        load_nli(tmp_path, "train")
    _write(tmp_path / "s1.x", "a\nb\n")
    _write(tmp_path / "s2.x", "a\n")
    _write(tmp_path / "labels.x", "neutral\nneutral\n")
    with pytest.raises(ValueError, match="must align"):
        load_nli(tmp_path, "x")


def test_csv_jsonl_and_sample20k_layouts(tmp_path):
    _write(tmp_path / "a.csv", 'sentence1,sentence2,gold_label\n"He said ""hi"".",Someone spoke.,entailment\nX,Y,2\n')
    ds = load_nli(tmp_path / "a.csv")
    assert list(ds) == [
        {"premise": 'He said "hi".', "hypothesis": "Someone spoke.", "label": "entailment"},
        {"premise": "X", "hypothesis": "Y", "label": "contradiction"},  # HF ints: 2 = contradiction
    ]
    # staged snli/sample20k: no header, label label premise hypothesis; 1 neutral 2 contra 3 entail
    _write(tmp_path / "s.csv.gz", "3\t3\tP.\tH.\n1\t1\tP.\tN.\n2\t2\tQ.\tC.\n", gz=True)
    assert load_nli(tmp_path / "s.csv.gz")["label"] == ["entailment", "neutral", "contradiction"]
    lines = [{"premise": "p", "hypothesis": "h", "label": 0}, {"premise": "p", "hypothesis": "g", "label": -1}]
    _write(tmp_path / "d.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    assert list(load_nli(tmp_path / "d.jsonl")) == [{"premise": "p", "hypothesis": "h", "label": "entailment"}]
    _write(tmp_path / "bad.csv", "premise,hypothesis,label\np,h,maybe\n")
    with pytest.raises(ValueError, match="unknown NLI label"):
        load_nli(tmp_path / "bad.csv")
    _write(tmp_path / "nohead.csv", "p,h\n")
    with pytest.raises(ValueError, match="no header"):
        load_nli(tmp_path / "nohead.csv")
    with pytest.raises(FileNotFoundError):
        load_nli(tmp_path / "missing" / "x.csv")


def test_staged_snli_readers(data_dir):
    test = load_nli(data_dir / "snli" / "senteval", "test")
    assert len(test) == 9824 and set(test["label"]) == {"entailment", "neutral", "contradiction"}
    train = load_nli(data_dir / "snli" / "sample20k" / "train.csv.gz")
    assert len(train) == 18000
    assert train["label"].count("entailment") == 6015  # label 3 count in SOURCES.md


def test_sentences_drop_cut_last_line(tmp_path, data_dir):
    _write(tmp_path / "w.txt", "one.\n\n two. \nthree cut")
    assert read_sentences(tmp_path / "w.txt") == ["one.", "two."]
    assert read_sentences(tmp_path / "w.txt", drop_unterminated_last=False)[-1] == "three cut"
    wiki = read_sentences(data_dir / "wiki" / "wiki1m_for_simcse.partial.txt.gz")
    assert len(wiki) == 11914 and wiki[0] == "YMCA in South Australia"


# ----------------------------------------------------------------------------- recipes


def test_group_and_triplets():
    g = group_by_premise(ROWS)
    assert list(g) == ["A", "B", "C"]
    assert g["A"] == {"entailment": ["a1", "a2"], "neutral": ["a0"], "contradiction": ["a-"]}
    assert simcse_triplets(ROWS) == [{"anchor": "A", "positive": "a1", "negative": "a-"}]
    with pytest.raises(ValueError, match="no premise"):
        simcse_triplets(ROWS[4:])


def test_supmpn_fill_policies():
    out = supmpn_groups(ROWS, 3, 2, pos_fill="anchor", neg_fill="mask")
    assert [e["anchor"] for e in out] == ["A", "C"]  # B has no entailment (min_positives=1)
    a, c = out
    assert a["positives"] == ["a1", "a2", "A"] and a["pos_mask"] == [True, True, True]
    assert a["negatives"] == ["a-", ""] and a["neg_mask"] == [True, False]
    assert c["positives"] == ["c1", "C", "C"] and c["negatives"] == ["", ""] and c["neg_mask"] == [False, False]

    copy = supmpn_groups(ROWS, 3, 1, pos_fill="entailment_copy", neg_fill="mask")
    assert copy[0]["positives"] == ["a1", "a2", "a1"] and copy[1]["positives"] == ["c1", "c1", "c1"]
    masked = supmpn_groups(ROWS, 3, 1, pos_fill="mask", neg_fill="mask")
    assert masked[0]["positives"] == ["a1", "a2", ""] and masked[0]["pos_mask"] == [True, True, False]
    dropped = supmpn_groups(ROWS, 2, 1, pos_fill="drop", neg_fill="drop")
    assert [e["anchor"] for e in dropped] == ["A"]
    with pytest.raises(ValueError, match="no SupMPN example left"):
        supmpn_groups(ROWS, 3, 1, pos_fill="drop", neg_fill="mask")
    zero = supmpn_groups(ROWS, 1, 1, pos_fill="anchor", neg_fill="mask", min_positives=0)
    assert [e["anchor"] for e in zero] == ["A", "B", "C"] and zero[1]["positives"] == ["B"]
    assert supmpn_capacity(ROWS) == (2, 2)
    with pytest.raises(ValueError, match="pos_fill"):
        supmpn_groups(ROWS, pos_fill="copy")


def test_supmpn_sampled_negatives_come_from_other_premises():
    rows = [
        {"premise": f"P{i}", "hypothesis": f"h{i}-{j}", "label": lab}
        for i in range(20)
        for j, lab in enumerate(["entailment", "contradiction", "neutral"])
    ]
    out = supmpn_groups(rows, 2, 5, pos_fill="anchor", neg_fill="sample", seed=3)
    for e in out:
        i = e["anchor"][1:]
        assert e["negatives"][0] == f"h{i}-1"  # the real contradiction fills the first slot
        sampled = e["negatives"][1:]
        assert all(not s.startswith(f"h{i}-") for s in sampled)  # never the anchor's own hypotheses
        assert len(set(sampled)) == 4 and all(e["neg_mask"])
    assert out == supmpn_groups(rows, 2, 5, pos_fill="anchor", neg_fill="sample", seed=3)
    assert out != supmpn_groups(rows, 2, 5, pos_fill="anchor", neg_fill="sample", seed=4)


BATCH = [  # consecutive rows, as Liao's unshuffled SNLI
    {"premise": "A", "hypothesis": "a1", "label": "entailment"},  # 0
    {"premise": "A", "hypothesis": "a-", "label": "contradiction"},  # 1
    {"premise": "A", "hypothesis": "a2", "label": "entailment"},  # 2
    {"premise": "B", "hypothesis": "b1", "label": "entailment"},  # 3
    {"premise": "B", "hypothesis": "b0", "label": "neutral"},  # 4
]


def test_liao_allpalln_hand_checked():
    out = liao_in_batch(BATCH, "allpalln")
    assert out["anchor_rows"] == [0, 2, 3]
    assert out["pos_index"] == [[0, 2], [2, 0], [3]]
    assert out["neg_index"] == [[1, 3, 4], [1, 3, 4], [0, 1, 2, 4]]


def test_liao_3p3n_caps_and_keeps_own_entailment():
    rows = [{"premise": "A", "hypothesis": f"e{i}", "label": "entailment"} for i in range(5)]
    rows += [{"premise": "B", "hypothesis": f"n{i}", "label": "neutral"} for i in range(5)]
    for seed in range(5):
        out = liao_in_batch(rows, "3p3n", random.Random(seed))
        for a, pos, neg in zip(out["anchor_rows"], out["pos_index"], out["neg_index"]):
            assert pos[0] == a and len(pos) == 3 and len(set(pos)) == 3 and set(pos) <= set(range(5))
            assert len(neg) == 3 and len(set(neg)) == 3 and set(neg) <= set(range(5, 10))
    with pytest.raises(ValueError, match="rng"):
        liao_in_batch(rows, "3p3n")


def test_insert_punctuation_seeded():
    s = "a man is playing a guitar"
    outs = [insert_punctuation(s, 3, random.Random(i)) for i in range(200)]
    assert outs == [insert_punctuation(s, 3, random.Random(i)) for i in range(200)]
    counts, starts, ends = set(), 0, 0
    for o in outs:
        tokens = o.split()
        marks = [t for t in tokens if t in ".,!?;:"]
        assert [t for t in tokens if t not in ".,!?;:"] == s.split()  # words kept, in order
        counts.add(len(marks))
        starts += tokens[0] in ".,!?;:"
        ends += tokens[-1] in ".,!?;:"
    assert counts == {1, 2, 3}
    assert starts > 0 and ends > 0  # both ends are gaps too
    assert insert_punctuation("word", 1, random.Random(0), marks=("!",)) in ("! word", "word !")
    with pytest.raises(ValueError):
        insert_punctuation(s, 0, random.Random(0))


# ----------------------------------------------------------------------------- collators


class _Tok:
    """Whitespace 'tokenizer': enough to check the collators' layout."""

    def __call__(self, texts, padding, truncation, max_length, return_tensors):
        import torch

        ids = [[len(w) + 1 for w in t.split()][:max_length] or [1] for t in texts]
        width = max(len(i) for i in ids)
        return {
            "input_ids": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
            "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids]),
        }


def test_collate_groups_encodes_only_valid_slots():
    ex = supmpn_groups(ROWS, 3, 2, pos_fill="mask", neg_fill="mask")
    out = collate_groups(ex, _Tok(), 8)
    assert out["pos_mask"].tolist() == [[True, True, False], [True, False, False]]
    assert out["neg_mask"].tolist() == [[True, False], [False, False]]
    assert out["inputs"]["input_ids"].shape[0] == 2 + 3 + 1  # anchors + valid positives + valid negatives
    assert (out["n_pos"], out["n_neg"]) == (3, 1)  # host ints: the step sizes its rows without a device read
    assert type(out["n_pos"]) is int and type(out["n_neg"]) is int


def test_supmpn_slot_layout_drops_a_full_mask_and_keeps_the_loss():
    """A full mask becomes None (the kernels' unpadded path) with the same loss; a mask with a
    padded slot is kept, and the slot is zero-filled."""
    import torch

    from fastcl.losses import supmpn_loss
    from fastcl.trainers.recipes.supmpn import slot_layout

    g = torch.Generator().manual_seed(0)
    B, P, Q, d = 4, 2, 3, 8
    anchor = torch.randn(B, d, generator=g, dtype=torch.float64)
    pos_flat, neg_flat = (
        torch.randn(B * P, d, generator=g, dtype=torch.float64),
        torch.randn(B * Q, d, generator=g, dtype=torch.float64),
    )
    full_p, full_n = torch.ones(B, P, dtype=torch.bool), torch.ones(B, Q, dtype=torch.bool)
    positives, pm = slot_layout(pos_flat, full_p, B * P)
    negatives, nm = slot_layout(neg_flat, full_n, B * Q)
    assert pm is None and nm is None and positives.data_ptr() == pos_flat.data_ptr()
    unmasked = supmpn_loss(anchor, positives, negatives, pos_mask=pm, neg_mask=nm, backend="reference")
    masked = supmpn_loss(anchor, positives, negatives, pos_mask=full_p, neg_mask=full_n, backend="reference")
    # the reference in float64, masked or not: a logit's d coordinates, a row's B x (P + Q)
    # candidates, B rows; logits of size 1/tau = 20 (the default 0.05)
    from tests.helpers.roundoff import assert_loss_roundoff

    assert_loss_roundoff(unmasked, masked, torch.float64, terms=d + B * (P + Q) + B, logit_scale=20.0)

    part = full_n.clone()
    part[1, 2] = part[3, 0] = False
    negatives, nm = slot_layout(neg_flat[: int(part.sum())], part, int(part.sum()))
    assert nm is part
    assert negatives[1, 2].abs().sum() == 0 and negatives[3, 0].abs().sum() == 0
    assert torch.equal(negatives[part], neg_flat[: int(part.sum())])


def test_collate_liao_layout():
    out = collate_liao(BATCH, _Tok(), 8, "allpalln", random.Random(0))
    assert out["inputs"]["input_ids"].shape[0] == 10
    assert out["labels"].tolist() == [0, 2, 0, 0, 1]
    assert out["anchor_rows"].tolist() == [0, 2, 3]
    assert out["pos_index"].tolist() == [[0, 2], [2, 0], [3, 0]]
    assert out["pos_mask"].tolist() == [[True, True], [True, True], [True, False]]
    assert out["neg_mask"].sum(1).tolist() == [3, 3, 4]
