"""The ``reasoning`` workload: long reasoning rollouts, with draft acceptance by source.

Every constant below names its source; the figures are those collected in the project's
``SOURCES.md`` list of published workload shapes and acceptance (the primary papers were not
re-read here: a figure marked second-hand there is marked second-hand here too). Per-token
acceptance ``alpha`` is derived from a published tokens-per-pass figure ``tau`` (bonus token
included) by ``alpha_for_tau``: under independent acceptance ``k`` drafted tokens give
``tau = (1 - alpha**(k + 1)) / (1 - alpha)``; at the k of 8-16 the sources use, alpha moves by
under 0.01 with k (k = 8 here).

Lengths (``REASONING_LENGTHS``): a 16,384-token cap (a 16k reasoning budget), a mean
response of about a third of the cap and ~3% of responses truncated:

- cap / mean ~2.9: Seer (arXiv 2511.14617), Moonlight math task, mean output 22,386 tokens of a
  65,536 cap.
- ~3% truncated at a 16K cap: TailSieve (Qwen team, 2026; second-hand), DeepScaleR math.
- 16 samples per prompt: Seer's experimental setup (8 or 16 responses per prompt).

A lognormal with total log-spread s and median m has ``P(L > cap) = 1 - Phi(ln(cap / m) / s)``
and mean ``m * exp(s**2 / 2)``; both conditions give s = 0.707, m = 4,370 tokens. How s splits
between prompts and samples (0.5 / 0.5) has no source: an assumption. The share of a step the
last tenth of requests take in the baseline (Seer: up to ~50%) is not a parameter: the
simulator measures it (``StepStats.tail_share``).

Acceptance (``REASONING_ACCEPTANCE``), by draft source:

- own text (``suffix``, n-gram on the request's own text): Seer Table 2, one path, tau 1.70 ->
  alpha 0.41.
- live siblings (``siblings``): the same table with 1, 5 and 15 siblings' text, tau 2.04 /
  2.32 / 2.53 -> alpha 0.51 / 0.57 / 0.61. A request's own-text acceptance steps up to a row
  once that many of its group's siblings have finished (the table's rows are read as steps: no
  credit between rows, none for a sibling still running).
- future drafts one policy version old (``future``): BubbleSpec (arXiv 2605.08862, abstract):
  decoding steps -50%, about 2 tokens per pass -> alpha 0.50.
- a finished sibling as the draft of a sample that starts after it (``history`` within a step):
  Seer's one-sibling row, alpha 0.51.
- history across epochs (``epoch_history``): RhymeRL (arXiv 2508.18588, second-hand): alpha
  0.65-0.79 for an earlier epoch's responses. A what-if, off by default (a run's first epoch):
  ``--epoch-history 0.65`` gives every request such a draft.
- text that has started to loop: MiniMax-M1 (arXiv 2506.13585, section 3.2): every token above
  0.99 probability, generation stopped after 3,000 such tokens -> alpha 0.99 over the last
  3,000 tokens of a looping response. The share of truncated responses that loop has no
  source: a what-if, 0 by default (``--loop-share``).

``SENSITIVITY`` lists each constant at the low and high end of its sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from bubblespec.bench.sim.workload import AcceptanceModel, LengthModel, Workload

__all__ = ["REASONING_ACCEPTANCE", "REASONING_LENGTHS", "REASONING_REQUESTS", "REASONING_SAMPLES", "REASONING_WORKLOAD",
           "SENSITIVITY", "WorkloadShape", "alpha_for_tau", "loops", "shape"]

DRAFT_K = 8
"""Draft length at which published tau figures are turned into alpha (Seer's grouped drafts: k up to 8)."""


def alpha_for_tau(tau: float, k: int = DRAFT_K) -> float:
    """Per-token acceptance giving ``tau`` tokens per pass with ``k`` drafted, under independent
    acceptance (bisection; ``tau`` in (1, k + 1))."""
    if not 1 < tau < k + 1:
        raise ValueError(f"tau must be in (1, {k + 1}), got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < tau:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 3)


REASONING_SAMPLES = 16
"""Samples per prompt: Seer's experimental setup (8 or 16 responses per prompt)."""

REASONING_LENGTHS = LengthModel(median_tokens=4370.0, prompt_sigma=0.5, sample_sigma=0.5, max_tokens=16384)
"""Cap 16,384; median 4,370 and log-spread 0.707 give a mean of ~1/2.9 of the cap (Seer) and ~3%
truncated (TailSieve, second-hand); the 0.5 / 0.5 split between prompt and sample is assumed."""

REASONING_WORKLOAD = Workload(lengths=REASONING_LENGTHS, prompt_tokens=512)
"""The prompt length (512 tokens, prefill only) is the short workload's, not sourced."""

SEER_ONE_PATH = {0: 1.70, 1: 2.04, 5: 2.32, 15: 2.53}
"""Seer Table 2, tau with own text and n siblings' text, one path."""
SEER_BEST_OF_4 = {0: 1.85, 1: 2.25, 5: 2.59, 15: 2.85}
"""The same table's best-of-4-paths column (the high end)."""


def _siblings(table: dict[int, float]) -> tuple[tuple[int, float], ...]:
    return tuple((n, alpha_for_tau(tau)) for n, tau in sorted(table.items()) if n > 0)


REASONING_ACCEPTANCE = replace(
    AcceptanceModel(),
    future=alpha_for_tau(2.0),  # BubbleSpec abstract: decoding steps -50%
    history=alpha_for_tau(SEER_ONE_PATH[1]),  # a finished sibling: Seer's one-sibling row
    suffix=alpha_for_tau(SEER_ONE_PATH[0]),  # own text: Seer Table 2, one path
    siblings=_siblings(SEER_ONE_PATH),
    loop_alpha=0.99, loop_tokens=3000,  # MiniMax-M1 section 3.2
    loop_share=0.0,  # what-if: no source for the share of truncated responses that loop
)
"""Acceptance by source for the reasoning workload (see the module docstring)."""

SENSITIVITY: dict[str, tuple[str, dict[str, object], dict[str, object]]] = {
    "own text": ("Seer Table 2, own text only: one path tau 1.70 / best of 4 tau 1.85",
                 {"suffix": alpha_for_tau(1.70)}, {"suffix": alpha_for_tau(1.85)}),
    "siblings": ("Seer Table 2, with 1 / 5 / 15 siblings: one path / best of 4",
                 {"siblings": _siblings(SEER_ONE_PATH)}, {"siblings": _siblings(SEER_BEST_OF_4)}),
    "future": ("low: no better than own text (tau 1.70, Seer); high: RhymeRL's epoch-old drafts, alpha 0.65 "
               "(second-hand; no published staleness curve)",
               {"future": alpha_for_tau(1.70)}, {"future": 0.65}),
    "history": ("a finished sibling: Seer's 1-sibling row (tau 2.04, one path) / RhymeRL alpha 0.79 (second-hand)",
                {"history": alpha_for_tau(2.04)}, {"history": 0.79}),
    "epoch history": ("what-if: the first epoch (none) / RhymeRL's high end, alpha 0.79 (second-hand)",
                      {"epoch_history": 0.0}, {"epoch_history": 0.79}),
    "loop share": ("what-if, no source: none / all of the truncated responses loop (MiniMax-M1: alpha 0.99, "
                   "3,000 tokens)", {"loop_share": 0.0}, {"loop_share": 1.0}),
}
"""Each acceptance constant at the low and high end of its sources: (what, the low end's values, the high end's values)."""


@dataclass(frozen=True)
class WorkloadShape:
    """Figures of a drawn step: what the workload's sources constrain."""

    requests: int
    samples: int
    mean_tokens: float
    median_tokens: float
    max_tokens: int
    truncated_share: float

    @property
    def cap_over_mean(self) -> float:
        return self.max_tokens / self.mean_tokens


def shape(workload: Workload, seed: int, steps: int, prompts: int, samples: int) -> WorkloadShape:
    """The shape of ``steps`` drawn steps of ``prompts`` x ``samples`` requests."""
    lengths = sorted(n for s in range(steps) for p in workload.step(seed, s, prompts, samples) for n in p.lengths)
    cap = workload.lengths.max_tokens
    return WorkloadShape(len(lengths), samples, sum(lengths) / len(lengths), float(lengths[len(lengths) // 2]), cap,
                         sum(n >= cap for n in lengths) / len(lengths))


def loops(prompt_index: int, sample_index: int, share: float) -> bool:
    """Whether a truncated response loops, for a ``share`` of them: a low-discrepancy draw on the
    request's indices (deterministic, the same for every policy)."""
    u = math.modf(prompt_index * 0.6180339887498949 + sample_index * 0.7548776662466927)[0]
    return u < share


REASONING_REQUESTS = (32, 4096)
"""``--requests auto`` for the reasoning workload: 32 requests per worker, at least 4,096 (Seer's
iterations: 400-800 prompts x 8-16 samples, 6,400-12,800 requests on 32-256 GPUs)."""
