"""Gradient caching: exact parameter gradients against chunked and full-batch oracles.

Every test encodes with a tiny randomly initialised BERT (CPU, fp32 unless said) and uses
fastcl's own losses (backend="torch") on the embeddings.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from fastcl.gradcache import GradCache, HFEncoder
from fastcl.losses import infonce_loss, supmpn_loss
from fastcl.testing import assert_roundoff, eps
from tests.helpers.gradcache import chunked_graph, make_batch, one_thread, param_grads, tiny_encoder  # noqa: F401

# Same chunks, same arithmetic: only the order in which the chunks' parameter gradients are
# summed differs between the oracle's single graph and the chunk-by-chunk re-encoding: float32
# round-off of a sum over the batch's rows (both views: up to 2 x 16 = 32 terms) of terms of
# the gradient's size (fastcl.testing.roundoff).
ROWS = 32
# An encoder's outputs: hidden 32, intermediate 4 x 32, 11 tokens: the longest sums behind one
# output; another batch split may take another GEMM kernel (another order).
ENCODER_TERMS = 32 + 128 + 11


pytestmark = pytest.mark.usefixtures("one_thread")


def infonce(a, p):
    return infonce_loss(a, p, temperature=0.05, backend="torch")


def assert_grads_close(got: dict, want: dict, terms: int = ROWS, scale: float = 1.0):
    """Every parameter gradient within float32 round-off of ``terms`` terms. A gradient sums
    per-row backpropagated terms, bounded by the largest gradient of the model: a gradient that
    cancels (the attention key biases': softmax ignores them, their true gradient is 0) has terms
    of that size, so it is the magnitude for all. ``scale``: a factor on the terms' round-off
    (logits of size 1/tau upstream)."""
    assert got.keys() == want.keys() and got, "different sets of parameters received a gradient"
    largest = max(w.abs().max().item() for w in want.values())
    for name in want:
        assert_roundoff(got[name], want[name], torch.float32, terms=terms, magnitude=largest * scale, msg=name)


def simcse_step(enc, batch, encode, seed=1, forward_context=contextlib.nullcontext):
    """SimCSE-unsup step: the same sentences encoded twice (two dropout views).

    ``forward_context`` wraps the encoding and the loss, not the backward (like autocast).
    """
    enc.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with forward_context():
        a, p = encode(batch), encode(batch)
        loss = infonce(a, p)
    loss.backward()
    return a.detach(), p.detach(), param_grads(enc)


@pytest.mark.parametrize("chunk_size", [3, 4, 10, 16])
def test_dropout_on_equals_chunks_in_one_graph(chunk_size):
    enc, batch = tiny_encoder(dropout=0.1), make_batch(10)
    a0, p0, want = simcse_step(enc, batch, lambda b: chunked_graph(enc, b, chunk_size))
    rng_after_oracle = torch.get_rng_state()
    gc = GradCache(enc, chunk_size=chunk_size)
    a1, p1, got = simcse_step(enc, batch, lambda b: gc(**b))
    # The first pass consumed the RNG exactly like the oracle, and the replay in backward
    # left the caller's RNG stream untouched.
    assert torch.equal(torch.get_rng_state(), rng_after_oracle)
    assert torch.equal(a1, a0) and torch.equal(p1, p0)
    assert not torch.allclose(a1, p1), "dropout is off: the two views are identical"
    assert_grads_close(got, want)
    # Control: another seed gives other masks and visibly other gradients.
    _, _, other = simcse_step(enc, batch, lambda b: gc(**b), seed=2)
    assert not torch.allclose(
        other["model.encoder.layer.0.output.dense.weight"], want["model.encoder.layer.0.output.dense.weight"], rtol=1e-3
    )


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 16])
def test_dropout_off_equals_full_batch(chunk_size):
    """SupMPN: three calls of different sizes (anchors, 2 positives, 1 negative) feed one loss."""
    enc = tiny_encoder(dropout=0.0, pooling="cls_before_pooler")
    B, P, Q = 6, 2, 1
    anchors, positives, negatives = make_batch(B, seed=1), make_batch(B * P, seed=2), make_batch(B * Q, seed=3)

    def step(encode):
        enc.zero_grad(set_to_none=True)
        a, p, n = encode(anchors), encode(positives), encode(negatives)
        loss = supmpn_loss(a, p.view(B, P, -1), n.view(B, Q, -1), temperature=0.05, backend="torch")
        loss.backward()
        return param_grads(enc)

    want = step(lambda b: enc(**b))
    gc = GradCache(enc, chunk_size=chunk_size)
    got = step(lambda b: gc(**b))
    # the oracle encodes whole batches, the chunks smaller ones: the encoder's sums run in other
    # orders too, and the embeddings' round-off reaches the logits, of size 1/tau = 20
    assert_grads_close(got, want, terms=ENCODER_TERMS + B * (1 + P + Q), scale=1 / 0.05)


@pytest.mark.parametrize("budget", [1, 9, 20, 200])
def test_chunk_tokens_packs_by_tokens_and_stays_exact(budget):
    """``chunk_tokens``: chunks of consecutive rows within a token budget (a longer row alone),
    the ranges sentence-transformers' ``mini_batch_num_tokens`` draws; gradients stay exact."""
    enc, batch = tiny_encoder(dropout=0.0), make_batch(10)
    tokens = batch["attention_mask"].sum(1).tolist()
    gc = GradCache(enc, chunk_size=3, chunk_tokens=budget)
    bounds = gc._bounds(batch, 10)
    assert bounds[0][0] == 0 and bounds[-1][1] == 10 and all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
    for begin, end in bounds:
        assert sum(tokens[begin:end]) <= budget or end == begin + 1  # within budget, or one long row
        if end < 10:  # greedy: the next row would not have fitted
            assert sum(tokens[begin : end + 1]) > budget
    try:  # sentence-transformers >= 6.2 draws its token-packed mini-batches here
        from sentence_transformers.base.losses.gradcache import _minibatch_ranges
    except ImportError:
        _minibatch_ranges = None
    if _minibatch_ranges is not None:
        assert bounds == _minibatch_ranges(batch, 3, budget)

    def step(encode):
        enc.zero_grad(set_to_none=True)
        a, p = encode(batch), encode(make_batch(10, seed=4))
        infonce(a, p).backward()
        return a.detach(), param_grads(enc)

    def same_chunks_in_one_graph(b):  # the oracle: these chunks, encoded with grad
        return torch.cat([enc(**{k: v[s:e] for k, v in b.items()}) for s, e in gc._bounds(b, 10)])

    a_want, want = step(same_chunks_in_one_graph)
    a_got, got = step(lambda b: gc(**b))
    assert_roundoff(a_got, a_want, torch.float32, terms=ENCODER_TERMS, msg="embeddings")
    # up to 10 one-row chunks: the parameter gradients sum ~10 pieces in another order
    assert_grads_close(got, want)


def test_chunk_tokens_needs_an_attention_mask():
    enc = tiny_encoder()
    with pytest.raises(ValueError, match="attention_mask"):
        GradCache(enc, 2, chunk_tokens=8)(input_ids=torch.ones(3, 4, dtype=torch.long))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_tokens"):
            GradCache(enc, 2, chunk_tokens=bad)


@pytest.mark.parametrize("cache_enabled", [False, True])
def test_autocast_bf16_cpu(cache_enabled):
    enc, batch = tiny_encoder(dropout=0.1), make_batch(10)
    # backward runs outside autocast (the recommended pattern): the re-encoding must replay
    # the bf16 autocast of the first pass by itself.
    bf16 = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled)
    _, _, want = simcse_step(enc, batch, lambda b: chunked_graph(enc, b, 4), forward_context=bf16)
    gc = GradCache(enc, chunk_size=4)
    _, _, got = simcse_step(enc, batch, lambda b: gc(**b), forward_context=bf16)
    if cache_enabled:
        # With the cast cache the oracle's one graph shares a bf16 copy of each weight, so
        # it sums the chunks' weight gradients in bf16; gradient caching sums them in fp32
        # in param.grad. Both are right to bf16 precision of each tensor's scale: the oracle's
        # two additions of three chunks round by eps/2 each, so within 2 eps(bfloat16) = 2**-6.
        for name in want:
            err = (got[name] - want[name]).abs().max() / want[name].abs().max().clamp_min(1e-12)
            assert err < 2 * eps(torch.bfloat16), f"{name}: {err:.2e}"
    else:
        assert_grads_close(got, want)  # a cast per chunk: the same arithmetic as the oracle
        # Control: a re-encoding that forgot autocast would give fp32 gradients, and those
        # differ from the bf16 step far beyond this tolerance.
        _, _, fp32 = simcse_step(enc, batch, lambda b: chunked_graph(enc, b, 4))
        with pytest.raises(AssertionError):
            assert_grads_close(fp32, want)


def test_autocast_fp16_with_grad_scaler():
    """The CUDA fp16 recipe, run on the CPU: autocast fp16 plus a GradScaler."""
    enc, batch = tiny_encoder(dropout=0.1), make_batch(9)
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    gc = GradCache(enc, chunk_size=4)
    results = []
    for encode in (lambda b: chunked_graph(enc, b, 4), lambda b: gc(**b)):
        enc.zero_grad(set_to_none=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        torch.manual_seed(3)
        # No cast cache, so that the oracle also sums its chunks' gradients in fp32 (see bf16 test).
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = infonce(encode(batch), encode(batch))
        scaler.scale(loss).backward()
        scaled = param_grads(enc)
        scaler.unscale_(opt)
        results.append((scaled, param_grads(enc), scaler))
    (s0, u0, _), (s1, u1, scaler) = results
    assert_grads_close(s1, s0)  # scaled by 2^10: so is the bound (max |want|)
    assert_grads_close(u1, u0)
    assert all(torch.isfinite(g).all() for g in u1.values())
    scaler.step(opt)  # finite gradients: the step is taken and the scale kept
    scaler.update()
    assert scaler.get_scale() == 2.0**10


def test_gradient_accumulation():
    enc = tiny_encoder(dropout=0.1)
    batches = [make_batch(7, seed=s) for s in (1, 2)]
    want = [simcse_step(enc, b, lambda x: chunked_graph(enc, x, 3), seed=s)[2] for s, b in zip((5, 6), batches)]
    gc = GradCache(enc, chunk_size=3)
    enc.zero_grad(set_to_none=True)
    for seed, batch in zip((5, 6), batches):
        torch.manual_seed(seed)
        infonce(gc(**batch), gc(**batch)).backward()  # no zero_grad between the steps
    assert_grads_close(param_grads(enc), {k: want[0][k] + want[1][k] for k in want[0]})


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_inside_encoder(use_reentrant):
    batch = make_batch(10)
    plain = tiny_encoder(dropout=0.1)
    _, _, want = simcse_step(plain, batch, lambda b: chunked_graph(plain, b, 4))
    ckpt = tiny_encoder(dropout=0.1)  # same seed, same weights
    enable = getattr(ckpt.model, "activation_checkpointing_enable", None) or ckpt.model.gradient_checkpointing_enable
    enable({"use_reentrant": use_reentrant})
    gc = GradCache(ckpt, chunk_size=4)
    _, _, got = simcse_step(ckpt, batch, lambda b: gc(**b))
    assert_grads_close(got, want)


def test_unused_output_is_not_waited_for_and_separate_backwards_work():
    enc, batch, other = tiny_encoder(dropout=0.1), make_batch(8), make_batch(8, seed=9)
    _, _, want = simcse_step(enc, batch, lambda b: chunked_graph(enc, b, 3))
    gc = GradCache(enc, chunk_size=3)
    enc.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    a, p = gc(**batch), gc(**batch)
    with torch.random.fork_rng():
        stale = gc(**other)  # an output that never takes part in a backward  # noqa: F841
    infonce(a, p).backward()
    assert_grads_close(param_grads(enc), want)

    # Two outputs of one forward, back-propagated by two separate backward passes.
    enc.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    a, p = gc(**batch), gc(**batch)
    half_a = infonce(a, p.detach())
    half_p = infonce(a.detach(), p)
    half_a.backward()
    half_p.backward()
    assert_grads_close(param_grads(enc), want)


def test_backward_twice_is_refused():
    """A second backward through the same outputs (retain_graph=True) would re-encode and add
    the encoder's gradient to .grad again: refused, and the first backward's gradients stay."""
    enc, batch = tiny_encoder(dropout=0.1), make_batch(6)
    gc = GradCache(enc, chunk_size=4)
    loss = infonce(gc(**batch), gc(**batch))
    loss.backward(retain_graph=True)
    once = param_grads(enc)
    with pytest.raises(RuntimeError, match="second backward through the same gc"):
        loss.backward()
    assert_grads_close(param_grads(enc), once)


@pytest.mark.parametrize("wrap", ["module", "callable"])
@pytest.mark.parametrize("change", ["replace_parameter", "eval", "double"])
def test_encoder_changed_before_backward_is_refused(wrap, change):
    """A parameter object replaced, the encoder switched to eval() (dropout would not replay)
    or cast to another dtype between gc(...) and backward(): refused with what changed."""
    enc, batch = tiny_encoder(dropout=0.1), make_batch(6)
    encode_fn = enc if wrap == "module" else (lambda **b: enc(**b))
    gc = GradCache(encode_fn, chunk_size=4)
    loss = infonce(gc(**batch), gc(**make_batch(6, seed=1)))
    words = enc.model.embeddings.word_embeddings
    if change == "replace_parameter":
        words.weight = torch.nn.Parameter(words.weight.detach().clone())
        match = "was replaced"
    elif change == "eval":
        enc.eval()
        match = r"switched to eval\(\)"
    else:
        enc.double()
        match = "moved from torch.float32"
    with pytest.raises(RuntimeError, match=match):
        loss.backward()
    assert all(p.grad is None for p in enc.parameters()), "a gradient was accumulated before the refusal"


def test_in_place_edit_of_cached_inputs_is_detected():
    enc, batch = tiny_encoder(), make_batch(6)
    gc = GradCache(enc, chunk_size=4)
    loss = infonce(gc(**batch), gc(**make_batch(6, seed=1)))
    batch["input_ids"][0, 0] = 5
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_offload_inputs():
    enc, batch = tiny_encoder(dropout=0.1), make_batch(9)
    _, _, want = simcse_step(enc, batch, lambda b: chunked_graph(enc, b, 4))
    gc = GradCache(enc, chunk_size=4, offload_inputs=True)
    _, _, got = simcse_step(enc, batch, lambda b: gc(**b))
    assert_grads_close(got, want)


def test_no_grad_is_chunked_inference():
    enc = tiny_encoder(dropout=0.1).eval()
    batch = make_batch(9)
    gc = GradCache(enc, chunk_size=4, progress=True)
    with torch.no_grad():
        emb, full = gc(**batch), enc(**batch)
    assert emb.grad_fn is None and not emb.requires_grad
    assert_roundoff(emb, full, torch.float32, terms=ENCODER_TERMS)


def test_non_tensor_inputs_pass_to_every_chunk():
    seen = []

    def encode_fn(x, scale):
        seen.append(scale)
        return x * scale

    w = torch.ones(3, requires_grad=True)
    gc = GradCache(lambda x, scale: encode_fn(x, scale) * w, chunk_size=2)
    emb = gc(x=torch.arange(15.0).view(5, 3), scale=2.0)
    emb.sum().backward()
    assert seen == [2.0] * 6
    assert torch.equal(w.grad, torch.arange(15.0).view(5, 3).sum(0) * 2)  # small integers: exact


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda enc: GradCache(enc, chunk_size=0), ValueError, "chunk_size"),
        (lambda enc: GradCache(enc, chunk_size=2.0), ValueError, "chunk_size"),
        (lambda enc: GradCache("not callable", chunk_size=2), TypeError, "callable"),
        (lambda enc: GradCache(enc, chunk_size=2, ddp=object()), TypeError, "DistributedDataParallel"),
        (lambda enc: GradCache(enc, 2)(scale=1.0), ValueError, "at least one tensor"),
        (
            lambda enc: GradCache(enc, 2)(
                input_ids=torch.ones(3, 4, dtype=torch.long), attention_mask=torch.ones(2, 4)
            ),
            ValueError,
            "leading dimension",
        ),
        (lambda enc: GradCache(enc, 2)(input_ids=torch.ones(0, 4, dtype=torch.long)), ValueError, "n = 0"),
        (
            lambda enc: GradCache(enc, 2)(inputs_embeds=torch.ones(3, 4, 32, requires_grad=True)),
            ValueError,
            "require grad",
        ),
        (lambda enc: GradCache(lambda **x: torch.ones(3), 2)(x=torch.ones(4)), ValueError, r"\[n, d\]"),
        (lambda enc: GradCache(lambda **x: [1], 2)(x=torch.ones(4)), TypeError, "must return a Tensor"),
        (lambda enc: HFEncoder(enc.model, pooling="max"), ValueError, "pooling"),
    ],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make(tiny_encoder())


def test_frozen_encoder_is_reported():
    enc = tiny_encoder().requires_grad_(False)
    gc = GradCache(enc, chunk_size=4)
    emb = gc(**make_batch(5))
    with pytest.raises(RuntimeError, match="does not require grad"):
        emb.sum().backward()


def test_hf_pooling_choices():
    from transformers import BertModel

    enc, batch = tiny_encoder(dropout=0.0).eval(), make_batch(5)
    enc.model = BertModel(enc.model.config)  # with its pooler, for "cls"
    with torch.no_grad():
        out = enc.model(**batch, output_hidden_states=True)
        m = batch["attention_mask"].unsqueeze(-1).float()
        want = {
            "cls": out.pooler_output,
            "cls_before_pooler": out.last_hidden_state[:, 0],
            "mean": (out.last_hidden_state * m).sum(1) / m.sum(1),
            "avg_first_last": ((out.hidden_states[1] + out.hidden_states[-1]) / 2 * m).sum(1) / m.sum(1),
        }
        for pooling, expected in want.items():
            enc.pooling = pooling
            assert_roundoff(enc(**batch), expected, torch.float32, terms=11, msg=pooling)  # a mean over tokens
        enc.pooling = "mean"
        no_mask = {"input_ids": batch["input_ids"]}
        assert_roundoff(enc(**no_mask), enc.model(**no_mask).last_hidden_state.mean(1), torch.float32, terms=11)
        with pytest.raises(ValueError, match="pooler_output"):
            HFEncoder(tiny_encoder().model, pooling="cls")(**batch)


class SavedActivations:
    """Live bytes of tensors saved for backward by the encoder, and their peak.

    Installed around every encoder call only (not around the loss), so it measures what
    the encoder keeps alive: a saved tensor counts from the forward that saves it until
    autograd frees it (after its backward).
    """

    def __init__(self):
        self.live = self.peak = 0

    def _pack(self, t):
        counter, nbytes = self, t.numel() * t.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        class Held:
            def __del__(self):
                counter.live -= nbytes

        held = Held()
        held.t = t
        return held

    def wrap(self, encode_fn):
        def encode(**inputs):
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.t):
                return encode_fn(**inputs)

        return encode


def encoder_peak(n: int, cached: bool, chunk_size: int = 4) -> int:
    enc, batch = tiny_encoder(dropout=0.1), make_batch(n, length=12)
    meter = SavedActivations()
    encode = meter.wrap(enc)
    emb = GradCache(encode, chunk_size=chunk_size)(**batch) if cached else chunked_graph(encode, batch, chunk_size)
    infonce(emb, emb.roll(1, 0)).backward()
    assert meter.live == 0, "saved activations outlived the backward"
    return meter.peak


def test_encoder_memory_does_not_grow_with_batch():
    cached = {n: encoder_peak(n, cached=True) for n in (8, 32)}
    assert cached[32] == cached[8] > 0
    # Control: the same chunks kept in one graph hold 4x as much at n = 32 as at n = 8.
    uncached = {n: encoder_peak(n, cached=False) for n in (8, 32)}
    assert uncached[32] >= 3.9 * uncached[8]
    assert cached[32] * 7 < uncached[32]


@pytest.mark.parametrize("wrap", ["module", "callable"])
@pytest.mark.parametrize("change", ["optimizer_step", "load_state_dict"])
def test_parameters_changed_before_backward_are_refused(wrap, change):
    """An optimiser step (or any in-place weight change) between gc(...) and backward() would
    re-encode with the new weights: the gradient of neither point. It is refused, naming the
    parameters, before any gradient is accumulated; the same sequence works once undone."""
    enc, batch = tiny_encoder(dropout=0.1), make_batch(6)
    encode_fn = enc if wrap == "module" else (lambda **b: enc(**b))
    gc = GradCache(encode_fn, chunk_size=4)
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    enc.zero_grad(set_to_none=True)
    loss = infonce(gc(**batch), gc(**make_batch(6, seed=1)))
    if change == "optimizer_step":
        for p in enc.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        enc.zero_grad(set_to_none=True)
    else:
        enc.load_state_dict(tiny_encoder(seed=3).state_dict())
    with pytest.raises(RuntimeError, match=r"changed in place between gc\(\.\.\.\) and backward\(\).*embeddings\.word"):
        loss.backward()
    assert all(p.grad is None for p in enc.parameters()), "a gradient was accumulated before the refusal"
    # the next step, encoded with the new weights, trains as usual
    _, _, got = simcse_step(enc, batch, lambda b: gc(**b))
    _, _, want = simcse_step(enc, batch, lambda b: chunked_graph(enc, b, 4))
    assert_grads_close(got, want)


def test_parameter_versions_allow_accumulation_and_autocast_scaler_steps():
    """Steps that change nothing between forward and backward are never refused: gradient
    accumulation over two backwards, and the usual forward, backward, step order."""
    enc, batch = tiny_encoder(dropout=0.1), make_batch(6)
    gc = GradCache(enc, chunk_size=4)
    opt = torch.optim.AdamW(enc.parameters(), lr=1e-3)
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = infonce(gc(**batch), gc(**batch))
        loss.backward()
        opt.step()  # after backward: the next gc(...) records the new versions
        opt.zero_grad(set_to_none=True)


def test_two_modules_built_alike_are_not_taken_for_a_replacement():
    """A plain-callable encode_fn that runs two top-level modules of the same structure (a
    guide built like the model): their parameters share path names, not identities."""
    enc, twin, batch = tiny_encoder(dropout=0.1), tiny_encoder(dropout=0.1, seed=4), make_batch(6)

    def encode(**b):
        with torch.no_grad():
            twin(**b)
        return enc(**b)

    gc = GradCache(encode, chunk_size=4)
    loss = infonce(gc(**batch), gc(**make_batch(6, seed=1)))
    loss.backward()  # nothing changed: no refusal
    assert all(p.grad is not None for p in enc.parameters())
