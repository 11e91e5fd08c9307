"""Which workers fell silent (pure): ``CoreSettings.worker_timeout_seconds`` of silence, not
counting the time the scheduler itself could not listen.

The scheduler reads every worker's stream on its one event loop. When that loop stalls (a burst
of HTTP calls, a long dispatch, the OS not running the process), the messages workers sent wait
unread in their streams, and every worker looks silent at once although none is: declaring them
dead would re-run all their requests on workers that are just as alive. So the service tells the
core's tick how late it fired (``SchedulerService.tick_forever``: the time between two ticks
beyond the period, the tick's own work included), and that stall is added to every worker's
``last_seen``: a worker's silence is the listening time in which nothing came from it. A worker
that is really gone is found that much later, never sooner.
"""

from __future__ import annotations

from collections.abc import Iterable

from bubblespec.scheduler.core.records import WorkerState

__all__ = ["silent_workers"]


def silent_workers(workers: Iterable[WorkerState], now: float, stalled: float,
                   timeout: float) -> list[tuple[WorkerState, float]]:
    """The workers silent for longer than ``timeout`` at ``now``, each with how long, once the
    scheduler's last ``stalled`` seconds of not listening are taken off everyone's silence."""
    silent = []
    for w in workers:
        if stalled > 0:
            w.last_seen = min(now, w.last_seen + stalled)
        if now - w.last_seen > timeout:
            silent.append((w, now - w.last_seen))
    return silent
