"""What workers tell the core, as frozen dataclasses (``SchedulerCore.handle`` takes them).

The shell turns each worker message into one of these (protobuf stays at the edge:
``scheduler/wire.py``) and executes the actions ``handle`` returns. Whether an event is
taken (the request still runs on that worker, the tokens are inside the vocabulary, the
version was asked, ...) is the core's decision alone; one it does not take changes nothing
and comes back as an ``Ignored`` action or an ``InvalidRequest``.
"""

from __future__ import annotations

from dataclasses import dataclass

from bubblespec.common.types import Completion
from bubblespec.scheduler.core.types import WorkerHello

__all__ = [
    "Aborted", "Completed", "DraftResult", "Heartbeat", "PolicyLoaded", "Progress", "WorkerEvent", "WorkerJoined",
    "WorkerLeft", "WorkerSeen",
]


@dataclass(frozen=True)
class WorkerJoined:
    """A worker said hello (a reconnect: the shell sends ``WorkerLeft`` for the old stream first)."""

    hello: WorkerHello


@dataclass(frozen=True)
class WorkerLeft:
    """The worker's stream ended (or was replaced); ``reason`` goes into the failed attempts."""

    worker_id: str
    reason: str = "the worker left"


@dataclass(frozen=True)
class WorkerSeen:
    """A message the core has no other use for (a control call's answer): the worker is alive."""

    worker_id: str


@dataclass(frozen=True)
class Heartbeat:
    """The worker's current generation throughput (tokens per second, finite and >= 0)."""

    worker_id: str
    tokens_per_second: float


@dataclass(frozen=True)
class Progress:
    """Request ``key`` has generated ``tokens`` tokens so far."""

    worker_id: str
    key: str
    tokens: int


@dataclass(frozen=True)
class Completed:
    """Request ``key`` is done (``completion.worker_id`` is stamped by the shell: the sender)."""

    worker_id: str
    key: str
    completion: Completion


@dataclass(frozen=True)
class Aborted:
    """The worker could not run request ``key``; or, with ``partial``, it stopped it as asked
    (``Abort.keep_partial``) and sent what it generated so far."""

    worker_id: str
    key: str
    reason: str = ""
    partial: Completion | None = None


@dataclass(frozen=True)
class DraftResult:
    """Draft job ``job_id`` ended after ``tokens`` tokens (``finished``: it ran to the end)."""

    worker_id: str
    job_id: str
    tokens: int
    finished: bool = True


@dataclass(frozen=True)
class PolicyLoaded:
    """The worker's answer to ``LoadPolicy``: ``ok`` or ``error``; ``weights_unknown``: the load
    failed after its weights changed; ``seconds``: how long it took."""

    worker_id: str
    version: int
    ok: bool
    error: str = ""
    weights_unknown: bool = False
    seconds: float = 0.0


WorkerEvent = (WorkerJoined | WorkerLeft | WorkerSeen | Heartbeat | Progress | Completed | Aborted | DraftResult
               | PolicyLoaded)
