"""sentence-transformers' ``GISTEmbedLoss`` and ``CachedGISTEmbedLoss`` on fastcl's fused GIST loss.

Import them from :mod:`fastcl.integrations.sentence_transformers` (this module is its
private part and is imported by it).

Both take sentence-transformers 6.2's arguments, in its order, and do what it does: the
model embeds every column; the guide embeds the same texts without gradient (re-tokenized
from the decoded ``input_ids`` when its vocabulary differs or its ``max_seq_length`` is
shorter, ``must_retokenize``); each anchor's row leaves out every candidate the guide finds
more similar than the anchor's own positive (less the margin). The loss is
:func:`fastcl.losses.gist_loss`, whose filter runs inside the fused kernels: no ``B x N``
similarity, guide-similarity or mask matrix is built.

The cached form encodes the model's embeddings with :class:`fastcl.gradcache.GradCache`
(chunks without grad, the loss, then a chunk-by-chunk re-encoding with grad in
``backward()``, RNG replayed) and the guide chunk by chunk in the first pass, right after
the model's chunk, as sentence-transformers' ``CachedGISTEmbedLoss`` does (so dropout draws
the same masks); the guide is not run again in ``backward()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .. import losses as fl
from ..gradcache import GradCache
from ..losses.gist import check_margin
from . import sentence_transformers as _st

try:
    from sentence_transformers.util import batch_to_device
except ImportError as exc:  # pragma: no cover - imported through sentence_transformers.py, which says so
    raise ImportError("fastcl's GIST drop-ins need sentence-transformers: pip install 'fastcl[st]'") from exc

__all__ = ["GISTEmbedLoss", "CachedGISTEmbedLoss"]

CITATION = """
@misc{solatorio2024gistembed,
    title={GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning},
    author={Aivin V. Solatorio},
    year={2024},
    eprint={2402.16829},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
"""


def _is_static_embedding(module) -> bool:
    try:
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    except ImportError:  # pragma: no cover - older sentence-transformers
        return False
    return isinstance(module, StaticEmbedding)


def _has_static_embedding_input(model) -> bool:
    try:
        from sentence_transformers.base.losses.gradcache import has_static_embedding_input
    except ImportError:  # pragma: no cover - older sentence-transformers
        return _is_static_embedding(next(iter(model), None)) if isinstance(model, nn.Sequential) else False
    return has_static_embedding_input(model)


def _check_tokenizers(model, guide) -> None:
    """sentence-transformers' checks: both models have a ``transformers`` tokenizer."""
    from transformers import PreTrainedTokenizerBase

    if not hasattr(model, "tokenizer") or not hasattr(guide, "tokenizer"):
        raise ValueError("Both the training model and the guiding model must have a tokenizer attribute.")
    if not isinstance(model.tokenizer, PreTrainedTokenizerBase) or not isinstance(
        guide.tokenizer, PreTrainedTokenizerBase
    ):
        raise ValueError(
            "Both the training model and the guiding model must use a PreTrainedTokenizer from transformers."
        )


def _must_retokenize(model, guide) -> bool:
    """sentence-transformers' rule: another vocabulary, or a guide that reads fewer tokens."""
    return model.tokenizer.get_vocab() != guide.tokenizer.get_vocab() or guide.max_seq_length < model.max_seq_length


class _GuidedEmbedding(nn.Module):
    """GradCache's ``encode_fn``: the model's chunk embeddings and, while ``guide_out`` is a list
    (the first pass of one column), the guide's embeddings of the same chunk, appended to it.

    The guide runs right after the model's chunk, inside the same chunk, as in sentence-
    transformers' ``CachedGISTEmbedLoss``: each chunk's recorded RNG state is then the one that
    run had, and the re-encoding in ``backward()`` (``guide_out`` None) replays the model only.
    An ``nn.Module`` holding the model alone, so that GradCache checks (parameter versions,
    training flags) and restores (running statistics) the model's state and not the guide's,
    which it never re-encodes; ``guide_fn`` is a plain attribute, not a submodule.
    """

    def __init__(self, model: nn.Module, guide_fn):
        super().__init__()
        self.model = model
        self.guide_fn = guide_fn
        self.guide_out: list[Tensor] | None = None

    def forward(self, **features) -> Tensor:
        features = _st._trim_padding(features)
        inputs = dict(features)  # the model writes its outputs into the mapping it is given
        out = self.model(features)["sentence_embedding"]
        if self.guide_out is not None:
            self.guide_out.append(self.guide_fn(inputs))
        return out


class GISTEmbedLoss(_st._FastCLSTLoss):
    """GISTEmbed (Solatorio 2024): sentence-transformers 6.2's ``GISTEmbedLoss`` on fastcl's fused loss.

    Columns (anchor, positive, negative_1..negative_Q), ``Q >= 0`` (sentence-transformers'
    uncached loss takes at most one negative column, its cached one any number; both work
    here). Row ``i`` is the cross-entropy of ``[a_i.P | a_i.A | p_i.P | a_i.N] / temperature``
    with target ``p_i`` (cosine similarities; the anchor–anchor block with
    ``contrast_anchors``, the positive–positive one with ``contrast_positives``), where every
    candidate the guide scores above ``g_i - margin`` (``"absolute"``) or ``g_i - |g_i| *
    margin`` (``"relative"``) leaves the row, ``g_i`` the guide's similarity of ``a_i`` and
    ``p_i``; ``p_i`` itself never leaves. :func:`fastcl.losses.gist_loss` computes it without
    the ``B x N`` matrices.

    Args:
        model: the ``SentenceTransformer`` to train (None, with ``guide=None``: only
            :meth:`compute_loss_from_embeddings`).
        guide: the ``SentenceTransformer`` whose similarities select the in-batch negatives;
            run under ``torch.no_grad()``. With another vocabulary than the model's, or a shorter
            ``max_seq_length``, each column's ``input_ids`` are decoded with the model's
            tokenizer and re-tokenized for the guide (``must_retokenize``), as sentence-transformers does.
        temperature: divides the cosine similarities (0.01; ``scale = 1 / temperature``).
        margin_strategy: ``"absolute"`` or ``"relative"``.
        margin: the filter's margin (``"relative"`` needs ``margin >= 0``).
        contrast_anchors: include the anchor–anchor block.
        contrast_positives: include the positive–positive block.
        gather_across_devices: every rank's positives and negatives (and their guide
            embeddings) join every anchor's row (``process_group=torch.distributed.group.WORLD``).

    fastcl's keywords (see :mod:`fastcl.integrations.sentence_transformers`): ``process_group``,
    ``cross_device``, ``backend``, ``mini_batch_size`` / ``mini_batch_num_tokens`` /
    ``show_progress_bar`` (gradient caching, as :class:`CachedGISTEmbedLoss`), and
    ``matryoshka_dims``, ``matryoshka_weights``, ``n_dims_per_step`` (fused Matryoshka: every
    prefix of the model's embeddings, the guide's decisions shared by all prefixes, as
    sentence-transformers' ``MatryoshkaLoss`` around ``GISTEmbedLoss``).
    """

    layout = "(anchor, positive, negative_1, ..., negative_Q)"

    def __init__(
        self,
        model,
        guide,
        temperature: float = 0.01,
        margin_strategy: str = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        **kw,
    ):
        if "scale" in kw or "similarity_fct" in kw:
            raise TypeError(
                f"{type(self).__name__} takes temperature (cosine similarity only), not scale or similarity_fct"
            )
        super().__init__(
            model, None, _st.cos_sim, temperature=temperature, gather_across_devices=gather_across_devices, **kw
        )
        if (model is None) != (guide is None):
            raise ValueError(
                "give both model and guide, or neither (then only compute_loss_from_embeddings(embeddings, "
                "guide_embeddings) can be called)"
            )
        self.must_retokenize = False
        if model is not None:
            if not callable(guide):
                raise TypeError(f"guide must be a SentenceTransformer, got {type(guide).__name__}")
            if self.mini_batch_size is not None and _has_static_embedding_input(model):
                raise ValueError(
                    f"{type(self).__name__} with gradient caching is not compatible with a SentenceTransformer model "
                    "based on a StaticEmbedding. Consider using GISTEmbedLoss instead."
                )
            _check_tokenizers(model, guide)
            self.must_retokenize = _must_retokenize(model, guide)
            if self.must_retokenize:
                self.tokenizer = model.tokenizer
                if isinstance(model, nn.Sequential) and len(model) and _is_static_embedding(model[0]):
                    raise ValueError(
                        "If we must retokenize because the guide model has a different tokenizer, "
                        "then the Sentence Transformer model must not be based on a StaticEmbedding."
                    )
        self.guide = guide
        self.margin = check_margin(margin_strategy, margin)
        self.margin_strategy = margin_strategy
        self.contrast_anchors = bool(contrast_anchors)
        self.contrast_positives = bool(contrast_positives)

    # -- sentence-transformers' vocabulary ---------------------------------------------

    def get_config_dict(self) -> dict[str, Any]:
        """sentence-transformers' keys (``guide`` is the guide model), then fastcl's where not default."""
        cached = isinstance(self, CachedGISTEmbedLoss)
        config: dict[str, Any] = {"guide": self.guide, "temperature": self.temperature}
        if cached or self.mini_batch_size is not None:
            config |= {"mini_batch_size": self.mini_batch_size, "mini_batch_num_tokens": self.mini_batch_num_tokens}
        config |= {
            "margin_strategy": self.margin_strategy,
            "margin": self.margin,
            "contrast_anchors": self.contrast_anchors,
            "contrast_positives": self.contrast_positives,
            "gather_across_devices": self.gather_across_devices,
        }
        if self.backend != "auto":
            config["backend"] = self.backend
        if self.cross_device != "gather":
            config["cross_device"] = self.cross_device
        return config | self._matryoshka_config()

    @property
    def citation(self) -> str:
        return CITATION

    def extra_repr(self) -> str:  # the guide is printed as a child module
        return ", ".join(f"{k}={v!r}" for k, v in self.get_config_dict().items() if k != "guide")

    # -- forward -----------------------------------------------------------------------

    def forward(self, sentence_features: Iterable[Mapping[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        """``sentence_features``: one tokenized feature mapping per column; ``labels`` is ignored.

        Returns the 0-d mean loss over the batch's anchors.
        """
        if self.model is None:
            raise ValueError(
                f"{type(self).__name__} was built without a model and guide: call "
                "compute_loss_from_embeddings(embeddings, guide_embeddings)"
            )
        features = self._feature_mappings(sentence_features)
        embeddings, guide = self._embed_with_guide(features)
        guide = [g.to(e.device) for g, e in zip(guide, embeddings)]
        if self.mini_batch_size is not None and "calculate_loss" in vars(self):
            # sentence-transformers' MatryoshkaLoss wrapped calculate_loss(reps, reps_guided)
            return self._decorated_cached_loss(embeddings, [[g] for g in guide])
        return self.compute_loss_from_embeddings(embeddings, guide)

    def _guide_inputs(self, features: Mapping[str, Any]) -> Mapping[str, Any]:
        """The guide's features of one column (or chunk): the model's own, or, with
        ``must_retokenize``, the decoded texts tokenized by the guide (sentence-transformers' steps)."""
        if not self.must_retokenize:
            return features
        input_ids = features["input_ids"]
        if "cu_seq_lens_q" in features:  # flattened (padding-free) batch: one row per sequence
            flat = input_ids[0].tolist()
            cu = features["cu_seq_lens_q"].tolist()
            input_ids = [flat[start:end] for start, end in zip(cu[:-1], cu[1:])]
        decoded = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        return batch_to_device(self.guide.preprocess(decoded), self.guide.device)

    def _guide_chunk(self, features: dict) -> Tensor:
        with torch.no_grad():
            return self.guide(dict(self._guide_inputs(features)))["sentence_embedding"]

    def _embed_with_guide(self, features: list) -> tuple[list[Tensor], list[Tensor]]:
        """The model's embeddings of every column (with grad) and the guide's (without)."""
        if self.mini_batch_size is None:
            # The guide reads copies taken before the model writes its outputs into the mappings.
            guide_features = [dict(f) for f in features]
            embeddings = self._embed(features)
            with torch.no_grad():
                if self.must_retokenize:
                    guide_features = [dict(self._guide_inputs(f)) for f in features]
                if _st._st_embed_columns is not None:
                    guide = _st._st_embed_columns(self.guide, guide_features)
                else:  # pragma: no cover - older sentence-transformers
                    guide = [self.guide(f)["sentence_embedding"] for f in guide_features]
            return embeddings, [g.detach() for g in guide]
        ddp = self.model if isinstance(self.model, nn.parallel.DistributedDataParallel) else None
        encode = _GuidedEmbedding(self.model, self._guide_chunk)
        gc = GradCache(
            encode,
            self.mini_batch_size,
            chunk_tokens=self.mini_batch_num_tokens,
            ddp=ddp,
            progress=self.show_progress_bar,
        )
        embeddings, guide = [], []
        for f in features:
            encode.guide_out = []
            embeddings.append(gc(**{k: v for k, v in f.items() if k not in _st._MODEL_OUTPUTS}))
            guide.append(torch.cat(encode.guide_out))
        encode.guide_out = None  # the re-encoding in backward() runs the model only
        return embeddings, guide

    # -- the loss ----------------------------------------------------------------------

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], guide_embeddings: list[Tensor]) -> Tensor:  # type: ignore[override]
        """The loss from the columns' ``[B, d]`` model embeddings and the guide's ``[B, g]``
        embeddings of the same columns (computed without gradient)."""
        embeddings = list(embeddings)
        if isinstance(guide_embeddings, Tensor) or not isinstance(guide_embeddings, Iterable):
            raise TypeError("guide_embeddings must be a list of [B, g] tensors, one per column")
        guide = list(guide_embeddings)
        self._check_columns(len(embeddings))
        self._check_shapes(embeddings)
        if len(guide) != len(embeddings):
            raise ValueError(
                f"{type(self).__name__}: {len(embeddings)} columns of embeddings but {len(guide)} of guide embeddings"
            )
        rows = getattr(embeddings[0], "shape", (None,))[0]
        for i, g in enumerate(guide):
            what = f"the guide embeddings of column {i} ({self._column_name(i)})"
            if not isinstance(g, Tensor) or g.dim() != 2:
                raise ValueError(f"{what} must be a [B, g] tensor, got {getattr(g, 'shape', type(g).__name__)}")
            if g.shape[0] != rows:
                raise ValueError(f"{what} have {g.shape[0]} rows, the model's embeddings {rows}: one per text")
            if g.requires_grad:
                raise ValueError(
                    f"{what} require grad: the guide gets no gradient (compute them under torch.no_grad())"
                )
            if g.shape[1] != guide[0].shape[1]:
                raise ValueError(f"{what} are {g.shape[1]} wide, column 0's {guide[0].shape[1]}: one guide, one width")
        anchor, positive, *negatives = embeddings
        ga, gp, *gn = guide
        return fl.gist_loss(
            anchor,
            positive,
            _st._stack(negatives),
            guide=(ga, gp) if not gn else (ga, gp, torch.stack(gn, dim=1)),
            margin_strategy=self.margin_strategy,
            margin=self.margin,
            contrast_anchors=self.contrast_anchors,
            contrast_positives=self.contrast_positives,
            **self._options(),
        )

    def calculate_loss(  # type: ignore[override]
        self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], *, with_backward: bool = False
    ) -> Tensor:
        """The loss of per-column lists of embedding chunks and of the guide's
        (sentence-transformers' ``CachedGISTEmbedLoss.calculate_loss``, the hook its ``MatryoshkaLoss``
        wraps). With ``with_backward`` the gradient goes into the chunks' ``.grad`` and the
        value comes back detached."""
        if len(reps) != len(reps_guided):
            raise ValueError("reps and reps_guided must have the same length")
        loss = self.compute_loss_from_embeddings(
            [torch.cat(list(chunks)) for chunks in reps], [torch.cat(list(chunks)) for chunks in reps_guided]
        )
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss


class CachedGISTEmbedLoss(GISTEmbedLoss):
    """:class:`GISTEmbedLoss` with gradient caching: sentence-transformers 6.2's ``CachedGISTEmbedLoss``.

    The model's embeddings are computed in chunks of ``mini_batch_size`` rows without grad
    (:class:`fastcl.gradcache.GradCache`), the guide's chunk by chunk in the same pass; the
    fused loss runs once on the whole batch (it needs no ``B x N`` logits, so unlike
    sentence-transformers it is not chunked by anchors); ``backward()`` re-encodes the model's
    chunks with grad, dropout masks replayed. Values and gradients equal the uncached loss.

    Args:
        model: the ``SentenceTransformer`` to train.
        guide: the guide ``SentenceTransformer`` (see :class:`GISTEmbedLoss`).
        temperature: divides the cosine similarities (0.01).
        mini_batch_size: rows per chunk (32).
        mini_batch_num_tokens: pack the chunks by non-padding tokens instead, at most this many per chunk.
        show_progress_bar: tqdm bars over the chunks.
        margin_strategy: ``"absolute"`` or ``"relative"``.
        margin: the filter's margin.
        contrast_anchors: include the anchor–anchor block.
        contrast_positives: include the positive–positive block.
        gather_across_devices: every rank's candidates join every anchor's row.
    """

    def __init__(
        self,
        model,
        guide,
        temperature: float = 0.01,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        show_progress_bar: bool = False,
        margin_strategy: str = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        **kw,
    ):
        if mini_batch_size is None:
            raise ValueError(f"{type(self).__name__} needs a mini_batch_size (int)")
        super().__init__(
            model,
            guide,
            temperature,
            margin_strategy,
            margin,
            contrast_anchors,
            contrast_positives,
            gather_across_devices,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            show_progress_bar=show_progress_bar,
            **kw,
        )
