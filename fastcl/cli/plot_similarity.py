"""``fastcl plot-similarity``: heatmap of cosine similarities between a few sentences.

    python -m fastcl plot-similarity --model PATH --sentences FILE --out fig.png

FILE holds one sentence per line (blank lines and ``#`` comments are skipped).
"""

from __future__ import annotations

import argparse

from fastcl.pooling import POOLINGS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plot-similarity",
        help="cosine-similarity heatmap of sentences under a model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="local folder or hub id loadable by AutoModel")
    p.add_argument("--sentences", required=True, help="text file, one sentence per line")
    p.add_argument("--out", required=True, help="image path (.png, .pdf, .svg)")
    p.add_argument("--pooling", default="cls", choices=POOLINGS)
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--title", default=None, help="default: the model path and pooling")
    annotate = p.add_mutually_exclusive_group()
    annotate.add_argument(
        "--annotate",
        dest="annotate",
        action="store_true",
        default=None,
        help="write values in the cells (default: when <= 20 sentences)",
    )
    annotate.add_argument("--no-annotate", dest="annotate", action="store_false")


def run(args) -> int:
    from fastcl._fsio import check_model_path, check_output_file
    from fastcl.eval.encode import Encoder
    from fastcl.eval.plot import cosine_matrix, plot_similarity, read_sentences

    try:  # fail before loading the model
        sentences = read_sentences(args.sentences)
        check_model_path(args.model)
        check_output_file(args.out, "--out")
    except (OSError, ValueError) as e:
        raise SystemExit(f"fastcl plot-similarity: {e}") from None
    encoder = Encoder.from_pretrained(
        args.model, pooling=args.pooling, max_length=args.max_length, device=args.device, show_progress=False
    )
    sim = cosine_matrix(encoder.encode(sentences))
    title = args.title if args.title is not None else f"{args.model} ({args.pooling})"
    out = plot_similarity(sentences, sim, args.out, title=title, annotate=args.annotate)
    print(f"wrote {out} ({len(sentences)} sentences)")
    return 0
