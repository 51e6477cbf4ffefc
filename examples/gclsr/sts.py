"""STS12-16 / STS-B / SICK-R of a trained GCLSR model and of the averaged word-vector baseline.

    FASTCL_DATA_DIR=/work/shared/data HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \\
        python examples/gclsr/sts.py --model runs/gclsr/best --output results.json
    python examples/gclsr/sts.py --baseline-only --output baseline.json

SentEval protocol, "all" aggregation, Spearman x 100 (as SimCSE / GCLSR report). The
baseline uses the same word vectors, tokenisation and word limit as the model.
"""

from __future__ import annotations

import argparse
import json
import time

from fastcl.eval.sts import evaluate_sts
from fastcl.gclsr.encode import AveragedWordVectors
from fastcl.gclsr.recipe import default_word_vectors, load_pretrained, load_word_vectors

TASKS = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")


def scores(encoder, tasks, data_dir, split="test") -> dict:
    start = time.perf_counter()
    out = {t: round(r.score, 2) for t, r in evaluate_sts(encoder, tasks, data_dir, split=split).items()}
    if len(tasks) > 1:
        out["avg"] = round(sum(out[t] for t in tasks) / len(tasks), 2)
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a folder written by the gclsr recipe (gclsr_config.json)")
    p.add_argument("--baseline-only", action="store_true")
    p.add_argument("--word-vectors", help="override the vectors (default: the model's, else MiniLM)")
    p.add_argument("--max-words", type=int, default=64, help="baseline word limit")
    p.add_argument("--data-dir")
    p.add_argument("--split", default="test", choices=("test", "dev"))
    p.add_argument("--output")
    args = p.parse_args(argv)
    tasks = TASKS if args.split == "test" else ("stsb", "sickr")
    results = {}
    if args.model and not args.baseline_only:
        enc = load_pretrained(args.model, args.word_vectors)
        results["gclsr"] = scores(enc, tasks, args.data_dir, args.split)
        vectors, max_words = enc.vectors, enc.max_words
    else:
        vectors, max_words = load_word_vectors(args.word_vectors or default_word_vectors()), args.max_words
    results["avg_word_vectors"] = scores(
        AveragedWordVectors(vectors, max_words=max_words), tasks, args.data_dir, args.split
    )
    print(json.dumps(results, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
