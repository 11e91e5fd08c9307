"""Pause and resume of dispatch, as vLLM's ``POST /pause?mode=...`` and ``/resume`` (pure).

A collaborator of ``SchedulerCore`` (``core.pauser``). While paused, a new step is refused
with UNAVAILABLE (a step already known, resumed by its id, is not new); announced prompts
are still drafted: a pause is a bubble. The modes, for the steps active when it is asked:

- ``abort``: they are cancelled (their callers get CANCELLED), their requests aborted on the
  workers.
- ``wait``: they run to the end; the shell answers once none is left (``waiting``).
- ``keep``: they are held. Their requests running on workers are aborted there and put back
  at the front of their step's queue (not a failed attempt: ``max_attempts`` counts nothing),
  and nothing of theirs is dispatched until ``resume``. A completion a worker sent before
  the abort reached it is ignored (the request is no longer held by that worker), so none is
  delivered twice and none is lost: each undelivered request runs again after ``resume``.

A policy update may run while every active step is held (``waiting`` is empty; prime-rl's
``pause(keep)`` -> ``update_weights`` -> ``resume``). When it succeeds, ``rebase`` moves the
held steps to the new version: their undelivered requests run from scratch under it, never
continuing a generation of the old weights, so no completion mixes two versions. Completions
delivered before the pause keep the version they were made with; each completion carries it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from enum import StrEnum
from typing import TYPE_CHECKING

from bubblespec.scheduler.core.pool import POOL
from bubblespec.scheduler.core.types import Abort, Action, ErrorCode, InvalidRequest, RequestsMoved

if TYPE_CHECKING:
    from bubblespec.scheduler.core.records import CoreParts, StepState

__all__ = ["PAUSE_MODES", "PauseMode", "Pauser"]



class PauseMode(StrEnum):
    """vLLM's ``/pause?mode=``: what happens to the steps active when the pause is asked."""

    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


PAUSE_MODES: tuple[str, ...] = tuple(m.value for m in PauseMode)


class Pauser:
    """Whether dispatch is paused, and which steps a ``keep`` pause holds."""

    def __init__(self, core: CoreParts):
        self.core = core
        self.paused = False
        self.mode: PauseMode | None = None
        """The mode of the latest ``pause`` (None when not paused)."""
        self.held: set[str] = set()
        """Ids of the steps a ``keep`` pause holds: none of their work is dispatched."""

    # ------------------------------------------------------------------ queries --

    def holds(self, step_id: str) -> bool:
        return step_id in self.held

    def check_new_step(self) -> None:
        """Refuse a new step while paused."""
        if self.paused:
            raise InvalidRequest("step_id", f"the scheduler is paused (mode {self.mode}); new steps are refused "
                                 "until POST /resume", ErrorCode.UNAVAILABLE)

    def waiting(self) -> list[str]:
        """Active steps a ``wait`` pause waits for: every active step not held; the pool
        (``core/pool.py``) while requests admitted before the pause are still to run."""
        return [sid for sid, s in self.core.steps.items() if s.active and sid not in self.held
                and (sid != POOL or self.core.pool.waiting())]

    # ------------------------------------------------------------------- events --

    def pause(self, mode: str) -> list[Action]:
        """Pause (idempotent: pausing again applies ``mode`` to the steps active now)."""
        if mode not in PAUSE_MODES:
            raise InvalidRequest("mode", f"must be one of {', '.join(PAUSE_MODES)}, got {mode!r:.40}")
        self.paused, self.mode = True, PauseMode(mode)
        core = self.core
        active = [s for s in core.steps.values() if s.active and s.spec.step_id != POOL]
        if self.mode is PauseMode.ABORT:
            self.held.clear()
            return core.pool.abort() + [a for s in active for a in core.cancel_step(s.spec.step_id)]
        if self.mode is PauseMode.WAIT:
            return []
        actions: list[Action] = []
        for step in active:
            actions += self._hold(step)
        if core.pool.step is not None:
            self.held.add(POOL)
            actions += core.pool.hold()
        return actions + core.dispatcher.fill_all()  # the freed workers draft

    def resume(self) -> list[Action]:
        """Resume dispatch (idempotent): held steps run again, new steps are taken."""
        self.paused, self.mode = False, None
        self.held.clear()
        self.core.pool.unpark()
        return self.core.dispatcher.fill_all()

    def rebase(self, version: int) -> None:
        """``version`` became the cluster's while steps were held: their undelivered requests
        run under it (from scratch); delivered completions keep their own version."""
        for sid in self.held - {POOL}:  # the pool rebases on its own (``RequestPool.rebase``)
            step = self.core.steps.get(sid)
            if step is None or not step.active or step.spec.policy_version == version:
                continue
            step.spec = replace(step.spec, policy_version=version)  # same fingerprint: a retry still resumes it
            for req in step.requests.values():
                if not req.done:
                    req.spec = replace(req.spec, policy_version=version)

    def _hold(self, step: StepState) -> list[Action]:
        """Hold ``step``: abort its running requests on their workers and queue them again,
        ahead of its queued ones, with its workers' private queues (nothing of it left there)."""
        core, sid = self.core, step.spec.step_id
        self.held.add(sid)
        now = core.clock()
        actions: list[Action] = []
        back: list[str] = []  # running requests, then queued ones
        for key, req in step.requests.items():
            if req.done or req.worker is None:
                continue
            w = core.workers.get(req.worker)
            if w is not None and key in w.running:
                w.running.discard(key)
                actions.append(Abort(req.worker, key))
            req.worker = None  # not a failed attempt: nothing is counted
            back.append(key)
        step.requeued += len(back)
        if back:
            actions.append(RequestsMoved(sid, tuple(back), requeued=True))
        for w in core.workers.values():
            mine = [k for k in w.private if k.split("/", 1)[0] == sid]
            if mine:
                w.private = deque(k for k in w.private if k.split("/", 1)[0] != sid)
                back += mine
            core.timing.set_state(w, now)
        step.shared.extendleft(reversed(back))
        return actions
