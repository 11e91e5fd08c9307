"""Which worker takes the next queued work: the one with the fewest predicted tokens to go (pure).

A collaborator of ``SchedulerCore`` (``core.balancer``). Refilling "least loaded first" by
request count is blind to length: where every worker has room for its whole share of a step
(an engine's ``max_num_seqs`` is often above a step's requests per worker), the shared queue
is handed out in one pass and the split is as good as chance, so the step's tail falls where
the long responses happen to land. Counting each worker's outstanding *predicted tokens*
(the core's length prediction: the prompt's own history, else its length times the running
response/prompt ratio, else its length alone) spreads the long ones over the workers instead,
and a worker that holds a long response takes fewer others. The shared queue's order is kept
(``longest-first`` orders it); only the choice of worker changes. Private queues (``static``)
are filled as before: their split was made up front.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING

from bubblespec.scheduler.core.types import Action, Assign

if TYPE_CHECKING:
    from bubblespec.scheduler.core.state import RequestState, SchedulerCore, WorkerState

__all__ = ["Balancer"]


class Balancer:
    def __init__(self, core: SchedulerCore):
        self.core = core

    def expected(self, req: RequestState) -> float:
        """Predicted tokens ``req`` still has to generate (at least one while it runs)."""
        prompt = req.spec.prompt_token_ids
        predicted = self.core._predicted(prompt) or float(len(prompt))  # no history yet: order by prompt length
        return max(1.0, min(predicted, float(req.spec.sampling.max_tokens)) - req.progress)

    def outstanding(self, w: WorkerState) -> float:
        """Predicted tokens of everything ``w`` runs now."""
        total = 0.0
        for key in w.running:
            step = self.core.steps.get(key.split("/", 1)[0])
            req = step.requests.get(key) if step is not None else None
            if req is not None:
                total += self.expected(req)
        return total

    def fill(self, group: int) -> list[Action]:
        """Hand out queued work one sample group (``group`` requests) at a time, each to the
        worker with room and the fewest outstanding predicted tokens (ties: fewest running
        for its capacity, then the order workers joined in)."""
        core = self.core
        self._longest_first_where_all_start_now()
        heap = [(self.outstanding(w), len(w.running) / w.capacity, i, w.hello.worker_id)
                for i, w in enumerate(core.workers.values())]
        heapq.heapify(heap)
        actions: list[Action] = []
        while heap:
            load, _, i, wid = heapq.heappop(heap)
            w = core.workers.get(wid)
            if w is None:
                continue
            got = core._fill(w, limit=group)
            actions += got
            assigned = [a for a in got if isinstance(a, Assign)]
            if not assigned:
                continue  # nothing it may take, or full: out of this round of filling
            for a in assigned:
                load += self.expected(core.steps[a.request.step_id].requests[a.request.key])
            heapq.heappush(heap, (load, len(w.running) / w.capacity, i, wid))
        return actions

    def _longest_first_where_all_start_now(self) -> None:
        """Where the workers have room for a step's whole shared queue, every request in it
        starts now whatever its place, so place them longest first (LPT: the long ones
        spread, the short ones fill in around them). Where they do not, the queue's order
        decides what starts first and is kept."""
        core = self.core
        room = {w.hello.worker_id: max(0, w.capacity - len(w.running)) for w in core.workers.values()
                if w.loading is None and w.load_failed is None}
        for step in core.steps.values():
            if not step.active or len(step.shared) < 2:
                continue
            mine = [wid for wid in room if core.workers[wid].version == step.spec.policy_version]
            free = sum(room[wid] for wid in mine)
            if free < len(step.shared):
                continue
            step.shared = deque(sorted(step.shared, key=lambda k: -self.expected(step.requests[k])))  # stable: groups stay together
            left = len(step.shared)
            for wid in mine:  # what this step takes is not room for the next
                take = min(room[wid], left)
                room[wid] -= take
                left -= take
