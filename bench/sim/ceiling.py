"""The most any draft planner can buy a step under the simulator's models: a makespan bound.

A request cannot finish faster than it would alone on a worker (batch 1, no prefill queue),
drafting at every pass the draft length that maximizes its tokens per second
(``best_rate``) over the part of its response a draft covers, and decoding one token per
pass past it. The step cannot end before its slowest request does, so the largest such
floor over the step's requests bounds the makespan of every policy from below, whatever it
drafts, when and where.

Drafts are what the workload model says they are: another sample of the prompt (a ``future``
draft drawn like a sample, or a finished sibling). ``step_ceiling`` gives every prompt every
draft the simulated planner could make for it (its ``Workload.draft_samples`` lengths, all
complete) plus ``drafts`` more complete drafts, fresh draws of the length model, and lets
every request use the longest of them or of its siblings, at its own ``future`` acceptance. That is generous on every
count, so ``speedup`` (the no-draft floor over this floor) is an upper bound on what more or
earlier drafts can buy; ``suffix_needed`` is the per-token acceptance that a self-draft
source covering the rest of every response (``AcceptanceModel.suffix``) would need for the
bound to reach a target speedup.

With a context-aware profile a pass costs more as the request's context grows, so a floor is
the integral over its positions (``_context_floor``: midpoints of ``CONTEXT_SEGMENTS`` stretches,
each at its best draft length). Context only adds cost, so the same request's floor at no
context is a lower bound of it: floors are integrated for the requests in that bound's order,
until the next one's bound is below the largest floor found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bubblespec.bench.sim.costs import CostProfile
from bubblespec.bench.sim.workload import AcceptanceModel, Workload

__all__ = ["Ceiling", "best_rate", "step_ceiling"]

CONTEXT_SEGMENTS = 256
"""Stretches a context-aware floor is integrated over (midpoint rule; exact where no draft covers)."""


def best_rate(alpha: float, profile: CostProfile, most: int) -> float:
    """Tokens per second of a request alone on a worker drafting at per-token acceptance
    ``alpha``, at the draft length (0..``most``) that makes the most of it."""
    return float(_best_rates(np.array([alpha]), profile, most)[0])


def _tokens_per_pass(alphas: np.ndarray, k: np.ndarray) -> np.ndarray:
    """1 + the expected accepted tokens ``alpha (1 - alpha**k) / (1 - alpha)`` of
    ``workload.expected_accepted``: one row per acceptance (``alphas``), one column per ``k``."""
    a = np.clip(alphas, 0.0, 0.999999)[:, None]
    return 1 + a * (1 - a ** k) / (1 - a)


def _best_rates(alphas: np.ndarray, profile: CostProfile, most: int) -> np.ndarray:
    """``best_rate`` of each of ``alphas`` (a step's requests at once)."""
    k = np.arange(most + 1)
    return (_tokens_per_pass(alphas, k) / profile.step_seconds(1, k)).max(axis=1)


@dataclass(frozen=True)
class Ceiling:
    """The bound for one step with ``drafts`` complete drafts per prompt."""

    drafts: int
    floor_seconds: float
    """The largest per-request floor: no schedule's makespan is below it."""
    no_draft_floor_seconds: float
    """The same without any draft (the longest response at one token per pass)."""
    binding: tuple[str, int, int, float]
    """(request, length, tokens covered by its best draft, its acceptance) of the largest floor."""
    suffix_needed: float | None
    """Self-draft acceptance past the drafts for ``floor`` to reach the target (None: not even 0.99)."""

    @property
    def speedup(self) -> float:
        return self.no_draft_floor_seconds / self.floor_seconds


def _context_floor(length: float, covered: float, alpha: float, rest_alpha: float, prompt: int,
                   profile: CostProfile, most: int) -> float:
    """Seconds of one request's passes alone with a context-aware profile (prefill not
    included): each stretch of positions at the draft length that makes the most of it, with
    acceptance ``alpha`` where a draft covers and ``rest_alpha`` past it (0: one token a pass)."""
    edges = np.linspace(0.0, length, CONTEXT_SEGMENTS + 1)
    mid = (edges[:-1] + edges[1:]) / 2
    context = (prompt + mid)[:, None]
    k = np.arange(most + 1)
    seconds = profile.step_seconds(1, k, context_tokens=context, draft_context_tokens=k * context)
    tokens = _tokens_per_pass(np.where(mid < covered, max(alpha, rest_alpha), rest_alpha), k)
    return float((np.diff(edges) * (seconds / tokens).min(axis=1)).sum())


def _worst_context_floor(L: np.ndarray, C: np.ndarray, alphas: np.ndarray, rest_alpha: float, prompt: int,
                         profile: CostProfile, most: int, prefill: float) -> tuple[float, int]:
    """(the largest floor, its request) under a context-aware profile: ``_context_floor`` for
    the requests in the order of their floor at no context (a lower bound), until that bound
    falls below the largest floor found."""
    rates = _best_rates(np.maximum(alphas, rest_alpha), profile, most)
    bounds = _floors(L, C, rates, best_rate(rest_alpha, profile, most), prefill)
    worst, at = -1.0, -1
    for i in np.argsort(-bounds):
        if bounds[i] <= worst:
            break
        floor = prefill + _context_floor(L[i], C[i], alphas[i], rest_alpha, prompt, profile, most)
        if floor > worst:
            worst, at = floor, int(i)
    return worst, at


def _floors(lengths: np.ndarray, covered: np.ndarray, rates: np.ndarray, rest_rate: float, prefill: float) -> np.ndarray:
    """Per request: prefill, the covered tokens at the better of the draft's rate and
    ``rest_rate``, the rest at ``rest_rate``."""
    return prefill + covered / np.maximum(rates, rest_rate) + (lengths - covered) / rest_rate


def step_ceiling(workload: Workload, acceptance: AcceptanceModel, profile: CostProfile, seed: int, step: int,
                 prompts: int, samples: int, drafts: int, target: float = 1.8) -> Ceiling:
    """The bound for step ``step`` of seed ``seed`` (the simulator's very requests) when every
    prompt has ``drafts`` complete drafts; ``target``: the speedup ``suffix_needed`` aims at."""
    lm, most = workload.lengths, acceptance.max_draft_tokens
    rng = np.random.default_rng([seed, step, drafts, 7])  # the drafts' own draws, apart from the workload's
    names, lengths, covered, alphas = [], [], [], []
    for p in workload.step(seed, step, prompts, samples):
        # the drafts the simulated planner can make (``p.draft_z``) and ``drafts`` fresh ones
        longest = max(lm.length(p.scale, float(z)) for z in (*p.draft_z, *rng.standard_normal(drafts)))
        for i, (n, z) in enumerate(zip(p.lengths, p.accept_z)):
            sibling = max((m for j, m in enumerate(p.lengths) if j != i), default=0)
            names.append(f"{p.prompt_id}/{i}")
            lengths.append(n)
            covered.append(min(n, max(longest, sibling)))
            alphas.append(acceptance.alpha("future", z))
    L, C = np.array(lengths, dtype=float), np.array(covered, dtype=float)
    prefill = profile.prefill_seconds(workload.prompt_tokens)
    if profile.context_aware:
        A, prompt = np.array(alphas), workload.prompt_tokens
        floor, worst = _worst_context_floor(L, C, A, 0.0, prompt, profile, most, prefill)
        no_draft = prefill + _context_floor(float(L.max()), 0.0, 0.0, 0.0, prompt, profile, most)

        def fits(alpha: float) -> bool:
            return _worst_context_floor(L, C, A, alpha, prompt, profile, most, prefill)[0] <= no_draft / target
    else:
        rates, plain = _best_rates(np.array(alphas), profile, most), 1 / profile.step_seconds(1)
        floors = _floors(L, C, rates, plain, prefill)
        worst = int(np.argmax(floors))
        floor = float(floors[worst])
        no_draft = prefill + float(L.max()) / plain

        def fits(alpha: float) -> bool:
            return float(_floors(L, C, rates, best_rate(alpha, profile, most), prefill).max()) <= no_draft / target
    return Ceiling(drafts, floor, no_draft, (names[worst], lengths[worst], covered[worst], round(alphas[worst], 2)),
                   _suffix_needed(fits))


def _suffix_needed(fits: Callable[[float], bool]) -> float | None:
    """Smallest self-draft acceptance (to 0.01) past the drafts that ``fits`` (every floor under
    the goal), or None."""
    if fits(0.0):
        return 0.0
    if not fits(0.99):
        return None
    lo, hi = 0.0, 0.99
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return round(hi, 2)
