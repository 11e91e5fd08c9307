"""Draft planning: which upcoming prompt an idle worker should pre-generate next.

Value order: prompts with fewer complete drafts first, then prompts predicted long first (long
responses are where speculation saves the most forward passes), then announcement order.
A prompt stops being planned once it has the drafts it can use: one under greedy decoding
(every sample is the same response), ``n`` when sampling. A draft job that was stopped
half-way leaves a partial draft and the prompt stays planned; the next job for it is itself
drafted by that partial, so it catches up in few forward passes.
A heap with lazy invalidation keeps each pick O(log n) for the simulator's scale.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from bubblespec.client.types import SamplingParams
from bubblespec.scheduler.core.types import InvalidRequest

__all__ = ["DRAFT_SEEDS", "DraftPlanner", "Upcoming", "draft_seed", "job_sampling", "paying_draft_tokens",
           "shares_draft_seeds"]

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


def draft_seed(rng: random.Random) -> int:
    """A fresh seed for one draft job, from the scheduler's own ``rng``: each job draws new
    noise (the ``n`` drafts of one prompt differ), never a request's seed."""
    # the range is exactly 2**61 wide: getrandbits is uniform over it and ~10x cheaper than randrange
    return DRAFT_SEEDS[0] + rng.getrandbits(61)


def job_sampling(up: Upcoming, seed: int, logprobs_mode: str) -> SamplingParams:
    """``up.sampling`` with a draft job's ``seed`` and the worker's ``logprobs_mode``. A copy of
    a per-prompt template (``dataclasses.replace`` once per prompt and mode, not once per job:
    the simulator starts hundreds of thousands of jobs); no field but the seed differs from the
    template, so no validation is skipped."""
    template = up.templates.get(logprobs_mode)
    if template is None:
        template = up.templates[logprobs_mode] = replace(up.sampling, logprobs_mode=logprobs_mode)
    params = object.__new__(SamplingParams)
    params.__dict__.update(template.__dict__)
    params.__dict__["seed"] = seed
    return params


@dataclass
class Upcoming:
    """An announced prompt of a future step, and what drafting has done for it."""

    token_ids: tuple[int, ...]
    sampling: SamplingParams
    for_step: str
    drafts: int = 0
    """Complete drafts (the job ran to the end of the response)."""
    in_flight: int = 0
    predicted_len: float = 0.0
    templates: dict[str, SamplingParams] = field(default_factory=dict, repr=False, compare=False)
    """``sampling`` by logprobs mode, for ``job_sampling``."""

    @property
    def wanted(self) -> int:
        """Complete drafts worth making: under greedy decoding every sample is the same."""
        return 1 if self.sampling.temperature == 0 else max(1, self.sampling.n)


class DraftPlanner:
    """The announced upcoming prompts and which one an idle worker drafts next (module
    docstring); a collaborator of ``SchedulerCore`` (``core.planner``)."""

    def __init__(self) -> None:
        self.upcoming: dict[tuple[int, ...], Upcoming] = {}
        self._heap: list[tuple[int, float, int, tuple[int, ...]]] = []
        self._seq = itertools.count()
        self._unpredicted: list[tuple[int, ...]] = []  # announced with no length to go by (``repredict``)

    def announce(self, token_ids: tuple[int, ...], sampling: SamplingParams, for_step: str, predicted: float) -> None:
        if token_ids in self.upcoming:
            return
        self.upcoming[token_ids] = Upcoming(token_ids, sampling, for_step, predicted_len=predicted)
        if not predicted:
            self._unpredicted.append(token_ids)
        self._push(token_ids)

    def repredict(self, predicted: Callable[[tuple[int, ...]], float]) -> None:
        """Predict again the prompts announced with no length to go by (before any response
        was seen: the first step's lookahead), so that they are not drafted after every prompt
        announced later for ever; ``predicted``: ``LengthHistory.predicted``."""
        left = []
        for key in self._unpredicted:
            up = self.upcoming.get(key)
            if up is None:
                continue
            up.predicted_len = predicted(key)
            if not up.predicted_len:
                left.append(key)
            self._push(key)  # the entry under the old prediction is now stale (``pick``)
        self._unpredicted = left

    def forget(self, token_ids: tuple[int, ...]) -> None:
        """The prompt's step has arrived: stop planning drafts for it."""
        if self.upcoming.pop(token_ids, None) is not None and len(self._heap) > 2 * len(self.upcoming) + 64:
            self._heap = [e for e in self._heap if e[3] in self.upcoming]  # drop stale entries
            heapq.heapify(self._heap)

    def pick(self) -> Upcoming | None:
        """The most valuable prompt that has no draft job in flight, or None."""
        while self._heap:
            covered, neg_len, _, key = heapq.heappop(self._heap)
            up = self.upcoming.get(key)
            if up is None or up.in_flight or (up.drafts + up.in_flight, -up.predicted_len) != (covered, neg_len):
                continue  # stale entry
            if up.drafts >= up.wanted:
                continue
            up.in_flight += 1
            return up
        return None

    def done(self, token_ids: tuple[int, ...], complete: bool) -> None:
        up = self.upcoming.get(token_ids)
        if up is None:
            return
        up.in_flight = max(0, up.in_flight - 1)
        if complete:
            up.drafts += 1
        if up.drafts < up.wanted:
            self._push(token_ids)

    def check_room(self, prompts: Iterable[tuple[int, ...]], limit: int, field: str,
                   leaving: Iterable[tuple[int, ...]] = ()) -> None:
        """Refuse (RESOURCE_EXHAUSTED naming ``field``, nothing changed) announcing ``prompts``
        when more than ``limit`` prompts would then be upcoming; ``leaving``: prompts forgotten
        first (a step's own prompts, whose step has arrived)."""
        gone = {p for p in leaving if p in self.upcoming}
        new = {p for p in prompts if p not in self.upcoming or p in gone}
        total = len(self.upcoming) - len(gone) + len(new)
        if total > limit:
            raise InvalidRequest(field, f"{len(new)} new prompts would make {total} announced prompts wait for "
                                 f"their step, over the limit of {limit} (max_announced_prompts)", "RESOURCE_EXHAUSTED")

    def coverage(self) -> tuple[int, int]:
        """(prompts with at least one draft, prompts announced)."""
        return sum(1 for u in self.upcoming.values() if u.drafts), len(self.upcoming)

    def _push(self, key: tuple[int, ...]) -> None:
        up = self.upcoming[key]
        heapq.heappush(self._heap, (up.drafts + up.in_flight, -up.predicted_len, next(self._seq), key))
