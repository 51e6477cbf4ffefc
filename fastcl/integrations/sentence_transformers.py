"""fastcl's fused losses as sentence-transformers losses: change one import, keep the trainer.

::

    # was: from sentence_transformers.losses import MultipleNegativesRankingLoss
    from fastcl.integrations.sentence_transformers import MultipleNegativesRankingLoss

    loss = MultipleNegativesRankingLoss(model)          # scale=20.0, i.e. temperature 0.05
    SentenceTransformerTrainer(model=model, train_dataset=ds, loss=loss).train()

Every class here has sentence-transformers' loss interface: it is constructed with the
``SentenceTransformer`` model and called by the trainer as ``loss(sentence_features,
labels)``, where ``sentence_features`` holds one tokenized feature dict per input column of
the dataset, in column order (a dict or the ``BatchEncoding`` of ``model.preprocess()``:
any mapping), and ``labels`` is ignored (the layout is given by the columns) except by
``SupConLabelsLoss``, whose positives are the rows with the same label. ``compute_loss_from_embeddings(embeddings, labels=None)`` takes the ``[B, d]``
embeddings of the columns directly. The loss itself is fastcl's fused primitive
(``fastcl.losses``): it never builds the ``B x B(1+Q)`` logits.

Column layouts (``B`` rows per column, every row needs every column):

=====================================  ==============================================
class                                  columns
=====================================  ==============================================
``MultipleNegativesRankingLoss``       anchor, positive, negative_1 .. negative_Q (Q >= 0)
``CachedMultipleNegativesRankingLoss`` same, with gradient caching (``mini_batch_size=32``)
``InfoNCELoss``                        anchor, positive (SimCSE-unsup: the same sentence twice)
``SupMPNLoss``                         anchor, ``num_positives`` positives, Q >= 0 negatives
``SupConLoss``                         anchor, ``num_positives`` positives, Q >= 0 negatives
``SupConLabelsLoss``                   1..V views of a sample and a ``label`` column
``GISTEmbedLoss``                      anchor, positive, negative_1 .. negative_Q (Q >= 0), and a guide model
``CachedGISTEmbedLoss``                same, with gradient caching (``mini_batch_size=32``)
=====================================  ==============================================

The GIST pair (``GISTEmbedLoss(model, guide, temperature=0.01, margin_strategy, margin,
contrast_anchors, contrast_positives, gather_across_devices)``) takes sentence-transformers
6.2's arguments in its order, not ``scale``/``similarity_fct`` (cosine only), and
``compute_loss_from_embeddings(embeddings, guide_embeddings)``; they live in ``_st_gist``.

Temperature. sentence-transformers multiplies similarities by ``scale``; fastcl divides them
by ``temperature``: ``scale = 1 / temperature``. Give one of ``scale=`` (sentence-
transformers' name and default, ``20.0``) or ``temperature=`` (fastcl's name); the default
``scale=20.0`` is ``temperature=0.05``, SimCSE's value. ``loss.scale`` and
``loss.temperature`` read (and set) the same number.

Similarity. ``similarity_fct`` accepts sentence-transformers' ``util.cos_sim`` (default) and
``util.dot_score`` (or ``"cos"`` / ``"dot"``): fastcl computes similarities inside its
fused kernel, so an arbitrary callable cannot be honoured and raises ``ValueError``.

Where the losses coincide. ``MultipleNegativesRankingLoss`` (and the cached one) equals
sentence-transformers 6.2's ``MultipleNegativesRankingLoss`` with the same ``directions``,
``partition_mode``, ``hardness_mode`` and ``hardness_strength`` (value and gradients on the
same embeddings; the candidate order differs, which a log-sum-exp does not see).
``InfoNCELoss(symmetric=True)`` equals it with ``directions=("query_to_doc",
"doc_to_query"), partition_mode="per_direction"`` on (anchor, positive) pairs.

Gradient caching. ``mini_batch_size=`` (any class; ``CachedMultipleNegativesRankingLoss``
defaults to 32, like sentence-transformers' cached loss) encodes each column with
:class:`fastcl.gradcache.GradCache`: chunks of ``mini_batch_size`` rows without grad, the
fused loss, then a chunk-by-chunk re-encoding with grad during ``backward()`` (dropout
masks replayed), so encoder memory is that of one chunk. Values and gradients equal the
uncached loss. ``mini_batch_num_tokens=`` packs the chunks by non-padding tokens instead,
as sentence-transformers' cached losses do. Inside sentence-transformers' ``MatryoshkaLoss`` / ``Matryoshka2dLoss``:
the uncached losses work as any loss (the model's forward is patched); the cached ones
follow sentence-transformers' gradient-cache protocol (``uses_gradient_cache`` and
``calculate_loss``, which ``MatryoshkaLoss`` wraps to run one loss per truncated dimension
on the cached embeddings), with the gradients of sentence-transformers' cached MNRL inside
it. ``AdaptiveLayerLoss`` works with the uncached losses and, like sentence-transformers
for its own cached losses, warns at construction for the cached ones.
Feature tensors must all be indexed by row (``input_ids``, ``attention_mask``, ...).

Cross-device negatives. ``gather_across_devices=True`` (sentence-transformers' flag) means
``process_group=torch.distributed.group.WORLD`` in fastcl (resolved at each call, so the
loss may be built before the process group exists; a no-op outside a multi-process run).
Every anchor then sees every rank's candidates; each rank's loss and gradients are those
of sentence-transformers' ``gather_across_devices=True``, and after DDP's averaging the
parameter gradients are those of the global batch (see ``fastcl.distributed``). An explicit
``process_group=`` overrides the flag. ``cross_device="ring"`` (fastcl's) passes the other
ranks' candidates around a ring instead of all-gathering them (docs/distributed.md).

Matryoshka, fused. ``matryoshka_dims=(768, 512, 256, 128, 64)`` (with optional
``matryoshka_weights`` and ``n_dims_per_step``) on any class here is sentence-transformers'
``MatryoshkaLoss(model, loss, matryoshka_dims, matryoshka_weights, n_dims_per_step)``
around it, but computed in one fused pass over ``d`` (:mod:`fastcl.matryoshka`): no K
loss calls, no K backward passes into cached embeddings. Dims are kept in descending
order and ``n_dims_per_step`` draws with Python's ``random`` as sentence-transformers does.
sentence-transformers' ``MatryoshkaLoss`` L2-normalises every truncated embedding before
the inner loss, so with dims ``similarity_fct=dot_score`` is cosine similarity there, and
here too (``fastcl.losses`` with ``similarity="dot"`` keeps raw prefix dot products).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor, nn

try:
    from sentence_transformers.util import cos_sim, dot_score
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "fastcl.integrations.sentence_transformers needs sentence-transformers: pip install 'fastcl[st]'"
    ) from exc

try:  # sentence-transformers >= 6: like-shaped candidate columns share one forward pass
    from sentence_transformers.base.losses.merged_forward import embed_columns as _st_embed_columns
except ImportError:  # pragma: no cover - older sentence-transformers
    _st_embed_columns = None

from .. import _checks
from .. import losses as fl
from .. import matryoshka as _matryoshka
from ..gradcache import GradCache
from ..losses._shared import CROSS_DEVICE
from ..losses.mnrl import check_mnrl_options
from ..ops.dispatch import NAMES as BACKENDS

__all__ = [
    "MultipleNegativesRankingLoss",
    "CachedMultipleNegativesRankingLoss",
    "MultipleNegativesSymmetricRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
    "InfoNCELoss",
    "SupMPNLoss",
    "SupConLoss",
    "SupConLabelsLoss",
    "GISTEmbedLoss",
    "CachedGISTEmbedLoss",
    "DEFAULT_SCALE",
]

logger = logging.getLogger(__name__)

DEFAULT_SCALE = 20.0  # sentence-transformers' default scale = 1 / fastcl's default temperature 0.05


# what a SentenceTransformer's modules write into the feature mapping they are given
_MODEL_OUTPUTS = ("token_embeddings", "sentence_embedding", "all_layer_embeddings")


def _similarity_name(similarity_fct) -> str:
    if isinstance(similarity_fct, str) and similarity_fct in ("cos", "dot"):
        return similarity_fct
    if similarity_fct is cos_sim:
        return "cos"
    if similarity_fct is dot_score:
        return "dot"
    raise ValueError(
        f"similarity_fct={similarity_fct!r}: fastcl computes similarities inside its fused kernel and "
        "supports only sentence_transformers.util.cos_sim, util.dot_score, 'cos' or 'dot'"
    )


def _positive_float(name: str, value) -> float:
    """A finite number > 0: Python's, NumPy's or a 0-d tensor's value (sentence-transformers takes
    all three). A tensor that requires grad is refused: its value would be taken, its gradient lost."""
    if isinstance(value, Tensor) and value.dim() == 0 and value.is_floating_point():
        if value.requires_grad:
            raise ValueError(
                f"{name} is a tensor that requires grad: these classes keep a fixed {name}; for a learnable "
                "temperature use fastcl.losses with a temperature tensor (or learn_temperature=True)"
            )
        value = float(value)
    if not _checks.is_real_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _resolve_temperature(scale, temperature) -> float:
    if scale is not None and temperature is not None:
        raise ValueError("give scale or temperature, not both (scale = 1 / temperature)")
    if temperature is not None:
        return _positive_float("temperature", temperature)
    return 1.0 / _positive_float("scale", DEFAULT_SCALE if scale is None else scale)


class _SentenceEmbedding:
    """``encode_fn`` for GradCache: a feature-dict chunk -> its ``[c, d]`` sentence embeddings.

    Trailing padding columns that no row of the chunk uses are cut first (as
    sentence-transformers' cached losses do), so a chunk of short sentences is not encoded
    at the width of the batch's longest one. Deterministic, hence identical in both passes.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, **features) -> Tensor:
        return self.model(_trim_padding(features))["sentence_embedding"]


def _trim_padding(features: dict) -> dict:
    """``features`` without the trailing padding columns that no row uses (``attention_mask``)."""
    mask = features.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[1] > 1:
        width = mask.shape[1]
        used = mask.bool().any(0).nonzero()
        end = int(used.max()) + 1 if used.numel() else width
        if end < width:
            features = {
                k: v[:, :end] if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[1] == width else v
                for k, v in features.items()
            }
    return features


class _FastCLSTLoss(nn.Module):
    """Shared machinery: columns -> embeddings (plain or gradient-cached) -> a fastcl loss.

    Args:
        model: the ``SentenceTransformer`` (the trainer may swap in its DDP-wrapped form);
            None allows only :meth:`compute_loss_from_embeddings`.
        scale: sentence-transformers' logit scale, ``1 / temperature``; default 20.0.
        similarity_fct: ``util.cos_sim`` (default), ``util.dot_score``, ``"cos"`` or ``"dot"``.
        temperature: fastcl's name for ``1 / scale`` (give one of the two).
        gather_across_devices: every rank's candidates join every anchor's denominator
            (``process_group=torch.distributed.group.WORLD``).
        process_group: an explicit ``torch.distributed`` group; overrides the flag.
        cross_device: ``"gather"`` (default) or ``"ring"``: how the group's candidates reach
            every anchor (``fastcl.losses``; the ring's memory per rank is constant in the world size).
        mini_batch_size: encode with fastcl's gradient cache in chunks of this many rows
            (None: one ordinary forward per column, as sentence-transformers' uncached losses).
        mini_batch_num_tokens: with the gradient cache, pack its chunks by non-padding tokens
            instead (``attention_mask``), at most this many per chunk (a longer sentence is a
            chunk of its own), as sentence-transformers' cached losses; ``mini_batch_size`` is
            then not used.
        show_progress_bar: tqdm bars over the cached chunks.
        backend: fastcl backend (``"auto"``, ``"torch"``, ``"triton"``, ...; see ``fastcl.losses``).
        matryoshka_dims, matryoshka_weights: train every prefix of the embedding with this
            loss, summed with the weights (default 1): sentence-transformers' ``MatryoshkaLoss``.
        n_dims_per_step: with dims, use that many randomly drawn dims per step (-1: all).
    """

    min_columns = 2
    max_columns: int | None = None
    layout = "(anchor, positive)"

    def __init__(
        self,
        model: nn.Module,
        scale: float | None = None,
        similarity_fct=cos_sim,
        *,
        temperature: float | None = None,
        gather_across_devices: bool = False,
        process_group=None,
        cross_device: str = "gather",
        mini_batch_size: int | None = None,
        mini_batch_num_tokens: int | None = None,
        show_progress_bar: bool = False,
        backend: str = "auto",
        matryoshka_dims=None,
        matryoshka_weights=None,
        n_dims_per_step: int = -1,
    ):
        super().__init__()
        if model is not None and not callable(model):  # None: compute_loss_from_embeddings only, as in ST
            raise TypeError(f"model must be a SentenceTransformer, got {type(model).__name__}")
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; expected 'auto' or one of {BACKENDS}")
        if mini_batch_size is not None and (
            isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1
        ):
            raise ValueError(f"mini_batch_size must be a positive int or None, got {mini_batch_size!r}")
        if mini_batch_num_tokens is not None and (
            isinstance(mini_batch_num_tokens, bool)
            or not isinstance(mini_batch_num_tokens, int)
            or mini_batch_num_tokens < 1
        ):
            raise ValueError(f"mini_batch_num_tokens must be a positive int or None, got {mini_batch_num_tokens!r}")
        if mini_batch_num_tokens is not None and mini_batch_size is None:  # it would be ignored: say so
            raise ValueError(
                "mini_batch_num_tokens packs the gradient cache's chunks: give mini_batch_size too "
                "(or use CachedMultipleNegativesRankingLoss)"
            )
        if not isinstance(gather_across_devices, bool):
            raise TypeError(f"gather_across_devices must be a bool, got {gather_across_devices!r}")
        self.model = model
        self.temperature = _resolve_temperature(scale, temperature)
        self.similarity = _similarity_name(similarity_fct)
        self.gather_across_devices = gather_across_devices
        self.process_group = process_group
        _checks.check_choice("cross_device", cross_device, CROSS_DEVICE)
        self.cross_device = cross_device
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.show_progress_bar = show_progress_bar
        self.backend = backend
        checked = _matryoshka.check(matryoshka_dims, matryoshka_weights)  # d is checked per call
        if checked is not None:  # sentence-transformers keeps them in descending order
            checked = tuple(zip(*sorted(zip(*checked), key=lambda dw: dw[0], reverse=True)))
        if isinstance(n_dims_per_step, bool) or not isinstance(n_dims_per_step, int):
            raise TypeError(f"n_dims_per_step must be an int, got {n_dims_per_step!r}")
        self.matryoshka_dims, self.matryoshka_weights = checked if checked is not None else (None, None)
        self.n_dims_per_step = n_dims_per_step

    # -- sentence-transformers' vocabulary ---------------------------------------------

    @property
    def scale(self) -> float:
        """sentence-transformers' logit scale: ``1 / temperature``."""
        return 1.0 / self.temperature

    @scale.setter
    def scale(self, value: float) -> None:
        self.temperature = 1.0 / _positive_float("scale", value)

    def get_config_dict(self) -> dict[str, Any]:
        """Hyperparameters, as sentence-transformers' losses report them (model cards)."""
        return (
            {
                "scale": self.scale,
                "temperature": self.temperature,
                "similarity_fct": {"cos": "cos_sim", "dot": "dot_score"}[self.similarity],
                "gather_across_devices": self.gather_across_devices,
                "mini_batch_size": self.mini_batch_size,
                "mini_batch_num_tokens": self.mini_batch_num_tokens,
                "backend": self.backend,
            }
            | ({"cross_device": self.cross_device} if self.cross_device != "gather" else {})
            | self._matryoshka_config()
            | self._extra_config()
        )

    def _matryoshka_config(self) -> dict[str, Any]:
        if self.matryoshka_dims is None:
            return {}
        n = self.n_dims_per_step
        return {
            "matryoshka_dims": self.matryoshka_dims,
            "matryoshka_weights": self.matryoshka_weights,
            "n_dims_per_step": n,
        }

    def _extra_config(self) -> dict[str, Any]:
        return {}

    # -- forward -----------------------------------------------------------------------

    def forward(self, sentence_features: Iterable[Mapping[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        """``sentence_features``: one tokenized feature mapping per column (a dict, or the
        ``BatchEncoding`` of ``model.preprocess()`` / ``model.tokenize()``); ``labels`` is used
        only by :class:`SupConLabelsLoss`.

        Returns the 0-d mean loss over the batch's anchors (float32 for float32 embeddings).
        """
        features = self._feature_mappings(sentence_features)
        embeddings = self._embed(features)
        if self.mini_batch_size is not None and "calculate_loss" in vars(self):
            return self._decorated_cached_loss(embeddings, labels)
        return self.compute_loss_from_embeddings(embeddings, labels)

    def _feature_mappings(self, sentence_features: Iterable[Mapping[str, Tensor]]) -> list[MutableMapping]:
        """The columns' feature mappings, checked: as many as the layout takes, each a mapping."""
        features = list(sentence_features)
        self._check_columns(len(features))
        for i, f in enumerate(features):
            # any Mapping: sentence-transformers 6's model.preprocess()/tokenize() return a
            # transformers BatchEncoding (a UserDict, not a dict)
            if not isinstance(f, Mapping):
                raise TypeError(
                    f"sentence_features[{i}] must be a tokenized feature mapping (dict, BatchEncoding), "
                    f"got {type(f).__name__}"
                )
        # The model writes its outputs into the feature mapping, and sentence-transformers'
        # AdaptiveLayerLoss relies on that (it hands every layer's embeddings between loss
        # calls through these very objects): keep mutable ones (dict, BatchEncoding) as they
        # are, as sentence-transformers' own losses do; copy only read-only mappings.
        return [f if isinstance(f, MutableMapping) else dict(f) for f in features]

    # -- sentence-transformers' gradient-cache protocol (MatryoshkaLoss, AdaptiveLayerLoss) --

    @property
    def uses_gradient_cache(self) -> bool:
        """True for the cached form: the re-encoding runs in ``backward()``.

        sentence-transformers reads this flag: ``MatryoshkaLoss`` then wraps
        :meth:`calculate_loss` (one loss per truncated dimension on the cached embeddings)
        instead of patching the model's forward, and ``AdaptiveLayerLoss`` warns at
        construction that it cannot work, as for sentence-transformers' own cached losses.
        """
        return self.mini_batch_size is not None

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        """The loss of per-column lists of embedding chunks (sentence-transformers' cached-loss hook).

        With ``with_backward`` the gradient goes into the chunks' ``.grad`` and the value
        comes back detached, as sentence-transformers' cached losses do.
        """
        loss = self.compute_loss_from_embeddings([torch.cat(list(chunks)) for chunks in reps], labels)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def _decorated_cached_loss(self, embeddings: list[Tensor], labels) -> Tensor:
        """Cached forward when sentence-transformers replaced :meth:`calculate_loss` (MatryoshkaLoss).

        The wrapper needs leaf embeddings whose ``.grad`` it fills (one backward per
        dimension); their summed gradient then flows into the GradCache outputs through a
        zero-valued surrogate, so the chunks are re-encoded once, in the real ``backward()``.
        """
        if not torch.is_grad_enabled():
            return self.calculate_loss([[e] for e in embeddings], labels)
        leaves = [[e.detach().requires_grad_()] for e in embeddings]
        value = self.calculate_loss(leaves, labels, with_backward=True)
        terms = [(e * leaf[0].grad).sum() for e, leaf in zip(embeddings, leaves) if leaf[0].grad is not None]
        if not terms:
            return value
        surrogate = torch.stack(terms).sum()
        return value.detach().to(surrogate.dtype) + (surrogate - surrogate.detach())

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        """The loss from the columns' ``[B, d]`` embeddings (same shape, dtype and device)."""
        embeddings = list(embeddings)
        self._check_columns(len(embeddings))
        self._check_shapes(embeddings)
        return self._loss(embeddings)

    def _column_name(self, i: int) -> str:
        """What column ``i`` holds, in :attr:`layout`'s words."""
        return "anchor" if i == 0 else "positive" if i == 1 else f"negative_{i - 1}"

    def _check_shapes(self, embeddings: list[Tensor]) -> None:
        """Every column is ``[B, d]`` with one ``B`` and ``d``: a mismatch is reported by column
        (the fastcl loss would name its own stacked tensors instead)."""
        first = tuple(getattr(embeddings[0], "shape", ()))
        for i, e in enumerate(embeddings[1:], start=1):
            shape = getattr(e, "shape", None)
            if shape is not None and tuple(shape) != first:
                raise ValueError(
                    f"{type(self).__name__}: every column's embeddings must have one shape [B, d]; column 0 "
                    f"({self._column_name(0)}) is {list(first)}, column {i} ({self._column_name(i)}) is {list(shape)}"
                )

    def _check_columns(self, n: int) -> None:
        if n < self.min_columns or (self.max_columns is not None and n > self.max_columns):
            want = (
                f"{self.min_columns}"
                if self.max_columns == self.min_columns
                else (
                    f"at least {self.min_columns}"
                    if self.max_columns is None
                    else f"{self.min_columns}..{self.max_columns}"
                )
            )
            raise ValueError(f"{type(self).__name__} takes {want} columns {self.layout}, got {n}")

    def _embed(self, features: list[dict]) -> list[Tensor]:
        if self.mini_batch_size is None:
            if _st_embed_columns is not None:
                return _st_embed_columns(self.model, features)
            return [self.model(f)["sentence_embedding"] for f in features]
        # One GradCache per step: every column hangs off one flush node, so the backward
        # re-encodes all columns' chunks in one pass (and syncs DDP once, after the last).
        ddp = self.model if isinstance(self.model, nn.parallel.DistributedDataParallel) else None
        gc = GradCache(
            _SentenceEmbedding(self.model),
            self.mini_batch_size,
            chunk_tokens=self.mini_batch_num_tokens,
            ddp=ddp,
            progress=self.show_progress_bar,
        )
        # A feature mapping that went through the model before holds its outputs too (the
        # model writes them into it): encode from the tokenizer's inputs only.
        return [gc(**{k: v for k, v in f.items() if k not in _MODEL_OUTPUTS}) for f in features]

    def _options(self) -> dict[str, Any]:
        """The fastcl loss's keyword arguments for one step (draws the step's dims)."""
        dims, weights = _matryoshka.sample(self.matryoshka_dims, self.matryoshka_weights, self.n_dims_per_step, random)
        return dict(
            temperature=self.temperature,
            backend=self.backend,
            process_group=self._group(),
            cross_device=self.cross_device,
            # ST's MatryoshkaLoss normalises each prefix: its dot_score is then the cosine
            similarity="cos" if dims is not None else self.similarity,
            matryoshka_dims=dims,
            matryoshka_weights=weights,
        )

    def _group(self):
        if self.process_group is not None:
            return self.process_group
        dist = torch.distributed
        if self.gather_across_devices and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None

    def _loss(self, embeddings: list[Tensor]) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.get_config_dict().items())


def _stack(columns: list[Tensor]) -> Tensor | None:
    """``Q`` columns of ``[B, d]`` -> ``[B, Q, d]`` (None for Q = 0)."""
    return torch.stack(columns, dim=1) if columns else None


class MultipleNegativesRankingLoss(_FastCLSTLoss):
    """MNRL / SimCSE-sup with fastcl's fused kernel: columns (anchor, positive, negative_1..Q).

    ``loss_i = -s(a_i, p_i) * scale + LSE_c s(a_i, c) * scale`` over every positive and every
    hard negative of the batch (:func:`fastcl.losses.mnrl_loss`); the mean over anchors.
    Drop-in for ``sentence_transformers.losses.MultipleNegativesRankingLoss``, including
    sentence-transformers 6's ``directions`` (``query_to_doc``, ``query_to_query``,
    ``doc_to_query``, ``doc_to_doc``), ``partition_mode`` (``joint``, ``per_direction``),
    ``hardness_mode`` (``in_batch_negatives``, ``hard_negatives``, ``all_negatives``) and
    ``hardness_strength``, with the same semantics (:func:`fastcl.losses.mnrl_directions_loss`), also with
    ``gather_across_devices``. See the module docstring for the other arguments.
    """

    layout = "(anchor, positive, negative_1, ..., negative_Q)"

    def __init__(
        self,
        model,
        scale=None,
        similarity_fct=cos_sim,
        *,
        directions=("query_to_doc",),
        partition_mode: str = "joint",
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        **kw,
    ):
        super().__init__(model, scale, similarity_fct, **kw)
        self.directions = check_mnrl_options(directions, partition_mode, hardness_mode, hardness_strength)
        self.partition_mode = partition_mode
        self.hardness_mode = hardness_mode
        self.hardness_strength = float(hardness_strength)
        if hardness_mode is not None and hardness_strength == 0:
            logger.warning(
                f"hardness_mode={hardness_mode!r} is set but hardness_strength=0.0, so hardness weighting has no "
                "effect. Set hardness_strength to a positive value to enable it."
            )

    def _extra_config(self):
        return {
            "directions": self.directions,
            "partition_mode": self.partition_mode,
            "hardness_mode": self.hardness_mode,
            "hardness_strength": self.hardness_strength,
        }

    def _loss(self, embeddings):
        anchor, positive, *negatives = embeddings
        return fl.mnrl_loss(
            anchor,
            positive,
            _stack(negatives),
            directions=self.directions,
            partition_mode=self.partition_mode,
            hardness_mode=self.hardness_mode,
            hardness_strength=self.hardness_strength,
            **self._options(),
        )


class _Cached:
    """The cached form of the loss class it precedes: ``mini_batch_size=32`` by default, never None."""

    def __init__(self, model, scale=None, similarity_fct=cos_sim, *, mini_batch_size: int = 32, **kw):
        if mini_batch_size is None:
            raise ValueError(f"{type(self).__name__} needs a mini_batch_size (int)")
        super().__init__(model, scale, similarity_fct, mini_batch_size=mini_batch_size, **kw)


class CachedMultipleNegativesRankingLoss(_Cached, MultipleNegativesRankingLoss):
    """:class:`MultipleNegativesRankingLoss` with gradient caching, ``mini_batch_size=32`` by default.

    Drop-in for ``sentence_transformers.losses.CachedMultipleNegativesRankingLoss``: encoder
    memory is that of one mini-batch, the loss needs no ``B x N`` logits either, and values
    and gradients equal the uncached loss.
    """


class MultipleNegativesSymmetricRankingLoss(MultipleNegativesRankingLoss):
    """sentence-transformers' ``MultipleNegativesSymmetricRankingLoss`` (deprecated there): MNRL with
    ``directions=("query_to_doc", "doc_to_query")`` and ``partition_mode="per_direction"``, which is
    what sentence-transformers 6 made of it (hard negatives join the query-to-document term only).
    """

    def __init__(self, model, scale=None, similarity_fct=cos_sim, **kw):
        fixed = sorted({"directions", "partition_mode"} & set(kw))
        if fixed:
            raise TypeError(f"{type(self).__name__} fixes {fixed}; MultipleNegativesRankingLoss takes them")
        super().__init__(
            model,
            scale,
            similarity_fct,
            directions=("query_to_doc", "doc_to_query"),
            partition_mode="per_direction",
            **kw,
        )


class CachedMultipleNegativesSymmetricRankingLoss(_Cached, MultipleNegativesSymmetricRankingLoss):
    """:class:`MultipleNegativesSymmetricRankingLoss` with gradient caching, ``mini_batch_size=32`` by
    default: sentence-transformers' (deprecated) ``CachedMultipleNegativesSymmetricRankingLoss``."""


class InfoNCELoss(_FastCLSTLoss):
    """InfoNCE / SimCSE-unsup: columns (anchor, positive); ``symmetric=True`` adds positive -> anchor.

    For SimCSE-unsup put the same sentence in both columns: the two forward passes draw
    different dropout masks. :func:`fastcl.losses.infonce_loss`.
    """

    max_columns = 2

    def __init__(self, model, scale=None, similarity_fct=cos_sim, *, symmetric: bool = False, **kw):
        super().__init__(model, scale, similarity_fct, **kw)
        if not isinstance(symmetric, bool):
            raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
        self.symmetric = symmetric

    def _extra_config(self):
        return {"symmetric": self.symmetric}

    def _loss(self, embeddings):
        anchor, positive = embeddings
        return fl.infonce_loss(anchor, positive, symmetric=self.symmetric, **self._options())


class _MultiPositiveLoss(_FastCLSTLoss):
    """Columns (anchor, ``num_positives`` positives, Q >= 0 negatives)."""

    layout = "(anchor, positive_1..positive_P, negative_1..negative_Q)"

    def __init__(self, model, scale=None, similarity_fct=cos_sim, *, num_positives: int = 1, **kw):
        super().__init__(model, scale, similarity_fct, **kw)
        if isinstance(num_positives, bool) or not isinstance(num_positives, int) or num_positives < 1:
            raise ValueError(f"num_positives must be a positive int, got {num_positives!r}")
        self.num_positives = num_positives
        self.min_columns = 1 + num_positives

    def _column_name(self, i: int) -> str:
        P = self.num_positives
        return "anchor" if i == 0 else f"positive_{i}" if i <= P else f"negative_{i - P}"

    def _split(self, embeddings):
        P = self.num_positives
        return embeddings[0], torch.stack(embeddings[1 : 1 + P], dim=1), _stack(embeddings[1 + P :])

    def _extra_config(self):
        return {"num_positives": self.num_positives}


class SupMPNLoss(_MultiPositiveLoss):
    """SupMPN (Dehghan & Amasyali 2022): several positives and hard negatives per anchor.

    Columns: anchor, then ``num_positives`` positive columns, then any number of negative
    columns. Each own positive is contrasted against every candidate of the batch except
    the anchor's other positives (:func:`fastcl.losses.supmpn_loss`);
    ``own_positives="zero_logit"`` reproduces the authors' released code.
    """

    def __init__(self, model, scale=None, similarity_fct=cos_sim, *, own_positives: str = "exclude", **kw):
        super().__init__(model, scale, similarity_fct, **kw)
        if own_positives not in fl.OWN_POSITIVES:
            raise ValueError(f"own_positives={own_positives!r}; expected one of {fl.OWN_POSITIVES}")
        self.own_positives = own_positives

    def _extra_config(self):
        return super()._extra_config() | {"own_positives": self.own_positives}

    def _loss(self, embeddings):
        anchor, positives, negatives = self._split(embeddings)
        return fl.supmpn_loss(anchor, positives, negatives, own_positives=self.own_positives, **self._options())


class SupConLoss(_MultiPositiveLoss):
    """Supervised contrastive loss (Khosla et al. 2020, L_out) over column-given positives.

    Columns as :class:`SupMPNLoss`; each own positive is contrasted against every candidate
    of the batch, own positives included (:func:`fastcl.losses.supcon_loss`). With
    ``num_positives=1`` this is :class:`MultipleNegativesRankingLoss`.
    """

    def _loss(self, embeddings):
        anchor, positives, negatives = self._split(embeddings)
        return fl.supcon_loss(anchor, positives, negatives, **self._options())


class SupConLabelsLoss(_FastCLSTLoss):
    """Supervised contrastive loss from class labels (SupContrast / pytorch-metric-learning form).

    Dataset: one or more text columns and a ``label`` column (sentence-transformers passes it
    as ``labels``). Each text column is one *view* of the row's sample (one column: plain
    labelled sentences; two: e.g. a sentence and its augmentation, as SupContrast's two
    crops); every embedding is an anchor, its positives are the other embeddings with the
    same label, its denominator every other embedding
    (:func:`fastcl.losses.supcon_labels_loss`; SupContrast's ``SupConLoss`` with
    ``base_temperature = temperature``). Anchors whose label appears once in the batch
    contribute nothing (pytorch-metric-learning's convention); a batch where no label
    repeats raises ``ValueError``. ``gather_across_devices=True``: every rank's embeddings
    join every anchor's candidates and positives (``fastcl.distributed`` scaling).
    """

    min_columns = 1
    layout = "(view_1, ..., view_V) plus a label column"

    def _column_name(self, i: int) -> str:
        return f"view_{i + 1}"

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        embeddings = list(embeddings)
        self._check_columns(len(embeddings))
        self._check_shapes(embeddings)
        if labels is None:
            raise ValueError("SupConLabelsLoss needs labels: give the dataset a 'label' column of class ids")
        features = torch.stack(embeddings, dim=1)  # [B, V, d]
        return fl.supcon_labels_loss(features, labels.to(features.device), **self._options())


# The GIST drop-ins subclass _FastCLSTLoss: imported last, once everything above exists.
from ._st_gist import CachedGISTEmbedLoss, GISTEmbedLoss  # noqa: E402
