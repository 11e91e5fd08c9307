"""Rules the scheduler and the worker both apply, so that both sides agree (pure).

- Seeds: draft jobs draw theirs from ``DRAFT_SEEDS`` (the scheduler, ``drafting.draft_seed``);
  a request whose seed lies there verifies no draft job's draft (the worker,
  ``shares_draft_seeds``). A seeded request moved to another worker goes on with
  ``resume_seed``, in ``RESUME_SEEDS`` below them (the worker, ``resume.resumed``; the scheduler
  decides the move, ``moves.py``). docs/EXACTNESS.md says why.
- Draft length: ``paying_draft_tokens``, the draft tokens worth proposing for one request of a
  batch; the worker's proposer and the simulator's engines apply it alike.
"""

from __future__ import annotations

import math

__all__ = ["DRAFT_SEEDS", "RESUME_SEEDS", "paying_draft_tokens", "resume_seed", "shares_draft_seeds"]

DRAFT_SEEDS = (3 * 2**61, 2**63)
"""Draft jobs' seeds: [3·2**61, 2**63). A request may have any int64 seed (vLLM's range), so
these are also request seeds; a request whose seed falls here gets no draft job's draft
(``shares_draft_seeds``), so no draft is ever verified under the seed, and with it the random
stream, that generated it (docs/EXACTNESS.md)."""


def shares_draft_seeds(seed: int | None) -> bool:
    """A request with ``seed`` could meet a draft job's seed: its seed, as torch's generator
    reads it (modulo 2**64), lies in ``DRAFT_SEEDS``. Such a request must not verify draft
    jobs' drafts (``future``); other drafts, and every other seed, are safe."""
    return seed is not None and DRAFT_SEEDS[0] <= seed % 2**64 < DRAFT_SEEDS[1]


RESUME_SEEDS = (5 * 2**60, 3 * 2**61)
"""Seeds of seeded requests' continuations: [5·2**60, 3·2**61), below every draft job's
(``DRAFT_SEEDS``). Requests may have any int64 seed, these included."""


def resume_seed(seed: int, tokens: int) -> int:
    """The seed a seeded request goes on with after ``tokens`` tokens elsewhere: fresh draws,
    the same for the same (seed, tokens), never a draft job's seed. All 64 bits of the seed
    (modulo 2**64, as torch reads it) reach the result: seeds that differ only in their top
    bits do not go on with the same draws."""
    mixed = (seed * 0x9E3779B97F4A7C15 + tokens * 0xC2B2AE3D27D4EB4F) % (1 << 64)
    mixed ^= mixed >> 32
    return RESUME_SEEDS[0] + mixed % (RESUME_SEEDS[1] - RESUME_SEEDS[0])


def paying_draft_tokens(accept: float, most: int, per_draft_token_seconds: float, tokens_per_second: float,
                        per_drafted_request_seconds: float = 0.0) -> int:
    """Draft tokens worth proposing for one request of a batch (0: drafting off for it).

    A pass over the batch makes ``N`` tokens in ``T`` seconds (``tokens_per_second`` = N / T).
    Proposing one more draft token, the j-th of a request whose per-token acceptance is
    ``accept``, adds ``accept**j`` expected tokens to the pass and ``per_draft_token_seconds``
    to its time; the batch's throughput rises iff ``accept**j / per_draft_token_seconds > N / T``,
    i.e. ``accept**j > per_draft_token_seconds * tokens_per_second``. So: the largest ``k <= most``
    with ``accept**k`` above that threshold. Where a pass is memory-bound (small batch, a cheap
    draft token) the threshold is tiny and deep drafts pay; in a large, busy batch where a draft
    token costs as much as it is expected to save, it proposes 0 and the batch decodes as if it
    did not speculate. Pure: a worker calls it with its measured cost per draft token
    (``bubblespec calibrate``) and its current tokens/s; the simulator's engines do the same.

    ``per_drafted_request_seconds``: what a pass adds for each request that has any draft,
    beyond its tokens (on an H100, 13-28 us a sequence: docs/SIMULATOR.md). No single token pays
    for it, so the request's drafts together must: the ``k`` above is the length with the most
    net gain (``sum(accept**j) - k * threshold``; each term falls with ``j``), and where even that
    gain is not above ``per_drafted_request_seconds * tokens_per_second`` no length pays: 0."""
    if most <= 0 or accept <= 0:
        return 0
    threshold = per_draft_token_seconds * tokens_per_second
    if threshold <= 0:
        return most
    if accept >= 1:
        k = most if threshold < 1 else 0
    elif accept <= threshold:
        return 0
    else:
        k = max(0, min(most, math.floor(math.log(threshold) / math.log(accept) - 1e-9)))  # accept**k > threshold
    if k and per_drafted_request_seconds > 0:
        gained = float(k) if accept >= 1 else accept * (1 - accept**k) / (1 - accept)
        if gained - k * threshold <= per_drafted_request_seconds * tokens_per_second:
            return 0
    return k
