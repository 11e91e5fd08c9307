"""The policy version and its barrier (pure): the cluster's version and weights path, the
update in progress and the workers it waits for, with one owner (``PolicyVersions``,
``core.versions``).

Every change of version goes through one command, ``SchedulerCore.update_policy``, whoever
asks: gRPC's ``UpdatePolicy`` (an explicit version), HTTP's ``/update_weights`` and
``/reload_weights`` (``version`` None: the next one, numbered here), and weight transfer's
``start`` (``pushed_to``: the trainer pushes the weights to its group, nothing is loaded;
``core/transfer.py``). A refusal names the caller's own field for the version (``field``).

An update opens the barrier: each worker it asks stops its draft jobs and takes no work until
it answered (``loaded``); a worker that joins meanwhile loads it too, and the barrier waits for
it; a new step is refused meanwhile. Once every live worker answered, the version is the
cluster's if all of them loaded it (``PolicyReady``), else the cluster stays where it was
(``PolicyFailed``, naming each worker that did not, with its reason).
"""

from __future__ import annotations

from collections.abc import Collection, Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bubblespec.scheduler.core.types import (
    Action,
    ErrorCode,
    Ignored,
    InvalidRequest,
    LoadPolicy,
    PolicyFailed,
    PolicyLoadReported,
    PolicyReady,
    WorkerHello,
)

if TYPE_CHECKING:
    from bubblespec.scheduler.core.records import CoreParts, WorkerState

__all__ = ["PolicyBarrier", "PolicyVersions"]

MAX_REASON_CHARS = 300
"""A worker's reason is cut to this length in the ``UpdatePolicy`` error (each worker is named)."""


@dataclass
class PolicyBarrier:
    """A policy update in progress: what is loaded, and how each worker answered so far."""

    version: int
    weights_path: str
    loaded: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # worker id -> its reason

    def answer(self, worker_id: str, ok: bool, error: str) -> None:
        if ok:
            self.loaded.add(worker_id)
        else:
            self.failed[worker_id] = (error or "no reason given")[:MAX_REASON_CHARS]

    def outcome(self, live: Container[str], current: int) -> PolicyReady | PolicyFailed:
        """``PolicyReady`` if every worker still live loaded the version (and one did), else
        ``PolicyFailed`` naming each live worker that did not, with its reason; ``current``
        is the version the cluster stays at."""
        failed = {wid: why for wid, why in self.failed.items() if wid in live}
        loaded = [wid for wid in self.loaded if wid in live]
        if loaded and not failed:
            return PolicyReady(self.version, len(loaded))
        if not failed:
            return PolicyFailed(self.version, ErrorCode.UNAVAILABLE, "workers", f"no live worker is left to load version "
                                f"{self.version}; the cluster stays at version {current}")
        reasons = "; ".join(f"worker {wid}: {why}" for wid, why in sorted(failed.items()))
        return PolicyFailed(self.version, ErrorCode.FAILED_PRECONDITION, "weights_path",
                            f"version {self.version} did not load on {len(failed)} of {len(failed) + len(loaded)} "
                            f"live worker(s); the cluster stays at version {current}: {reasons}")


class PolicyVersions:
    """The cluster's policy version, its weights path, and the update in progress: their one
    owner (``core.versions``). Nothing else writes them."""

    def __init__(self, core: CoreParts):
        self.core = core
        self.version = 0
        """The cluster's version: what a new step must name."""
        self.weights_path = ""
        """Where its weights are ('' before the first update; weight transfer's: a label)."""
        self.barrier: PolicyBarrier | None = None
        """The update in progress; ``version`` moves when it succeeds."""
        self.waiting: set[str] = set()
        """Workers the barrier still waits for."""

    @property
    def updating(self) -> int | None:
        """The version an update in progress loads (None: none)."""
        return None if self.barrier is None else self.barrier.version

    # ---------------------------------------------------------------- workers --

    def admit(self, hello: WorkerHello, fresh: bool) -> int:
        """The cluster's version once ``hello``'s worker joins (``fresh``: a scheduler with no
        worker, step or weights yet adopts the worker's); refuses, changing nothing, a worker
        that could not be brought to it."""
        version = hello.policy_version if fresh else self.version
        if hello.policy_version != version and not self.weights_path and self.barrier is None:
            raise InvalidRequest("hello.policy_version", f"worker has version {hello.policy_version}; the cluster "
                                 f"runs {version} and has no weights path to send", ErrorCode.FAILED_PRECONDITION)
        return version

    def joined(self, w: WorkerState, version: int) -> list[Action]:
        """``w`` joined a cluster at ``version`` (``admit``): it loads the update in progress (the
        barrier waits for it too), or the cluster's version where it holds another."""
        self.version = version
        b = self.barrier
        if b is not None:
            w.loading = b.version
            self.waiting.add(w.hello.worker_id)
            return [LoadPolicy(w.hello.worker_id, b.version, b.weights_path)]
        if w.version != self.version:
            w.loading = self.version
            return [LoadPolicy(w.hello.worker_id, self.version, self.weights_path)]
        return []

    def left(self, worker_id: str) -> None:
        """The worker left: the barrier no longer waits for it (``check`` ends it if it was the last)."""
        self.waiting.discard(worker_id)

    # ----------------------------------------------------------------- checks --

    def check_held(self) -> None:
        """Refuse work (naming ``policy_version``) while no connected worker holds or loads the
        cluster's version, after a failed update (not while an update is in progress)."""
        workers = self.core.workers
        if self.barrier is None and workers and not any(self.version in (w.version, w.loading) for w in workers.values()):
            held = ", ".join(sorted({str(w.version) for w in workers.values()}))
            raise InvalidRequest("policy_version", f"no connected worker holds policy version {self.version} (they "
                                 f"hold {held}, after a failed update); run update_policy again", ErrorCode.FAILED_PRECONDITION)

    def check_step(self, version: int) -> None:
        """Refuse a new step of ``version`` (naming ``policy_version``) while an update loads,
        or where it is not the cluster's version, or no worker holds that."""
        if self.barrier is not None:
            raise InvalidRequest("policy_version", f"the update to policy version {self.barrier.version} is still loading; "
                                 "run the step after UpdatePolicy returns", ErrorCode.FAILED_PRECONDITION)
        if version != self.version:
            raise InvalidRequest("policy_version", f"{version} is not the current policy version {self.version}",
                                 ErrorCode.FAILED_PRECONDITION)
        self.check_held()

    # ---------------------------------------------------------------- updates --

    def update(self, version: int | None, weights_path: str, field: str = "version",
               pushed_to: Collection[str] | None = None) -> list[Action]:
        """Start an update (``SchedulerCore.update_policy``): ``version`` (None: the next one)
        from ``weights_path`` on every live worker, or, with ``pushed_to``, on those workers
        alone, which get their weights from the trainer (no ``LoadPolicy``). The same (version,
        path) again joins the update in progress (no action: its outcome answers both) or, once
        it succeeded, answers ``PolicyReady`` again; a pushed update never joins one. Refused,
        naming ``field`` for the version, with nothing changed, otherwise."""
        if not weights_path:
            raise InvalidRequest("weights_path", "is empty")
        target = self.version + 1 if version is None else version
        b = self.barrier
        if b is not None:
            if pushed_to is not None or target != b.version:
                raise InvalidRequest(field, f"the update to policy version {b.version} is still loading",
                                     ErrorCode.FAILED_PRECONDITION)
            if weights_path != b.weights_path:
                raise InvalidRequest("weights_path", f"version {target} is loading from another weights_path",
                                     ErrorCode.ALREADY_EXISTS)
            return []
        if target == self.version and self.weights_path:
            if weights_path != self.weights_path:
                raise InvalidRequest("weights_path", f"version {target} is set with another weights_path",
                                     ErrorCode.ALREADY_EXISTS)
            return [PolicyReady(target, sum(1 for w in self.core.workers.values() if w.version == target))]
        if target <= self.version:
            raise InvalidRequest(field, f"must be greater than the current version {self.version}, got {target}",
                                 ErrorCode.FAILED_PRECONDITION)
        running = self.core.pauser.waiting()  # a step held by a keep-pause moves to the new version (pause.rebase)
        if running:
            raise InvalidRequest(field, f"step {running[0]!r} is still running; pause first (POST /pause?mode=keep or "
                                 "mode=wait) or wait for it to end", ErrorCode.FAILED_PRECONDITION)
        if not self.core.workers:
            raise InvalidRequest("workers", f"no live worker to load version {target}", ErrorCode.UNAVAILABLE)
        return self._open(PolicyBarrier(target, weights_path), pushed_to)

    def _open(self, barrier: PolicyBarrier, pushed_to: Collection[str] | None) -> list[Action]:
        """Open ``barrier`` on its workers: their draft jobs stop and they take no work until
        they answered."""
        core = self.core
        self.barrier = barrier
        members = list(core.workers) if pushed_to is None else list(pushed_to)
        self.waiting = set(members)
        actions: list[Action] = []
        for wid in members:
            w = core.workers[wid]
            actions += core.drafts.stop(w)
            w.loading, w.load_failed = barrier.version, None
            if pushed_to is None:
                actions.append(LoadPolicy(wid, barrier.version, barrier.weights_path))
            core.timing.set_state(w, core.clock())
        return actions

    def label(self, version: int, weights_path: str) -> None:
        """Name the weights of update ``version`` in progress (weight transfer's ``finish``)."""
        if self.barrier is not None and self.barrier.version == version:
            self.barrier.weights_path = weights_path

    def loaded(self, worker_id: str, version: int, ok: bool, error: str = "",
               weights_unknown: bool = False, seconds: float = 0.0) -> list[Action]:
        """A worker answered ``LoadPolicy`` (or weight transfer's ``finish`` for it):
        ``PolicyLoadReported`` first. A failed worker gets no work until the barrier ends;
        ``weights_unknown``: its load failed after its weights changed, so it serves no version
        (-1) until a later load succeeds. An answer nobody asked for changes nothing (``Ignored``)."""
        core = self.core
        w = core.workers.get(worker_id)
        if w is None or w.loading != version:
            return [Ignored(worker_id, "policy_loaded.version", f"{version} was not asked of it")]
        w.loading = None
        b = self.barrier
        if b is not None and b.version == version and worker_id in self.waiting:
            b.answer(worker_id, ok, error)
        self.waiting.discard(worker_id)
        if ok:
            w.version = version
        else:
            w.load_failed = version
            w.version = -1 if weights_unknown else w.version
        core.timing.set_state(w, core.clock())
        return [PolicyLoadReported(worker_id, version, ok, error, seconds), *self.check(), *core.dispatcher.fill(w)]

    def close(self, version: int) -> list[Action]:
        """End update ``version`` now, whoever has not answered (members of a weight transfer
        that left kept it open: ``loaded`` ignores them)."""
        if self.barrier is None or self.barrier.version != version:
            return []
        self.waiting.clear()
        return self.check()

    def check(self) -> list[Action]:
        """Once every live worker answered: ``PolicyReady`` if all of them loaded the version,
        else ``PolicyFailed`` and the cluster keeps its version and weights path. Workers that
        did load the failed version keep it and get no work (the core hands a worker only work
        of the version it holds) until the next update reloads every worker."""
        b = self.barrier
        if b is None or self.waiting:
            return []
        core = self.core
        self.barrier = None
        outcome = b.outcome(core.workers, self.version)
        if isinstance(outcome, PolicyReady):
            self.version, self.weights_path = b.version, b.weights_path
            core.pauser.rebase(b.version)
            core.pool.rebase(b.version)
        for w in core.workers.values():
            if w.load_failed == b.version:
                w.load_failed = None  # the version is gone: old weights that are intact serve again
        return [outcome, *core.dispatcher.fill_all()]

    def restore(self, version: int, weights_path: str) -> None:
        """A restarted scheduler takes the version and weights path its journal kept (before
        any worker joins: each joining worker then loads it)."""
        if self.core.workers or self.core.steps or self.barrier is not None:
            raise InvalidRequest("version", "the policy is restored only before any worker or step",
                                 ErrorCode.FAILED_PRECONDITION)
        self.version, self.weights_path = version, weights_path
