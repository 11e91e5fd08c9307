"""Time accounting: how long each worker spent busy, idle or drafting, overall and within the
running step (pure; the core's injected clock gives ``now``).

Each worker's ``WorkerState.timeline`` holds its closed seconds per bucket and its recent
segments (for the UI); the step running while a segment closes gets its share in
``StepState.busy`` / ``idle`` / ``drafting`` (the step summary's worker seconds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from bubblespec.scheduler.core.records import StepState, WorkerState
from bubblespec.scheduler.core.types import WorkerStatus

__all__ = ["TimeAccounting", "worker_status"]


def worker_status(w: WorkerState) -> WorkerStatus:
    """What ``w`` is doing now, from its records."""
    return (WorkerStatus.LOADING if w.loading is not None else WorkerStatus.BUSY if w.running
            else WorkerStatus.DRAFTING if w.drafts else WorkerStatus.IDLE)


class TimeAccounting:
    """Closes a worker's time segment whenever its state changes (``set_state``)."""

    def __init__(self, segments_kept: int, current_step: Callable[[], StepState | None]) -> None:
        self.segments_kept = segments_kept  # CoreSettings.timeline_segments
        self.current_step = current_step

    def set_state(self, w: WorkerState, now: float) -> None:
        """Re-derive ``w``'s state; on a change, close the segment of the old one."""
        state = worker_status(w)
        if state != w.state:
            self.close(w, now)
            w.state, w.state_since = state, now

    def close(self, w: WorkerState, now: float) -> None:
        """Account ``w``'s open segment up to ``now`` (to the worker and to the running step)."""
        elapsed = now - w.state_since
        if elapsed <= 0:
            return
        bucket = "busy" if w.state in (WorkerStatus.BUSY, WorkerStatus.LOADING) else str(w.state)
        setattr(w.timeline, bucket, getattr(w.timeline, bucket) + elapsed)
        segs = w.timeline.segments
        segs.append((w.state, w.state_since, now))
        if len(segs) > self.segments_kept:
            del segs[: len(segs) - self.segments_kept]
        step = self.current_step()
        if step is not None:
            start = max(w.state_since, step.started_at)
            setattr(step, bucket, getattr(step, bucket) + max(0.0, now - start))
        w.state_since = now

    def flush(self, workers: Iterable[WorkerState], now: float) -> None:
        """Close every worker's open segment (a step starts or ends)."""
        for w in workers:
            self.close(w, now)
