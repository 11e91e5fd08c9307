"""The core's read-only view: what the shell (metrics, ``/status``, the servicers, the HTTP
routes, the bench) may know of the core's state, as frozen snapshots.

Outside ``scheduler/core`` nothing reads the core's records (``core/records.py``) or its
collaborators; ``SchedulerCore.stats()``, ``.step()`` and ``.worker()`` build these views,
and a few cheap properties (``policy_version``, ``model_limits``, ...) answer the hot paths.
``tests/unit/test_core_boundary.py`` keeps it so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

from bubblespec.common.types import Completion, StepSummary
from bubblespec.scheduler.core.records import CoreParts, StepState, WorkerState
from bubblespec.scheduler.core.types import Action, ModelLimits, StepFailed, WorkerStatus

__all__ = ["CoreStats", "CoreView", "StepView", "WorkerView", "step_view", "worker_view"]


@dataclass(frozen=True)
class WorkerView:
    """One connected worker, as of ``CoreStats.now``."""

    worker_id: str
    state: WorkerStatus
    """What it does now (loading counts as busy in the seconds below)."""
    policy_version: int
    """The version it holds (-1: unknown after a failed load)."""
    capacity: int
    running: int
    """Requests running on it."""
    queued: int
    """Requests in its private queue (``static`` policy)."""
    tokens_per_second: float
    model: str
    tensor_parallel_size: int
    busy_seconds: float
    """Busy (or loading) seconds since it joined, the open segment included."""
    idle_seconds: float
    drafting_seconds: float
    segments: tuple[tuple[str, float, float], ...] = ()
    """Its recent closed timeline segments (state, since, until): only from ``core.worker()``."""
    dtype: str = ""
    """The dtype its engine runs the model in ('' = not said)."""


@dataclass(frozen=True)
class StepView:
    """One step the core keeps (active, or among the last ``keep_steps`` finished)."""

    step_id: str
    policy_version: int
    active: bool
    cancelled: bool
    started_at: float
    finished_at: float | None
    requests: int
    """Requests of the step (prompts x n)."""
    completed: int
    pending: int
    """Requests not yet delivered."""
    moved: int
    requeued: int
    last_progress_at: float
    """Latest core-clock time a running request of the step reported progress (0: none)."""
    summary: StepSummary | None
    failure: StepFailed | None
    completions: tuple[Completion, ...] = ()
    """Delivered completions: only from ``core.step(step_id, completions=True)``."""


@dataclass(frozen=True)
class CoreStats:
    """A consistent snapshot of the whole core (``SchedulerCore.stats()``)."""

    now: float
    """The core's clock when it was taken."""
    policy_version: int
    weights_path: str
    limits: ModelLimits | None
    """The cluster's model limits (None before the first worker)."""
    paused: bool
    workers: tuple[WorkerView, ...]
    steps: tuple[StepView, ...]
    """Kept steps, in arrival order."""
    requests_waiting: int
    requests_running: int
    drafts_announced: int
    """Upcoming prompts the draft planner knows."""
    drafts_covered: int
    """Of those, prompts with at least one draft."""

    @property
    def active_steps(self) -> tuple[StepView, ...]:
        return tuple(s for s in self.steps if s.active)


def worker_view(w: WorkerState, now: float, segments: bool = False) -> WorkerView:
    """``w`` as a view; its open segment counts up to ``now`` (loading counts as busy)."""
    t = w.timeline
    totals = {"busy": t.busy, "idle": t.idle, "drafting": t.drafting}
    bucket = "busy" if w.state in (WorkerStatus.BUSY, WorkerStatus.LOADING) else str(w.state)
    if bucket in totals:
        totals[bucket] += max(0.0, now - w.state_since)
    return WorkerView(
        worker_id=w.hello.worker_id, state=w.state, policy_version=w.version, capacity=w.capacity,
        running=len(w.running), queued=len(w.private), tokens_per_second=w.tokens_per_second,
        model=w.hello.model, tensor_parallel_size=w.hello.tensor_parallel_size,
        busy_seconds=totals["busy"], idle_seconds=totals["idle"], drafting_seconds=totals["drafting"],
        segments=tuple(t.segments) if segments else (), dtype=w.hello.dtype,
    )


def step_view(s: StepState, completions: bool = False) -> StepView:
    """``s`` as a view (``completions``: with its delivered completions)."""
    progress = [r.progress_at for r in s.requests.values() if r.progress > 0 and not r.done] if s.active else []
    return StepView(
        step_id=s.spec.step_id, policy_version=s.spec.policy_version, active=s.active, cancelled=s.cancelled,
        started_at=s.started_at, finished_at=s.finished_at, requests=len(s.requests), completed=len(s.completions),
        pending=sum(1 for r in s.requests.values() if not r.done), moved=s.moved, requeued=s.requeued,
        last_progress_at=max(progress, default=0.0), summary=s.summary, failure=s.failure,
        completions=tuple(s.completions.values()) if completions else (),
    )


def waiting_and_running(steps: Iterable[StepState], workers: Iterable[WorkerState]) -> tuple[int, int]:
    """(requests queued, shared or private; requests running on workers)."""
    workers = list(workers)
    waiting = sum(len(s.shared) for s in steps if s.active) + sum(len(w.private) for w in workers)
    return waiting, sum(len(w.running) for w in workers)


class CoreView:
    """The public, read-only side of ``SchedulerCore`` (its base class), plus the pause
    commands: what the shell may call besides events and trainer calls
    (``tests/unit/test_core_boundary.py``). Frozen views and cheap values only."""

    settings: Any
    clock: Callable[[], float]
    workers: dict[str, WorkerState]
    steps: dict[str, StepState]
    limits: ModelLimits | None
    planner: Any
    pauser: Any
    pool: Any
    versions: Any

    def current_step(self) -> StepState | None:
        raise NotImplementedError

    def stats(self) -> CoreStats:
        """A consistent snapshot of the whole core (metrics, ``/status``, the HTTP routes)."""
        now = self.clock()
        covered, announced = self.planner.coverage()
        waiting, running = waiting_and_running(self.steps.values(), self.workers.values())
        waiting += len(self.pool.parked)  # calls that came while paused wait too (core/pool.py)
        return CoreStats(
            now=now, policy_version=self.versions.version, weights_path=self.versions.weights_path, limits=self.limits,
            paused=self.pauser.paused, workers=tuple(worker_view(w, now) for w in self.workers.values()),
            steps=tuple(step_view(s) for s in self.steps.values()), requests_waiting=waiting,
            requests_running=running, drafts_announced=announced, drafts_covered=covered,
        )

    def step(self, step_id: str, completions: bool = False) -> StepView | None:
        """Step ``step_id`` if the core keeps it (``completions``: with its delivered ones)."""
        s = self.steps.get(step_id)
        return None if s is None else step_view(s, completions)

    def has_step(self, step_id: str) -> bool:
        """Whether the core keeps step ``step_id`` (active, or among the last finished)."""
        return step_id in self.steps

    def worker(self, worker_id: str) -> WorkerView | None:
        """Worker ``worker_id`` if connected, with its recent timeline segments."""
        w = self.workers.get(worker_id)
        return None if w is None else worker_view(w, self.clock(), segments=True)

    def now(self) -> float:
        """The core's clock."""
        return self.clock()

    @property
    def policy_version(self) -> int:
        """The cluster's policy version (what a new step must name)."""
        return self.versions.version

    @property
    def policy_weights_path(self) -> str:
        """Where the current version's weights are ('' before the first update)."""
        return self.versions.weights_path

    @property
    def policy_loading(self) -> int | None:
        """The version an update in progress loads (None: no update is in progress)."""
        return self.versions.updating

    @property
    def model_limits(self) -> ModelLimits | None:
        """The cluster's model limits, set by the first worker (None before)."""
        return self.limits

    @property
    def worker_count(self) -> int:
        """Workers connected."""
        return len(self.workers)

    @property
    def any_step_active(self) -> bool:
        """Whether a step runs (or is held by a pause)."""
        return self.current_step() is not None

    def restore_policy(self, version: int, weights_path: str) -> None:
        """A restarted scheduler takes the version and weights path its journal kept (before
        any worker joins: each joining worker then loads it)."""
        self.versions.restore(version, weights_path)

    def status(self) -> dict:
        """A JSON-able snapshot for /status and the UI."""
        from bubblespec.scheduler.core.status import snapshot

        return snapshot(cast(CoreParts, self))  # this base class is only ever a SchedulerCore

    # ---------------------------------------------------------------- pause --

    @property
    def paused(self) -> bool:
        """Whether ``/pause`` is in force (new steps are refused)."""
        return self.pauser.paused

    def pause(self, mode: str) -> list[Action]:
        """vLLM's ``/pause`` (``core/pause.py``)."""
        return self.pauser.pause(mode)

    def pause_waiting(self) -> list[str]:
        """Active steps a ``wait`` pause still waits for."""
        return self.pauser.waiting()

    def resume(self) -> list[Action]:
        """vLLM's ``/resume``."""
        return self.pauser.resume()
