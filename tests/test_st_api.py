"""sentence-transformers 6 API parity of fastcl's ST losses.

* what ST hands over: the ``BatchEncoding`` of ``model.preprocess()`` / ``model.tokenize()``
  (any ``Mapping`` of tensors) works like a dict, for the plain and the cached losses;
* MNRL ``directions`` / ``partition_mode`` / ``hardness_mode`` / ``hardness_strength``:
  values and gradients equal sentence-transformers 6.2's ``MultipleNegativesRankingLoss``
  (float64, on the same embeddings) and, through a tiny model, its cached loss.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import pytest
import torch

st = pytest.importorskip("sentence_transformers")

from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

from fastcl.integrations import sentence_transformers as fst  # noqa: E402
from tests import _st_common as common  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _param_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, loss, features) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    value = loss(features, None)
    value.backward()
    return value.detach(), _param_grads(model)


# --------------------------------------------------------------------------- item 4: BatchEncoding


@pytest.mark.parametrize("make", ["preprocess", "tokenize"])
@pytest.mark.parametrize("cached", [False, True])
def test_batch_encoding_is_accepted(tmp_path, make, cached):
    model = common.tiny_model(tmp_path, dropout=0.0).train()
    rows = common.sentences(12, seed=11)
    encode = getattr(model, make)
    features = [encode(rows[i::3]) for i in range(3)]
    assert isinstance(features[0], Mapping) and not isinstance(features[0], dict), type(features[0])
    loss = (fst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2) if cached
            else fst.MultipleNegativesRankingLoss(model))
    ref_value, ref_grads = _step(model, st_losses.MultipleNegativesRankingLoss(model), [dict(f) for f in features])
    keys = [set(f.keys()) for f in features]
    value, grads = _step(model, loss, features)
    torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-6)
    common.assert_grads_close(grads, ref_grads, f"BatchEncoding from {make}")
    # the caller's encodings are not written into (the model adds token_embeddings etc.)
    assert [set(f.keys()) for f in features] == keys


def test_read_only_mapping_and_non_mapping(tmp_path):
    model = common.tiny_model(tmp_path, dropout=0.0).eval()
    rows = common.sentences(6, seed=12)
    features = [types.MappingProxyType(dict(model.preprocess(rows[i::2]))) for i in range(2)]
    with torch.no_grad():
        got = fst.MultipleNegativesRankingLoss(model)(features)
        want = fst.MultipleNegativesRankingLoss(model)([dict(f) for f in features])
    torch.testing.assert_close(got, want)
    with pytest.raises(TypeError, match="feature mapping"):
        fst.MultipleNegativesRankingLoss(model)([list(features[0].values()), dict(features[1])])
