"""``fastcl eval``: STS and SentEval transfer scores of a Hugging Face encoder.

    python -m fastcl eval --model PATH --pooling mean \\
        --tasks sts12,sts13,sts14,sts15,sts16,stsb,sickr --data-dir DIR --output results.json

Prints a table and writes JSON: ``{task: score, ..., "avg_sts": ..., "avg_transfer": ...,
"details": {task: per-subset detail}, "config": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from fastcl.pooling import POOLINGS

STS = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")
TRANSFER = ("mr", "cr", "subj", "mpqa", "sst2", "trec", "mrpc")
ALIASES = {"sts": STS, "transfer": TRANSFER, "all": STS + TRANSFER}
LABELS = {
    "sts12": "STS12",
    "sts13": "STS13",
    "sts14": "STS14",
    "sts15": "STS15",
    "sts16": "STS16",
    "stsb": "STS-B",
    "sickr": "SICK-R",
    "mr": "MR",
    "cr": "CR",
    "subj": "SUBJ",
    "mpqa": "MPQA",
    "sst2": "SST-2",
    "trec": "TREC",
    "mrpc": "MRPC",
}
DTYPES = ("float32", "bfloat16", "float16")


def parse_tasks(text: str) -> list[str]:
    """Comma-separated task names and aliases (sts, transfer, all), de-duplicated in order."""
    out: list[str] = []
    for item in (t.strip().lower() for t in text.split(",")):
        if not item:
            continue
        names = ALIASES.get(item, (item,))
        for name in names:
            if name not in STS + TRANSFER:
                raise ValueError(f"unknown task {item!r}; expected some of {STS + TRANSFER} or {tuple(ALIASES)}")
            if name not in out:
                out.append(name)
    if not out:
        raise ValueError("--tasks is empty")
    return out


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="STS / SentEval transfer evaluation of a Hugging Face encoder",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="local folder or hub id loadable by AutoModel")
    p.add_argument("--pooling", default="cls", choices=POOLINGS, help="sentence pooling (default: cls)")
    p.add_argument("--tasks", default="sts", help="comma list of tasks, or sts / transfer / all (default: sts)")
    p.add_argument("--data-dir", default=None, help="staged data folder (default: $FASTCL_DATA_DIR)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.add_argument(
        "--protocol",
        default="senteval",
        choices=("senteval", "mteb"),
        help="STS text and splits: senteval (SimCSE papers) or mteb (MTEB leaderboard)",
    )
    p.add_argument(
        "--split",
        default="test",
        choices=("test", "dev"),
        help="dev: STS-B / SICK-R development sets, for model selection",
    )
    p.add_argument(
        "--aggregation",
        default="all",
        choices=("all", "wmean", "mean"),
        help="STS12-16 subset aggregation (default: all)",
    )
    p.add_argument(
        "--source",
        default="local",
        choices=("local", "hf"),
        help="STS data from --data-dir or from the MTEB copies on the hub (online)",
    )
    p.add_argument(
        "--transfer-config",
        default="full",
        choices=("full", "fast", "test"),
        help="SentEval classifier: full (10-fold, Adam), fast (5-fold, RMSprop), test",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None, help="token limit (default: the tokenizer's)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="model weights dtype")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        lines.append(
            "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args) -> int:
    import torch

    from fastcl._paths import require_data_dir
    from fastcl.eval.encode import Encoder

    # argument errors end the command with a message, before the model is loaded
    try:
        tasks = parse_tasks(args.tasks)
    except ValueError as e:
        raise SystemExit(f"fastcl eval: {e}") from None
    sts = [t for t in tasks if t in STS]
    transfer = [t for t in tasks if t in TRANSFER]
    if args.split == "dev" and (transfer or any(t not in ("stsb", "sickr") for t in sts)):
        raise SystemExit("fastcl eval: --split dev exists only for stsb and sickr")
    if args.source == "local" or transfer:
        try:
            require_data_dir(args.data_dir)
        except FileNotFoundError as e:
            raise SystemExit(f"fastcl eval: {e}") from None
    if args.batch_size < 1:
        raise SystemExit("fastcl eval: --batch-size must be >= 1")
    from fastcl._fsio import check_model_path, check_output_file

    try:  # bad paths end here, not after the model has run on every task
        check_model_path(args.model)
        if args.output:
            check_output_file(args.output, "--output")
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"fastcl eval: {e}") from None

    encoder = Encoder.from_pretrained(
        args.model,
        pooling=args.pooling,
        batch_size=args.batch_size,
        max_length=args.max_length,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        show_progress=not args.quiet,
    )
    results: dict = {}
    details: dict = {}
    if sts:
        from fastcl.eval.sts import evaluate_sts

        for name in sts:
            start = time.perf_counter()
            res = evaluate_sts(
                encoder, [name], args.data_dir, args.protocol, args.split, args.aggregation, args.source
            )[name]
            details[name] = {**res.to_dict(), "seconds": round(time.perf_counter() - start, 1)}
            results[name] = res.score
    if transfer:
        from fastcl.eval.transfer import evaluate_transfer

        for name, res in evaluate_transfer(encoder, transfer, args.data_dir, args.transfer_config).items():
            details[name] = res.to_dict()
            results[name] = res.acc

    rows = [("task", "score", "n", "metric", "seconds")]
    for name in tasks:
        d = details[name]
        if name in STS:
            metric = f"spearman x100 ({args.aggregation}, {d['split']})"
            n = str(d["n_pairs"])
            seconds = d["seconds"]
        else:
            metric = "accuracy %" + (f" (F1 {d['extra']['f1']:.2f})" if "f1" in d["extra"] else "")
            n = "/".join(str(v) for v in d["n"].values())
            seconds = d["extra"]["seconds"]
        rows.append((LABELS[name], f"{results[name]:.2f}", n, metric, f"{seconds:.1f}"))
    averages = {}
    for key, group in (("avg_sts", sts), ("avg_transfer", transfer)):
        if len(group) > 1:
            averages[key] = sum(results[t] for t in group) / len(group)
            rows.append((key, f"{averages[key]:.2f}", "", f"mean of {len(group)} tasks", ""))
    print(f"model {args.model}  pooling {args.pooling}  protocol {args.protocol}")
    print(_table(rows))
    if sts:  # the one-line form papers print
        print(" | ".join(LABELS[t] for t in sts) + (" | Avg." if len(sts) > 1 else ""))
        print(" | ".join(f"{results[t]:.2f}" for t in sts) + (f" | {averages['avg_sts']:.2f}" if len(sts) > 1 else ""))

    if args.output:
        config = {k: v for k, v in vars(args).items() if k not in ("command",)}
        config["tasks"] = tasks
        payload = {**results, **averages, "details": details, "config": config}
        return _write_results(Path(args.output).expanduser(), json.dumps(payload, indent=2) + "\n")
    return 0


def _write_results(out: Path, text: str) -> int:
    """Write ``out`` atomically; if that still fails (the paths were checked before the model
    ran, but disks fill up and folders vanish), save the results elsewhere and say where."""
    from fastcl._fsio import atomic_write_text

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, text)
    except OSError as e:
        print(f"fastcl eval: error: could not write {out}: {e}", file=sys.stderr)
        try:
            fd, fallback = tempfile.mkstemp(prefix="fastcl-eval-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            print(f"fastcl eval: the results were saved to {fallback} instead", file=sys.stderr)
        except OSError as e2:
            print(
                f"fastcl eval: could not save them to a temporary file either ({e2}); here they are:", file=sys.stderr
            )
            print(text)
        return 1
    print(f"wrote {out}")
    return 0
