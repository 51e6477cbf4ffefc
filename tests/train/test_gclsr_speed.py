"""GCLSR's CPU speed-ups change no maths: each equals the plain computation (float64)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastcl.gclsr import GCLSRModel
from fastcl.gclsr.conv import conv1d
from fastcl.gclsr.model import TextCNN, word_importance
from fastcl.gclsr.optim import build_sgd
from fastcl.losses import gclsr_loss
from fastcl.testing import assert_roundoff, roundoff


def _batch(B, L, d, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(L).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return torch.randn(B, L, d, generator=g, dtype=torch.float64) * mask.unsqueeze(-1), mask


def test_gemm_weight_gradient_equals_conv1d_autograd():
    g = torch.Generator().manual_seed(1)
    for k in (1, 3, 7):
        x = torch.randn(4, 5, 9, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(6, 5, k, generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
        up = torch.randn(4, 6, 9 - k + 1, generator=g, dtype=torch.float64)
        grads = []
        for fn in (conv1d, F.conv1d):
            y = fn(x, w, b)
            grads.append((y, *torch.autograd.grad((y * up).sum(), (x, w, b))))
        # y sums C_in x k products x w, d x sums C_out x k products up w, d w sums B x L
        # products up x, d b sums B x L entries of up: each of the size of its largest product
        mx, mw, mu = (t.abs().max().item() for t in (x, w, up))
        terms = 5 * k + 6 * k + 4 * 9
        for a, e, size, what in zip(*grads, (mx * mw, mu * mw, mu * mx, mu), ("y", "dx", "dw", "db")):
            assert_roundoff(a, e, torch.float64, terms=terms, magnitude=size, msg=f"k={k} {what}")
    assert torch.autograd.gradcheck(conv1d, (x, w, b))


def test_length_buckets_equal_the_padded_batch_in_values_and_gradients():
    torch.manual_seed(0)
    x, mask = _batch(7, 12, 6, (12, 1, 5, 2, 9, 3, 12))
    cnn = TextCNN(6, region_sizes=(1, 1, 3, 8), filters=4).double()
    outs = []
    for bucket in (0, 2, 3):  # 0 = the whole padded batch in one call
        cnn.bucket_size = bucket
        cnn.zero_grad()
        y = cnn(x, mask)
        y.pow(2).sum().backward()
        outs.append((y.detach(), [p.grad.clone() for p in cnn.parameters()]))
    # y: a window's 8 x 6 products x w (of size max|w| max|x|); the gradients sum the 7 x 12
    # positions' products of dL/dy = 2 y with x (or with 1 for the biases)
    terms = 8 * 6 + 7 * 12
    mx, mw = x.abs().max().item(), max(c.weight.abs().max().item() for c in cnn.convs)
    my = outs[0][0].abs().max().item()
    for y, grads in outs[1:]:
        assert_roundoff(y, outs[0][0], torch.float64, terms=terms, magnitude=mx * mw, msg="y")
        for i, (a, e) in enumerate(zip(grads, outs[0][1])):
            assert_roundoff(a, e, torch.float64, terms=terms, magnitude=2 * my * max(mx, 1.0), msg=f"grad {i}")


def test_one_backbone_call_for_both_views_equals_two():
    torch.manual_seed(0)
    model = GCLSRModel(6, region_sizes=(1, 2, 4), filters=5, proj_dim=32, pred_hidden=8).double()
    x, mask = _batch(5, 7, 6, (7, 3, 1, 5, 2))
    x2 = x + 0.1 * torch.randn_like(x) * mask.unsqueeze(-1)
    got = model(x, x2, mask)
    expected = []
    for v in (x, x2):  # the per-view definition
        z = model.projector(model.backbone(word_importance(v, mask), mask))
        expected += [model.predictor(z), z]
    # attention's 7 x 6 products, a window's 4 x 6, the projector's 15 and 32 x 2 inputs, the
    # predictor's 32 and 8, and 3 BatchNorms over 5 rows; BatchNorm'd outputs of size ~1
    terms = 7 * 6 + 4 * 6 + 15 + 2 * 32 + 32 + 8 + 3 * 5
    for i, (a, e) in enumerate(zip(got, expected)):
        assert_roundoff(a, e, torch.float64, terms=terms, magnitude=max(1.0, e.abs().max().item()), msg=f"output {i}")
    gclsr_loss(*got, group_size=16).backward()  # and the graph is intact


def test_fused_sgd_equals_the_per_tensor_loop():
    params = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = GCLSRModel(6, region_sizes=(1, 2), filters=4, proj_dim=32, pred_hidden=8)
        opt = build_sgd(model, 0.1)
        if not fused:
            for group in opt.param_groups:
                group["fused"] = None
        assert opt.param_groups[0]["fused"] is (True if fused else None)
        g, size = torch.Generator().manual_seed(1), 0.0
        for step in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
                size = max(size, p.grad.abs().max().item())
            opt.param_groups[0]["momentum"] = 0.9 if step < 2 else 0.8
            opt.step()
        params[fused] = [p.detach().clone() for p in model.parameters()]
    # float32, 3 steps: each rounds the buffer and the weight (rtol); an update is at most
    # lr (the predictor's 1.0) x (grad + momentum x a buffer of up to 3 gradients)
    update = 1.0 * (1 + 0.9 * 3) * size
    for a, e in zip(params[True], params[False]):
        torch.testing.assert_close(a, e, rtol=roundoff(torch.float32, 3), atol=roundoff(torch.float32, 3 * 3, update))
