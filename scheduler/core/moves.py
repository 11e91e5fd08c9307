"""Moving a long request, with what it generated so far, to a worker with nothing to do (pure).

At a step's tail, workers that finished their share idle while the step's longest requests run
on in other workers' batches, where every pass costs its fixed part plus each other sequence.
With ``CoreSettings.move_long_requests`` (on by default), a worker that runs out of work takes
over the running request with the most tokens so far (under long-tailed lengths, the further
along, the further to go) from the worker with the fullest batch that runs one. A worker that
runs at most ``move_to_workers_running_at_most`` requests and no draft job does the same for a
request of a step without drafts, from a batch of at least twice its own and two more (there
the request shares its passes with at most half as many others):

1. as the worker runs out of work (or at a later ``tick``), the core asks the other worker to
   stop the request and send what it generated (``Abort(keep_partial=True)``);
2. the worker answers with the partial completion (``SchedulerCore.on_aborted(..., partial)``);
3. the request goes on from that partial on the idle worker (``Assign.resume``): the prompt and
   the partial are its context, and its completion holds the partial's tokens and what follows.

A response continued from its own prefix is drawn from the same distribution as one generated
in one go, so the result is exact (docs/EXACTNESS.md). A seeded request goes on with
``resume_seed`` (``common/rules.py``): its seed's stream drew the partial's tokens, and drawing the rest from it again
would tie the two. Where a continuation could differ, a request does not move:

- it has stop strings (one could span the partial's end);
- it is seeded, in a step without drafts (``disable_drafts``: bit-reproducible per seed, which
  a move at a time-dependent point would break);
- its step runs without the straggler watch (a pure baseline).

A request moves at most once, and only between workers that say they can
(``WorkerHello.accepts_resume``). If the partial does not come (the worker left or answered
without one), the request runs again from the start, as after any failed attempt. If its
completion comes first, it is delivered as usual and the move is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bubblespec.common.types import Completion
from bubblespec.scheduler.core.pool import checked_partial, continued
from bubblespec.scheduler.core.types import Abort, Action, Ignored, InvalidRequest, RequestsMoved, step_of

if TYPE_CHECKING:
    from bubblespec.scheduler.core.records import CoreParts as SchedulerCore
    from bubblespec.scheduler.core.records import RequestState, StepState, WorkerState

__all__ = ["SOURCES_LOOKED_AT", "Mover"]

SOURCES_LOOKED_AT = 8
"""Fullest batches a worker that just ran out of work looks at for a request to take over."""

class Mover:
    """Which running requests idle workers take over, and the move's three messages (module
    docstring); a collaborator of ``SchedulerCore`` (``core.mover``)."""

    def __init__(self, core: SchedulerCore):
        self.core = core
        self._sources: list[str] = []
        """Workers by how full their batch was at the last ``tick``, fullest first (``take_for``
        looks at the first few: one worker running out of work must not cost a pass over all)."""
        self._undrafted = False
        """Whether a step without drafts was running at the last ``tick``: where none is, a
        worker that still runs requests takes none (``_may_take``), so it looks at no source."""

    def tick(self) -> list[Action]:
        """Pair the idle workers that can take a moved request with the requests to move, and
        ask their workers to stop them and send their partials. Sources first whose batch is
        fullest (each pass there costs a request the most), on each the movable request with the
        most tokens so far (of a step's requests still running, the further along, the further to
        go: long-tailed lengths); a source gives one a tick. Once per tick, not per event: a pass
        over the workers and the running requests of the sources it reaches."""
        core = self.core
        sources = sorted((o for o in core.workers.values() if len(o.running) >= 2 and o.hello.accepts_resume),
                         key=lambda o: (-len(o.running), o.hello.worker_id))  # ties by id: the same choice every run
        self._sources = [o.hello.worker_id for o in sources[:SOURCES_LOOKED_AT]]
        self._undrafted = any(s.active and not s.spec.use_drafts and s.spec.straggler_watch for s in core.steps.values())
        takers = sorted((w for w in core.workers.values() if self._can_take(w)),
                        key=lambda w: len(w.running))  # emptiest first (ties: the order they joined)
        if not takers:
            return []
        actions: list[Action] = []
        for source in sources:
            req = self._best_on(source)
            if req is None:
                continue
            mode = req.spec.sampling.logprobs_mode
            target = next((w for w in takers if _relieves(source, w) and _may_take(w, req)
                           and mode in ("", w.hello.logprobs_mode)), None)
            if target is None:
                continue
            takers.remove(target)
            actions.append(self._start(req, source, target))
            if not takers:
                break
        return actions

    def take_for(self, w: WorkerState) -> list[Action]:
        """``w`` just ran out of work, or nearly (``_can_take``): it takes over the best request
        of the fullest batches seen at the last ``tick`` (the first ``SOURCES_LOOKED_AT``), if
        one has a movable one that ``w`` may take (``_relieves``, ``_may_take``); ``tick`` pairs
        the rest."""
        if not self._can_take(w):
            return []
        for wid in self._sources:
            source = self.core.workers.get(wid)
            if source is None or not _relieves(source, w):
                continue
            req = self._best_on(source)
            if req is not None and _may_take(w, req) and req.spec.sampling.logprobs_mode in ("", w.hello.logprobs_mode):
                return [self._start(req, source, w)]
        return []

    def _can_take(self, w: WorkerState) -> bool:
        """``w`` runs no request, or at most ``move_to_workers_running_at_most`` and no draft
        job (no draft job runs beside a moved request: taking one would stop the drafts it makes
        for the next step); it can continue a request, has weights that serve, and no move to it
        is under way."""
        light = not w.running or (self._undrafted and not w.drafts
                                   and len(w.running) <= self.core.settings.move_to_workers_running_at_most)
        return (light and w.hello.accepts_resume and w.loading is None and w.load_failed is None
                and self._free(w))

    @staticmethod
    def _start(req: RequestState, source: WorkerState, target: WorkerState) -> Abort:
        """Reserve ``target`` for ``req`` and ask ``source`` to stop it and send its partial."""
        req.moving_to, target.incoming = target.hello.worker_id, req.spec.key
        return Abort(source.hello.worker_id, req.spec.key, keep_partial=True)

    def _free(self, w: WorkerState) -> bool:
        """No move to ``w`` is under way (one the core has since taken back no longer counts)."""
        if w.incoming is None:
            return True
        core = self.core
        step = core.steps.get(step_of(w.incoming))
        req = step.requests.get(w.incoming) if step is not None else None
        if step is not None and req is not None and step.active and not req.done and req.moving_to == w.hello.worker_id:
            return False
        w.incoming = None
        return True

    def _best_on(self, source: WorkerState) -> RequestState | None:
        """The movable request on ``source`` with the most tokens so far (at least
        ``min_tokens_to_move``; ties by key), or None."""
        core = self.core
        best, most = None, (core.settings.min_tokens_to_move, "")
        for key in source.running:
            step = core.steps.get(step_of(key))
            req = step.requests.get(key) if step is not None else None
            if step is not None and req is not None and (req.progress, key) >= most and self._movable(step, req):
                best, most = req, (req.progress, key)
        return best

    def arrived(self, step: StepState, req: RequestState, worker_id: str, partial: Completion) -> list[Action]:
        """The partial of moving request ``req`` came from ``worker_id`` (which let go of it):
        hand the request on to its new worker (or to the shared queue, if that worker left or
        cannot take it now). A partial that is not the request's (another request's, tokens
        outside the vocabulary, another policy version, as long as the request may be, logprobs
        that do not match its tokens) is refused naming the field, and the request runs again
        from the start, as after a failed attempt."""
        core = self.core
        key = req.spec.key
        target = self._release(req)
        source = core.workers[worker_id]
        source.running.discard(key)
        try:
            partial = checked_partial(partial, req, getattr(core, "limits", None))
        except InvalidRequest as exc:
            return [Ignored(worker_id, exc.field, str(exc)),
                    *core.take_back(step, req, worker_id, f"its partial was refused: {exc}"), *core.dispatcher.fill_all()]
        req.worker, req.moved_from, req.resume = None, worker_id, continued(req.resume, partial)
        req.progress, req.progress_at = len(partial.token_ids), core.clock()
        step.moved += 1
        actions: list[Action] = [RequestsMoved(step.spec.step_id, (key,), resumed=True)]
        if target is not None and target.version == req.spec.policy_version and target.loading is None \
                and target.load_failed is None:
            target.private.appendleft(key)
            return actions + core.dispatcher.fill(target) + core.dispatcher.fill(source)  # the source: a slot free, or idle now
        step.shared.appendleft(key)
        return actions + core.dispatcher.fill_all()

    def cancel(self, req: RequestState) -> None:
        """The move of ``req`` is off (its completion came first, or its worker failed it): the
        worker it was to go to may take another at the next tick."""
        self._release(req)

    def _release(self, req: RequestState) -> WorkerState | None:
        target = self.core.workers.get(req.moving_to) if req.moving_to is not None else None
        req.moving_to = None
        if target is not None and target.incoming == req.spec.key:
            target.incoming = None
        return target

    @staticmethod
    def _movable(step: StepState, req: RequestState) -> bool:
        sampling = req.spec.sampling
        return (step.active and step.spec.straggler_watch and not sampling.stop
                and (step.spec.use_drafts or sampling.seed is None)
                and not req.done and req.moving_to is None and req.moved_from is None and not req.failures
                and req.spec.adapter is None)  # a LoRA adapter's requests stay: not every worker may hold it


def _relieves(source: WorkerState, target: WorkerState) -> bool:
    """A request of ``source`` would share its passes on ``target`` with at most half as many
    others (``source`` runs at least twice ``target``'s requests and two more; an idle target:
    any batch of two or more), under the same weights."""
    return (target is not source and 2 * len(target.running) + 2 <= len(source.running)
            and target.version == source.version)


def _may_take(target: WorkerState, req: RequestState) -> bool:
    """A worker with nothing to run takes any movable request; one still running some, only a
    request of a step without drafts (``move_to_workers_running_at_most``)."""
    return not target.running or not req.spec.use_drafts
