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
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from bubblespec.common.rules import DRAFT_SEEDS
from bubblespec.common.types import SamplingParams
from bubblespec.scheduler.core.types import InvalidRequest

__all__ = ["DraftPlanner", "Upcoming", "draft_seed", "job_sampling"]

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
