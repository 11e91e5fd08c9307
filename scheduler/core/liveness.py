"""A cluster with no worker (pure): how long calls wait for one, and what they get after.

vLLM's server goes down, or answers errors, when its engine dies. A BubbleSpec cluster whose
every worker is gone waits for one to connect (a worker that restarts rejoins in tens of
seconds), but not forever: once no worker has been connected for longer than
``CoreSettings.no_worker_timeout_seconds`` (60 s by default; None: wait forever), every step
still running fails UNAVAILABLE naming the cause (``StepFailed.code``; gRPC ``UNAVAILABLE``,
which the SDK retries), every request of an independent call fails the same way
(``RequestFailed.code``; HTTP 503), and new steps and calls are refused the same way until a
worker connects; then service resumes. Each call is answered once: a failed step ends
(``StepState.finished_at``), a failed request leaves the pool.

A step failed so is not final: a ``Generate`` with the same step id and content (the SDK's
retry once a worker is back) runs it again (``retry``): with the journal on, the completions
it delivered before are replayed and only the rest runs; without, it runs from the start
(the SDK keeps one completion per sample).

The wait is counted from the moment the last worker left (``emptied``); a scheduler that
never had a worker refuses calls at once anyway (``workers: no worker has connected yet``).
"""

from __future__ import annotations

from bubblespec.scheduler.core.records import CoreParts, StepState
from bubblespec.scheduler.core.pool import POOL
from bubblespec.scheduler.core.types import Action, ErrorCode, InvalidRequest, RequestFailed, StepFailed

__all__ = ["NoWorkers"]


class NoWorkers:
    """Since when the cluster has had no worker, and the calls that fail past the timeout; a
    collaborator of ``SchedulerCore`` (``core.liveness``)."""

    def __init__(self, core: CoreParts):
        self.core = core
        self.since: float | None = None
        """When the last worker left (None: a worker is connected, or none ever was)."""

    @property
    def timeout(self) -> float | None:
        return self.core.settings.no_worker_timeout_seconds

    def emptied(self, now: float) -> None:
        """The last connected worker left at ``now``."""
        self.since = now

    def down(self, now: float) -> str | None:
        """Why calls fail now (no worker for longer than the timeout), or None."""
        timeout = self.timeout
        if self.core.workers or self.since is None or timeout is None or now - self.since <= timeout:
            return None
        return (f"no worker has been connected for {now - self.since:.0f}s (CoreSettings.no_worker_timeout_seconds "
                f"= {timeout:g}): every engine of the cluster is gone; calls fail until a worker connects")

    def check(self, field: str) -> None:
        """Refuse a new step or call (UNAVAILABLE, naming ``field``) while calls fail."""
        why = self.down(self.core.clock())
        if why is not None:
            raise InvalidRequest(field, why, ErrorCode.UNAVAILABLE)

    def retry(self, step: StepState) -> bool:
        """Whether ``step`` failed for want of workers and may be submitted again (it is forgotten)."""
        if step.failure is None or step.failure.code != ErrorCode.UNAVAILABLE:
            return False
        self.core.steps.pop(step.spec.step_id, None)
        return True

    def tick(self, now: float) -> list[Action]:
        """Past the timeout: fail every running step and every request of the pool."""
        if self.core.workers:
            self.since = None
            return []
        why = self.down(now)
        if why is None:
            return []
        actions: list[Action] = []
        for step in [s for s in self.core.steps.values() if s.active and s.spec.step_id != POOL]:
            step.shared.clear()  # with no worker, nothing of it runs or waits on one
            step.finished_at = now
            step.failure = StepFailed(step.spec.step_id, "workers", why, ErrorCode.UNAVAILABLE)
            actions.append(step.failure)
        pool = self.core.pool
        if pool.step is not None:
            keys = list(pool.step.requests)
            actions += pool.cancel(keys)
            actions += [RequestFailed(key, "workers", why, ErrorCode.UNAVAILABLE) for key in keys]
        return actions
