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

A request alone is not the only limit: a worker also runs its share of the step's work. Every
pass costs ``base_seconds`` and, per sequence in it, the per-sequence, per-draft-token and
context terms. So a worker holding requests ``S`` needs at least ``base * max(passes(r))`` plus
the sum over ``S`` of each request's least work (every position at the draft length that costs
least per token it makes; context at each stretch's start, prefill of its prompt), where
``passes(r)`` is the fewest passes ``r`` can take (the deepest draft where one covers).
``work_floor`` is the least makespan at which the step's requests fit on ``workers`` workers
under that rule, with a request's work allowed to split over workers (a relaxation, so still a
bound): filled in the order of their passes, each worker at the level of the first request it
takes. Where every worker's batch is full (64 workers x 256 requests) this, not the request
alone, binds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bubblespec.bench.sim.costs import CostProfile
from bubblespec.bench.sim.workload import AcceptanceModel, Workload

__all__ = ["Ceiling", "best_rate", "step_ceiling", "work_floor"]

CONTEXT_SEGMENTS = 256
"""Stretches a context-aware floor is integrated over (midpoint rule; exact where no draft covers)."""
WORK_SEGMENTS = 8
"""Stretches of a draft's span that ``work_floor`` charges at their start's context (a lower bound)."""


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
    return (_tokens_per_pass(alphas, k) / profile.step_seconds(1, k, drafted_sequences=(k > 0).astype(int))).max(axis=1)


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
    workers: int = 0
    """Workers ``work_floor_seconds`` spreads the step over (0: not computed)."""
    work_floor_seconds: float = 0.0
    """``work_floor`` with these drafts: no schedule on ``workers`` workers ends the step before it."""
    no_draft_work_floor_seconds: float = 0.0
    """The same without any draft: no policy that drafts nothing (``static``) ends before it."""

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
    seconds = profile.step_seconds(1, k, context_tokens=context, draft_context_tokens=k * context,
                                   drafted_sequences=(k > 0).astype(int))
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


def _passes_and_work(L: np.ndarray, C: np.ndarray, alphas: np.ndarray, prompt: int, profile: CostProfile,
                     most: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request: the fewest passes it can take (the deepest draft over the ``C`` tokens a
    draft covers, one token a pass past them) and the least seconds its sequence adds to the
    passes it is in beyond ``base_seconds`` (each covered stretch at the draft length that costs
    least per token, at the stretch's starting context; past the draft exact; its prompt's prefill)."""
    k = np.arange(most + 1)
    tokens = _tokens_per_pass(alphas, k)
    passes = C / tokens[:, -1] + (L - C)
    per_seq, per_ctx = profile.per_seq_seconds, profile.per_context_token_seconds
    per_draft, per_draft_ctx = profile.per_draft_token_seconds, profile.per_draft_context_token_seconds
    per_drafted = profile.per_drafted_seq_seconds  # a pass's fixed spec_pass_seconds is left out, as base_seconds is
    work = (L - C) * (per_seq + per_ctx * (prompt + (C + L) / 2)) + profile.prefill_seconds(prompt)
    for j in range(WORK_SEGMENTS):
        context = (prompt + C * j / WORK_SEGMENTS)[:, None]
        cost = (per_seq + per_ctx * context + k * (per_draft + per_draft_ctx * context) + per_drafted * (k > 0)) / tokens
        work += C / WORK_SEGMENTS * cost.min(axis=1)
    return passes, work


def _fractional_makespan(levels: np.ndarray, work: np.ndarray, workers: int) -> float:
    """Least ``T`` at which every request fits: a worker takes ``max(levels) + sum(work) <= T``
    over what it holds, work split freely. Filling workers in the order of ``levels`` (highest
    first), each at the level of the first request it takes, needs the fewest; ``T`` is found by
    bisection to 0.01%."""
    order = np.argsort(-levels, kind="stable")
    lv, ends = levels[order], np.cumsum(work[order])
    total = float(ends[-1])

    def fits(t: float) -> bool:
        placed, i = 0.0, 0
        for _ in range(workers):
            room = t - lv[i]
            if room <= 0:
                return False
            placed += room
            if placed >= total:
                return True
            i = int(np.searchsorted(ends, placed, side="right"))
        return False

    lo, hi = max(float(lv[0]), total / workers), float(lv[0]) + total
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def work_floor(lengths: np.ndarray, covered: np.ndarray, alphas: np.ndarray, prompt: int, profile: CostProfile,
               most: int, workers: int) -> float:
    """The makespan bound that counts each worker's work as well as its longest request (module
    docstring): requests of ``lengths`` tokens, ``covered`` of them by a draft at acceptance
    ``alphas``, prompts of ``prompt`` tokens, on ``workers`` workers."""
    passes, work = _passes_and_work(np.asarray(lengths, dtype=float), np.asarray(covered, dtype=float),
                                    np.asarray(alphas, dtype=float), prompt, profile, most)
    return _fractional_makespan(profile.base_seconds * passes, work, workers)


def step_ceiling(workload: Workload, acceptance: AcceptanceModel, profile: CostProfile, seed: int, step: int,
                 prompts: int, samples: int, drafts: int, target: float = 1.8, workers: int = 0) -> Ceiling:
    """The bound for step ``step`` of seed ``seed`` (the simulator's very requests) when every
    prompt has ``drafts`` complete drafts; ``target``: the speedup ``suffix_needed`` aims at;
    ``workers`` > 0: ``work_floor`` on that many workers too."""
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
    work = no_draft_work = 0.0
    if workers > 0:
        A, prompt = np.array(alphas), workload.prompt_tokens
        work = work_floor(L, C, A, prompt, profile, most, workers)
        no_draft_work = work_floor(L, np.zeros_like(C), A, prompt, profile, most, workers)
    return Ceiling(drafts, floor, no_draft, (names[worst], lengths[worst], covered[worst], round(alphas[worst], 2)),
                   _suffix_needed(fits), workers, work, no_draft_work)


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
