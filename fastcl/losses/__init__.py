"""fastcl's public losses: plain functions and ``nn.Module`` wrappers, one module per family.

==============  ===========================================================================
``supmpn``      :func:`supmpn_loss`, :class:`SupMPNLoss` (Dehghan & Amasyali 2022)
``supcon``      :func:`supcon_loss` (structured or labels; the labels form: ``supcon_labels``), :func:`supcon_labels_loss`,
                :func:`supcon_pool_loss`, :class:`SupConLoss` (Khosla et al. 2020; Liao 2021)
``mnrl``        :func:`mnrl_loss`, :func:`mnrl_directions_loss`, :class:`MNRLoss` (Gao et al.
                2021; Henderson et al. 2017; sentence-transformers 6)
``infonce``     :func:`infonce_loss`, :func:`edacse_loss`, :class:`InfoNCELoss`, :class:`EdaCSELoss`
                (Gao et al. 2021; Liu et al. 2023)
``clip``        :func:`clip_loss`, :func:`siglip_loss`, :class:`ClipLoss`, :class:`SigLipLoss`
                (Radford et al. 2021; Zhai et al. 2023; open_clip's conventions)
``gist``        :func:`gist_loss`, :class:`GISTLoss` (Solatorio 2024; sentence-transformers 6.2's
                ``GISTEmbedLoss``); the self-margin filter is ``false_negative_margin=`` of
                :func:`mnrl_loss` and :func:`infonce_loss`
``gclsr``       :func:`grouped_cosine_loss`, :func:`gclsr_loss`, :class:`GroupedCosineLoss`,
                :class:`GCLSRLoss` (Wang et al. 2023)
``_shared``     argument docs, option checks, the structured layout, the distributed scaling
                rule and the modules' base, used by every family
==============  ===========================================================================

Every LSE loss is a thin composition over one fused primitive (``fastcl.ops.contrastive``,
docs/design.md) whose fused backends never build the ``[B, N]`` logits. Embeddings are raw
(float16, bfloat16, float32 or float64, one dtype; cosine similarity normalises inside and
the gradient flows to the raw tensors); masks are bool with ``False`` marking padding. The
loss comes back in the input dtype, accumulated in float32 (float64 for float64 inputs).
Formulas: docs/losses.md. Each function's docstring lists its arguments, shapes and paper.
"""

from .clip import ClipLoss, SigLipLoss, clip_loss, siglip_loss
from .gclsr import GCLSRLoss, GroupedCosineLoss, gclsr_loss, grouped_cosine_loss
from .gist import GISTLoss, gist_loss
from .infonce import EdaCSELoss, InfoNCELoss, edacse_loss, infonce_loss
from .mnrl import MNRLoss, mnrl_directions_loss, mnrl_loss
from .supcon import LABELS_TEMPERATURE, SupConLoss, supcon_labels_loss, supcon_loss, supcon_pool_loss
from .supmpn import OWN_POSITIVES, SupMPNLoss, supmpn_loss

__all__ = [
    "supmpn_loss",
    "supcon_loss",
    "supcon_labels_loss",
    "mnrl_directions_loss",
    "mnrl_loss",
    "infonce_loss",
    "edacse_loss",
    "supcon_pool_loss",
    "grouped_cosine_loss",
    "clip_loss",
    "siglip_loss",
    "ClipLoss",
    "gist_loss",
    "GISTLoss",
    "SigLipLoss",
    "gclsr_loss",
    "SupMPNLoss",
    "SupConLoss",
    "MNRLoss",
    "InfoNCELoss",
    "EdaCSELoss",
    "GroupedCosineLoss",
    "GCLSRLoss",
    "OWN_POSITIVES",
    "LABELS_TEMPERATURE",
]
