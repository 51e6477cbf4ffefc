"""When a share of a reference (the GEMM floor, one GEMM's rate) is measured soundly enough to print.

A share divides by a reference time, so it is only as good as that reference. A main job on
a busy machine printed shares of 128-1020 % of the GEMM rate and 233-244 % of the floor at
the grid's smallest shapes (SupCon B = 64 and 256, SupMPN B = 64). Both
references were mis-measured there, for reasons a single check does not catch:

* The GEMM rate (``metrics.gemm_tflops`` until then) was timed apart from the case: five
  calls of one ``[B, d] @ [d, N]`` product, once per shape and process (cached: SupMPN and
  SupCon of one B shared whatever moment it caught), each call allocating and
  page-faulting a fresh ``[B, N]`` output. A 0.3 ms product on two threads where another
  process holds a core waits for its descheduled thread in every one of the five calls;
  nothing the implementations' rounds went through. It is now a step of the case's
  interleaved rounds with a preallocated output (``metrics.gemm_step``).
* The floor runs in the rounds, but at these shapes one call lasts about a millisecond:
  three GEMMs, each its own parallel region. Short multi-threaded calls are the ones a busy
  machine disturbs most (a parallel region waits for its slowest thread), and a floor
  disturbed more than the step it bounds reads as a share above 100 %. It is now repeated
  within its turn until a sample lasts :data:`MIN_REFERENCE_SAMPLE_S`
  (``timing.repeats_for``), and a floor whose rounds disagree is not divided by.

Reproduced on this project's 2-core machine with one core kept busy: SupMPN B = 256 read
189 % of the (apart-measured) GEMM rate while its floor share stayed at 84 %, and the
floor's own spread went to 11 %.

A share is printed only when (:func:`share_problem`): the reference was timed in the same
interleaved rounds as the implementation; its own fastest rounds agree (spread at most
``timing.NOISY_SPREAD``); its samples lasted at least :data:`MIN_REFERENCE_SAMPLE_S`;
and the share is one a step that does the reference's work can reach. The floor is a
lower bound of a fused step's GEMM work; a faster GEMM kernel than the floor's (fastcl's
CPU tile beats MKL's generic one by up to 8 %) allows a little above 100 %, not
:data:`FLOOR_SHARE_CEILING` or more. The GEMM share divides the nominal ``8 B N d`` FLOPs
of a four-pass step by one GEMM's rate; a three-pass (gradient-in-forward) step at the
floor reads 8/6 of its floor share, hence :data:`GEMM_SHARE_CEILING`. Otherwise the share
prints as "–" and the reason goes to the notes.
"""

from __future__ import annotations

from benchmarks.harness.timing import NOISY_SPREAD

FLOOR_SHARE_CEILING = 1.25
GEMM_SHARE_CEILING = FLOOR_SHARE_CEILING * 8 / 6
MIN_REFERENCE_SAMPLE_S = 0.005  # above a scheduler tick (1-4 ms): one tick cannot make a sample


def share_problem(
    share: float | None,
    *,
    reference: str,
    in_rounds: bool,
    spread: float | None,
    sample_s: float | None,
    ceiling: float,
) -> str | None:
    """Why a share of ``reference`` may not be printed (None: it may).

    ``in_rounds``: the reference was timed in the implementation's interleaved rounds;
    ``spread``: the reference's spread over those rounds; ``sample_s``: how long one of its
    timed samples lasted (None: not recorded, older runs); ``ceiling``: the largest share a
    step doing the reference's work can reach.
    """
    if share is None:
        return None  # nothing to print either way
    if not in_rounds:
        return f"the {reference} was timed apart from the case's interleaved rounds (runs before 2026-11-27)"
    if spread is None or not spread <= NOISY_SPREAD:
        shown = "unknown" if spread is None else f"{100 * spread:.0f}%"
        return f"the {reference}'s fastest rounds disagree (spread {shown} > {100 * NOISY_SPREAD:.0f}%)"
    if sample_s is not None and sample_s < MIN_REFERENCE_SAMPLE_S:
        return (
            f"the {reference} was timed in samples of {1e3 * sample_s:.2f} ms, below the "
            f"{1e3 * MIN_REFERENCE_SAMPLE_S:.0f} ms a sample needs"
        )
    if share > ceiling:
        return (
            f"{100 * share:.0f}% of the {reference} is more than a step doing its work can reach "
            f"(at most {100 * ceiling:.0f}%): the {reference} itself was slowed (a busy machine: a "
            "threaded GEMM waits for its slowest thread)"
        )
    return None


def floor_share_problem(share, *, spread, sample_s, in_rounds: bool = True) -> str | None:
    return share_problem(
        share, reference="floor", in_rounds=in_rounds, spread=spread, sample_s=sample_s, ceiling=FLOOR_SHARE_CEILING
    )


def gemm_share_problem(share, *, spread, sample_s, in_rounds: bool) -> str | None:
    return share_problem(
        share, reference="GEMM rate", in_rounds=in_rounds, spread=spread, sample_s=sample_s, ceiling=GEMM_SHARE_CEILING
    )
