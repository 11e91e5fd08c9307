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
    from collections.abc import Callable

    from bubblespec.scheduler.core.records import CoreParts as SchedulerCore
    from bubblespec.scheduler.core.records import RequestState, WorkerState

__all__ = ["Balancer", "StallWatch"]


class Balancer:
    """Chooses the worker for queued work by predicted tokens left (module docstring) and keeps
    the ``StallWatch`` the core's straggler check reads."""

    def __init__(self, core: SchedulerCore):
        self.core = core
        self.stalls = StallWatch()
        """Running requests by stall deadline (the core's ``_rebalance``)."""

    def expected(self, req: RequestState) -> float:
        """Predicted tokens ``req`` still has to generate (at least one while it runs)."""
        prompt = req.spec.prompt_token_ids
        predicted = self.core.history.predicted(prompt) or float(len(prompt))  # no history yet: order by prompt length
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
        expected = self._memo_expected()
        self._longest_first_where_all_start_now(expected)
        heap = [(self.outstanding(w), len(w.running) / w.capacity, i, w.hello.worker_id)
                for i, w in enumerate(core.workers.values())]
        heapq.heapify(heap)
        actions: list[Action] = []
        while heap:
            load, _, i, wid = heapq.heappop(heap)
            w = core.workers.get(wid)
            if w is None:
                continue
            got = core.dispatcher.fill(w, limit=group, plan=False)  # drafts are planned after the placement
            actions += got
            assigned = [a for a in got if isinstance(a, Assign)]
            if not assigned:
                continue  # nothing it may take, or full: out of this round of filling
            for a in assigned:
                load += expected(core.steps[a.request.step_id].requests[a.request.key])
            heapq.heappush(heap, (load, len(w.running) / w.capacity, i, wid))
        return actions

    def _longest_first_where_all_start_now(self, expected: Callable[[RequestState], float]) -> None:
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
            # sorted is stable: a group's samples stay together
            step.shared = deque(sorted(step.shared, key=lambda k: -expected(step.requests[k])))
            left = len(step.shared)
            for wid in mine:  # what this step takes is not room for the next
                take = min(room[wid], left)
                room[wid] -= take
                left -= take

    def _memo_expected(self) -> Callable[[RequestState], float]:
        """``expected``, computed once per prompt, length cap and progress, for one ``fill``
        (which sorts and hands out a whole step: 262,144 requests at the simulator's scale).
        A step's samples of one prompt share one ``prompt_token_ids`` tuple, so the memo is
        keyed by that tuple's id (alive in the step's requests throughout): hashing the tuple
        is what ``expected`` costs. Nothing a fill does changes the length history."""
        memo: dict[tuple[int, int, int], float] = {}

        def expected(req: RequestState) -> float:
            spec = req.spec
            at = (id(spec.prompt_token_ids), spec.sampling.max_tokens, req.progress)
            value = memo.get(at)
            if value is None:
                value = memo[at] = self.expected(req)
            return value
        return expected


class StallWatch:
    """Running requests by the time they would count as stalled, so the core's periodic check
    looks only at those due instead of every running request (O(due) per tick, not O(running)).

    ``started`` is called when a request is handed to a worker; ``due(step, now, stall)`` pops
    the step's entries whose deadline passed and returns the keys that really did stall (no
    progress for ``stall`` seconds on the worker that holds them). An entry whose request made
    progress since is pushed back at its new deadline; one whose request finished or moved is
    dropped (each assignment has its own entry)."""

    def __init__(self) -> None:
        self._heaps: dict[str, list[tuple[float, int, str, str, float]]] = {}
        self._seq = 0

    def started(self, step_id: str, key: str, worker_id: str, at: float, stall: float) -> None:
        self._seq += 1
        heapq.heappush(self._heaps.setdefault(step_id, []), (at + stall, self._seq, key, worker_id, at))

    def due(self, step_id: str, requests: dict[str, RequestState], workers: dict[str, WorkerState],
            now: float, stall: float) -> list[tuple[str, str]]:
        """(worker id, key) of the step's requests running on one of ``workers`` that made no
        progress for more than ``stall`` seconds, in deadline order."""
        heap = self._heaps.get(step_id)
        out: list[tuple[str, str]] = []
        while heap and heap[0][0] < now:
            _, _, key, wid, at = heapq.heappop(heap)
            req = requests.get(key)
            if req is None or req.done or req.worker != wid or req.started_at != at:
                continue  # finished, moved or assigned again since (a newer entry watches it)
            w = workers.get(wid)
            if w is None or key not in w.running:
                continue
            last = max(req.progress_at, req.started_at)
            if now - last > stall:
                out.append((wid, key))
            else:
                self._seq += 1
                heapq.heappush(heap, (last + stall, self._seq, key, wid, at))
        return out

    def forget(self, keep: set[str]) -> None:
        """Drop the entries of steps not in ``keep`` (finished or trimmed steps)."""
        for sid in [s for s in self._heaps if s not in keep]:
            del self._heaps[sid]
