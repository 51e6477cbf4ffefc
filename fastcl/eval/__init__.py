"""Evaluation of sentence encoders: STS (Spearman of cosine) and SentEval transfer tasks.

    from fastcl.eval import Encoder, evaluate_sts, evaluate_transfer
    enc = Encoder.from_pretrained("path", pooling="mean")
    sts = evaluate_sts(enc, ["sts12", "stsb"])            # {task: STSResult}, .score x 100
    clf = evaluate_transfer(enc, ["mr"], config="fast")   # {task: TransferResult}, .acc %

Pooling lives in :mod:`fastcl.pooling` (shared with the trainers). Data comes from the
staged data directory (``FASTCL_DATA_DIR``); see docs/eval.md for protocols and numbers.
"""

from fastcl.eval.encode import Encoder, encode
from fastcl.eval.metrics import AGGREGATIONS, pearson, spearman
from fastcl.eval.sts import PROTOCOLS, STSResult, evaluate_sts
from fastcl.eval.sts_data import STS_TASKS, STSSubset, STSTask, load_sts, load_sts_hf
from fastcl.eval.transfer import TransferResult, evaluate_transfer
from fastcl.eval.transfer_data import TRANSFER_TASKS, load_transfer

__all__ = [
    "AGGREGATIONS",
    "Encoder",
    "PROTOCOLS",
    "STSResult",
    "STSSubset",
    "STSTask",
    "STS_TASKS",
    "TRANSFER_TASKS",
    "TransferResult",
    "encode",
    "evaluate_sts",
    "evaluate_transfer",
    "load_sts",
    "load_sts_hf",
    "load_transfer",
    "pearson",
    "spearman",
]
