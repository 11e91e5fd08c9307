"""Dispatch (pure): which queued request a worker takes next, and handing it over.

Every worker has a private queue (filled up front by the ``static`` policy) and every step a
shared queue (``queue`` and ``longest-first``). A worker takes from its private queue first,
then from the shared queues of steps in arrival order, up to its capacity, and only work of the
policy version it has loaded, whose logprobs it returns and whose adapter it holds; a request
moved off a worker, or that failed there, goes back to it only where no other worker can run
it. ``fill_all`` spreads the queued work one sample group at a time (``Balancer``,
``core/balance.py``), then lets idle workers draft (``core/drafts.py``). ``Dispatcher``
(``core.dispatcher``) keeps no state of its own: the queues are the steps' and workers' records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bubblespec.common.types import SamplingParams
from bubblespec.scheduler.core.pool import POOL
from bubblespec.scheduler.core.types import Action, Assign, step_of

if TYPE_CHECKING:
    from bubblespec.scheduler.core.records import CoreParts, RequestState, StepState, WorkerState

__all__ = ["Dispatcher"]


class Dispatcher:
    """Hands queued requests to workers with room (``core.dispatcher``)."""

    def __init__(self, core: CoreParts):
        self.core = core

    def fill_all(self) -> list[Action]:
        """Spread available work: one sample group at a time (one request at a time with
        ``spread_samples``) to the worker with the fewest predicted tokens to go (core/balance.py)."""
        core = self.core
        drafts = core.drafts
        actions = core.pool.place_with_siblings() + core.balancer.fill(self.group_size())
        # the tail may begin now (``DraftJobs.tail_begins``): before any worker plans jobs beside its requests
        if drafts.tail is None and core.settings.min_requests_beside_draft_jobs_at_tail:
            for w in core.workers.values():
                if cleared := drafts.tail_begins(w):
                    actions += cleared
                    break
        for w in core.workers.values():
            actions += self.fill(w, limit=0)  # idle workers without work: drafts
        return actions

    def group_size(self) -> int:
        step = self.core.current_step()
        if step is None or self.core.settings.spread_samples:
            return 1
        return self.core.pool.group_size if step.spec.step_id == POOL else step.spec.sampling.n

    def fill(self, w: WorkerState, limit: int | None = None, plan: bool = True) -> list[Action]:
        """Give ``w`` up to ``limit`` more requests (default: up to its capacity), then plan its
        draft jobs unless ``plan`` is off (``fill_all`` plans once the whole placement is done:
        a job planned beside a worker's first request would be stopped by its second)."""
        core = self.core
        wid = w.hello.worker_id
        if w.loading is not None or w.load_failed is not None or w.asleep or wid not in core.workers:
            return []
        now = core.clock()
        drafts = core.drafts
        actions: list[Action] = []
        running, capacity = w.running, w.hello.capacity  # read once: this runs once per completion
        budget = capacity if limit is None else limit
        while len(running) < capacity and budget > 0:
            budget -= 1
            key = self.next_for(w)
            if key is None:
                break
            step = core.steps[step_of(key)]
            actions += self.start_request(w, step, step.requests[key], now)
        if plan and running and core.settings.max_draft_jobs_beside_requests:
            actions += drafts.plan(w, drafts.beside(w, len(running)))
        elif plan and not running and not drafts.held:  # held: work is due the moment the held results come
            actions += drafts.tail_begins(w) + drafts.plan(w)
        core.timing.set_state(w, now)
        return actions

    def start_request(self, w: WorkerState, step: StepState, req: RequestState, now: float) -> list[Action]:
        """Hand queued ``req`` (taken off its queue) to ``w``, which has room and may run it."""
        core = self.core
        wid, key = w.hello.worker_id, req.spec.key
        actions: list[Action] = []
        if req.resume is not None:
            w.moved_in.add(key)
        if w.drafts:
            actions += core.drafts.stop(w, keep=core.drafts.beside(w, len(w.running) + 1))
        req.worker, req.started_at, req.progress, req.progress_at = wid, now, req.progress if req.resume else 0, now
        w.running.add(key)
        if step.spec.step_id == POOL:
            core.pool.placed(req, wid)
        core.balancer.stalls.started(step.spec.step_id, key, wid, now, core.settings.stall_seconds)
        actions.append(Assign(wid, req.spec, min(core.history.predicted(req.spec.prompt_token_ids),
                                                 float(req.spec.sampling.max_tokens)), req.resume))
        return actions

    def next_for(self, w: WorkerState) -> str | None:
        core = self.core
        if core.drafts.held:  # a step's own prompts wait for their stopped draft jobs' results (``stop_arrived``)
            return None
        while w.private:
            key = w.private.popleft()
            if self.takeable(w, key):
                return key
        for step in core.steps.values():
            # an empty queue first: the cheapest test and, at a step's tail, the usual answer
            if step.shared and step.active and step.spec.policy_version == w.version \
                    and not core.pauser.holds(step.spec.step_id):
                if step.spec.step_id == POOL and (key := core.pool.take_preferred(w)) is not None:
                    return key  # its conversation's prefix is in ``w``'s KV cache (core/affinity.py)
                for _ in range(len(step.shared)):  # keys it may not take go to the back, once
                    key = step.shared.popleft()
                    if self.takeable(w, key):
                        return key
        return None

    def takeable(self, w: WorkerState, key: str) -> bool:
        core = self.core
        step = core.steps.get(step_of(key))
        if step is None or not step.active:
            return False
        req = step.requests.get(key)
        if req is None or req.done or req.worker is not None:  # None: a pool request whose caller went away
            return False
        if step.spec.policy_version != w.version or not serves(w, step.spec.sampling) \
                or (req.spec.adapter is not None and not core.pool.adapters.holds(w.hello.worker_id, req.spec.adapter)):
            step.shared.append(key)  # someone with the right version, logprobs and adapter will take it
            return False
        if req.moved_from is None and not req.failures:
            return True  # the common case: never moved nor failed, so no worker to keep it from
        if req.resume is not None and not w.hello.accepts_resume:
            if any(o.hello.accepts_resume for o in core.workers.values()):
                step.shared.append(key)  # it goes on from a partial: only a worker that can continue one
                return False
            req.resume = None  # no worker left that can: it runs again from the start, as after a failure
        tried = {wid for wid, _ in req.failures}
        if (req.moved_from == w.hello.worker_id or w.hello.worker_id in tried) and self.another_can_run(w, step, tried):
            step.shared.append(key)  # moved off this (slow or stalled) worker, or failed on it: not back to it
            return False
        return True

    def another_can_run(self, w: WorkerState, step: StepState, tried: set[str] = frozenset()) -> bool:  # type: ignore[assignment]
        """Whether a worker other than ``w``, and none of those in ``tried``, can run the step's work."""
        return any(o is not w and o.hello.worker_id not in tried and o.load_failed is None
                   and o.version == step.spec.policy_version and serves(o, step.spec.sampling)
                   for o in self.core.workers.values())


def serves(w: WorkerState, sampling: SamplingParams) -> bool:
    """``w`` returns the logprobs ``sampling`` asks for ('' = any: the shell resolves the default)."""
    return sampling.logprobs_mode in ("", w.hello.logprobs_mode)
