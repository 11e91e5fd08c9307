"""One sample of every prompt first, then the samples of the prompts that run longest (pure).

Where a step has more requests than its workers have slots, the shared queue's order decides
what starts late, and a long response that starts late ends the step late. A new prompt's
length is unknown until one of its samples runs, but its samples' lengths go together (a hard
problem is long for every sample). So a multi-wave step's queue starts with one sample of
every prompt (its *probe*, ``probe_first``), and while the step runs, the rest are kept in
order of what the probes say (``by_probes``, each tick): a prompt whose probe finished short
goes back, one whose probe still runs (and has produced more than the others' whole
responses) goes forward. The prediction of a prompt is the larger of the core's length
history (which records each delivered sample) and the progress of its longest-running
sample; requests of one prompt keep their order (a stable sort), and requests moved off a
slow worker or requeued after a failure stay in front, where the core put them. A step that fits in the free
slots at once is left alone: every request starts now, and the balancer places them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable

from bubblespec.scheduler.core.records import RequestState, StepState

__all__ = ["by_probes", "probe_first"]


def probe_first(order: Iterable[str], requests: dict[str, RequestState]) -> list[str]:
    """``order`` with the first queued sample of each prompt moved to the front (both parts
    keep their order)."""
    seen: set[str] = set()
    probes: list[str] = []
    rest: list[str] = []
    for key in order:
        prompt = requests[key].spec.prompt_id
        (rest if prompt in seen else probes).append(key)
        seen.add(prompt)
    return probes + rest


REORDER_SECONDS = 1.0
"""Shortest time between two orderings of one step's queue: a sort of the whole queue each
tick (0.25 s in the service) cost ~8% of a saturated scheduler's CPU, and progress reports,
which move the order, come every 0.5 s per request at most."""


def by_probes(step: StepState, predicted: Callable[[tuple[int, ...]], float], running: Iterable[RequestState],
              now: float) -> None:
    """Order ``step.shared`` longest predicted prompt first (module docstring): per prompt,
    ``max(predicted(prompt), progress of its furthest sample in ``running``)``, capped at its
    ``max_tokens``. Stable, so a prompt's queued samples stay in their order. At most once per
    ``REORDER_SECONDS`` of ``now``."""
    if len(step.shared) < 2 or now - step.ordered_at < 0.999 * REORDER_SECONDS:  # a tick of exactly it may read 0.99999
        return
    step.ordered_at = now
    progress: dict[str, int] = {}
    for req in running:
        pid = req.spec.prompt_id
        progress[pid] = max(progress.get(pid, 0), req.progress)
    memo: dict[str, float] = {}

    def key(k: str) -> float:
        req = step.requests[k]
        if req.moved_from is not None or req.failures:
            return -math.inf  # moved off a slow worker or requeued after a failure: it stays in front
        spec = req.spec
        value = memo.get(spec.prompt_id)
        if value is None:
            guess = max(predicted(spec.prompt_token_ids), float(progress.get(spec.prompt_id, 0)))
            value = memo[spec.prompt_id] = -min(guess, float(spec.sampling.max_tokens))
        return value

    step.shared = deque(sorted(step.shared, key=key))
