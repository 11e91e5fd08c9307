"""The core's mutable records of workers, requests and steps (what ``SchedulerCore`` and its
collaborators, ``Balancer``, ``Pauser``, the status encoder, share). Outside the core nothing
reads them: the shell reads the frozen views of ``core/view.py``."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bubblespec.common.types import Completion, Provenance, SourceStats, StepSummary
from bubblespec.scheduler.core.types import (
    RequestSpec,
    StepFailed,
    StepSpec,
    Timeline,
    WorkerHello,
    WorkerStatus,
)

__all__ = ["CoreParts", "RequestState", "StepState", "WorkerState"]


@dataclass
class WorkerState:
    """One connected worker as the core tracks it."""

    hello: WorkerHello
    version: int
    joined_at: float
    last_seen: float
    loading: int | None = None
    load_failed: int | None = None
    asleep: bool = False  # its engine sleeps (vLLM's /sleep, core/sleep.py): no request, no draft job
    running: set[str] = field(default_factory=set)
    private: deque[str] = field(default_factory=deque)
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # job id -> prompt
    stopping: dict[str, tuple[int, ...]] = field(default_factory=dict)  # stopped, result pending
    incoming: str | None = None  # a request moving to it (core/moves.py): it takes no other until that one comes
    moved_in: set[str] = field(default_factory=set)  # requests it runs that moved to it: no draft job beside them
    tokens_per_second: float = 0.0
    busy_tokens_per_second: float = 0.0  # last rate reported while it had work (idle rates say nothing)
    state: WorkerStatus = WorkerStatus.IDLE
    state_since: float = 0.0
    timeline: Timeline = field(default_factory=Timeline)

    @property
    def capacity(self) -> int:
        return self.hello.capacity


@dataclass(slots=True)
class RequestState:
    """One request (one sample of one prompt) of a step (slots: one per request, made as its step
    arrives)."""

    spec: RequestSpec
    worker: str | None = None
    started_at: float = 0.0
    progress: int = 0
    progress_at: float = 0.0
    done: bool = False
    moved_from: str | None = None  # the worker it was moved off: it goes back there only if no one else can run it
    failures: list[tuple[str, str]] = field(default_factory=list)  # failed attempts: (worker id, reason)
    moving_to: str | None = None  # asked to stop on its worker, to go on from its partial on this one
    resume: Completion | None = None  # its partial completion, once it moved (core/moves.py)


@dataclass
class StepState:
    """One step: its requests, its shared queue, its time accounting, its outcome."""

    spec: StepSpec
    requests: dict[str, RequestState]
    shared: deque[str]
    started_at: float
    completions: dict[str, Completion] = field(default_factory=dict)
    finished_at: float | None = None
    cancelled: bool = False
    moved: int = 0
    requeued: int = 0
    busy: float = 0.0
    idle: float = 0.0
    drafting: float = 0.0
    summary: StepSummary | None = None
    failure: StepFailed | None = None  # set when the step ended in failure (no summary then)
    ordered_at: float = float("-inf")  # when core/probes.py last ordered its shared queue

    @property
    def active(self) -> bool:
        return self.finished_at is None


class CoreParts(Protocol):
    """What the core's collaborators use of ``SchedulerCore``: ``Balancer`` (``balance.py``),
    ``Mover`` (``moves.py``), ``RequestPool`` (``pool.py``), ``Pauser`` (``pause.py``),
    ``NoWorkers`` (``liveness.py``) and the status snapshot (``status.py``, through
    ``CoreView.status``) take the core as this, so that none of them imports ``state.py``, which
    imports them. ``WeightTransfer`` (``transfer.py``) names ``SchedulerCore`` itself, for type
    checking only."""

    settings: Any
    """``CoreSettings``."""
    clock: Callable[[], float]
    workers: dict[str, WorkerState]
    steps: dict[str, StepState]
    versions: Any
    """``PolicyVersions``."""
    planner: Any
    """``DraftPlanner``."""
    pauser: Any
    """``Pauser``."""
    timing: Any
    """``TimeAccounting``."""

    mover: Any
    """``Mover``."""
    pool: Any
    """``RequestPool``."""
    balancer: Any
    """``Balancer``."""
    history: Any
    """``LengthHistory``."""
    rng: Any
    """``random.Random``: draft jobs' seeds."""
    drafts: Any
    """``DraftJobs``."""
    dispatcher: Any
    """``Dispatcher``."""

    @property
    def version(self) -> int: ...

    @property
    def weights_path(self) -> str: ...

    def current_step(self) -> StepState | None: ...

    def open_step(self, spec: StepSpec) -> StepState: ...

    def close_step(self, step_id: str) -> None: ...

    def new_request(self, spec: RequestSpec) -> RequestState: ...

    def take_back(self, step: StepState, req: RequestState, worker_id: str, reason: str) -> list: ...

    def cancel_step(self, step_id: str) -> list: ...


def total_provenance(provenances: Iterable[Provenance]) -> Provenance:
    """``sum(provenances, Provenance())`` in one pass: the same forward passes, and the same
    per-source sums in the same (sorted) order, without a new ``Provenance`` per completion
    (a step of 262,144 completions ends in one call)."""
    passes = 0
    merged: dict[str, list[int]] = {}
    for p in provenances:
        passes += p.forward_passes
        for s in p.sources:
            acc = merged.get(s.source)
            if acc is None:
                acc = merged[s.source] = [0, 0]
            acc[0] += s.drafted_tokens
            acc[1] += s.accepted_tokens
    return Provenance(passes, tuple(SourceStats(k, d, a) for k, (d, a) in sorted(merged.items())))
