"""Moving a long request, with what it generated so far, to a worker with nothing to do (pure).

At a step's tail, workers that finished their share idle while the step's longest requests run
on in other workers' batches, where every pass costs its fixed part plus each other sequence.
With ``CoreSettings.move_long_requests`` (on by default), a worker that runs out of work takes over the running
request with the most tokens so far (under long-tailed lengths, the further along, the further
to go) from a worker that runs it beside others:

1. the core asks that worker to stop it and send what it generated (``Abort(keep_partial=True)``);
2. the worker answers with the partial completion (``SchedulerCore.on_aborted(..., partial)``);
3. the request goes on from that partial on the idle worker (``Assign.resume``): the prompt and
   the partial are its context, and its completion holds the partial's tokens and what follows.

A response continued from its own prefix is drawn from the same distribution as one generated
in one go, so the result is exact (docs/EXACTNESS.md). A seeded request goes on with
``resume_seed``: its seed's stream drew the partial's tokens, and drawing the rest from it again
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

from bubblespec.client.types import Completion
from bubblespec.scheduler.core.checks import check_completion
from bubblespec.scheduler.core.types import Abort, Action, Ignored, InvalidRequest, ModelLimits, RequestsMoved, step_of

if TYPE_CHECKING:
    from bubblespec.scheduler.core.records import CoreParts as SchedulerCore
    from bubblespec.scheduler.core.records import RequestState, StepState, WorkerState

__all__ = ["RESUME_SEEDS", "Mover", "resume_seed"]

RESUME_SEEDS = (5 * 2**60, 3 * 2**61)
"""Seeds of seeded requests' continuations: [5·2**60, 3·2**61), above every request's seed
(below 2**62 + n) and below every draft job's (``drafting.DRAFT_SEEDS``)."""


def resume_seed(seed: int, tokens: int) -> int:
    """The seed a seeded request goes on with after ``tokens`` tokens elsewhere: fresh draws,
    the same for the same (seed, tokens), and never a request's or a draft job's seed."""
    mixed = (seed * 0x9E3779B97F4A7C15 + tokens * 0xC2B2AE3D27D4EB4F) % (1 << 64)
    return RESUME_SEEDS[0] + mixed % (RESUME_SEEDS[1] - RESUME_SEEDS[0])


class Mover:
    """Which running request an idle worker takes over, and the move's three messages (module
    docstring); a collaborator of ``SchedulerCore`` (``core.mover``)."""

    def __init__(self, core: SchedulerCore):
        self.core = core

    def take_for(self, w: WorkerState) -> list[Action]:
        """If ``w`` (idle, nothing queued for it) can take a moved request: ask the worker that
        runs the most requests beside a movable one to stop the one of them with the most
        tokens so far and send its partial. The fuller the batch it leaves, the more each pass
        there cost it; and of a step's requests still running, the further along, the further
        to go (long-tailed lengths)."""
        core = self.core
        if w.incoming is not None:  # a move to it is under way, unless the core took that request back since
            step = core.steps.get(step_of(w.incoming))
            req = step.requests.get(w.incoming) if step is not None else None
            if req is not None and not req.done and req.moving_to == w.hello.worker_id and step.active:  # type: ignore[union-attr]
                return []
            w.incoming = None
        if w.running or not w.hello.accepts_resume:
            return []
        least = core.settings.min_tokens_to_move
        sources = sorted((o for o in core.workers.values() if len(o.running) >= 2 and o is not w
                          and o.hello.accepts_resume and o.version == w.version),
                         key=lambda o: (-len(o.running), o.hello.worker_id))  # ties by id: the same choice every run
        for source in sources:
            best, most = None, (least, "")
            for key in source.running:
                step = core.steps.get(step_of(key))
                req = step.requests.get(key) if step is not None else None
                if step is not None and req is not None and (req.progress, key) >= most and self._movable(step, req, w):
                    best, most = req, (req.progress, key)
            if best is not None:
                best.moving_to, w.incoming = w.hello.worker_id, best.spec.key
                return [Abort(source.hello.worker_id, best.spec.key, keep_partial=True)]
        return []

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
            partial = _checked(partial, req, getattr(core, "limits", None))
        except InvalidRequest as exc:
            return [Ignored(worker_id, exc.field, str(exc)),
                    *core._take_back(step, req, worker_id, f"its partial was refused: {exc}"), *core._fill_all()]
        req.worker, req.moved_from, req.resume = None, worker_id, partial
        req.progress, req.progress_at = len(partial.token_ids), core.clock()
        step.moved += 1
        actions: list[Action] = [RequestsMoved(step.spec.step_id, (key,))]
        if target is not None and target.version == req.spec.policy_version and target.loading is None \
                and target.load_failed is None:
            target.private.appendleft(key)
            return actions + core._fill(target) + core._fill(source)  # the source: a slot free, or idle now
        step.shared.appendleft(key)
        return actions + core._fill_all()

    def cancel(self, req: RequestState) -> list[Action]:
        """The move of ``req`` is off (its completion came first, or its worker failed it): the
        worker it was to go to may take another."""
        target = self._release(req)
        return self.take_for(target) if target is not None else []

    def _release(self, req: RequestState) -> WorkerState | None:
        target = self.core.workers.get(req.moving_to) if req.moving_to is not None else None
        req.moving_to = None
        if target is not None and target.incoming == req.spec.key:
            target.incoming = None
        return target

    @staticmethod
    def _movable(step: StepState, req: RequestState, target: WorkerState) -> bool:
        sampling = req.spec.sampling
        return (step.active and step.spec.straggler_watch and not sampling.stop
                and (step.spec.use_drafts or sampling.seed is None)
                and not req.done and req.moving_to is None and req.moved_from is None and not req.failures
                and req.spec.policy_version == target.version and sampling.logprobs_mode in ("", target.hello.logprobs_mode))


def _checked(partial: Completion, req: RequestState, limits: ModelLimits | None) -> Completion:
    """``partial`` if it can continue ``req`` (``Mover.arrived``), else ``InvalidRequest``."""
    partial = check_completion(partial, req.spec.key, limits, "aborted.partial")
    if partial.policy_version != req.spec.policy_version:
        raise InvalidRequest("aborted.partial.policy_version",
                             f"{partial.policy_version}, the request asked for {req.spec.policy_version}")
    if len(partial.token_ids) >= req.spec.sampling.max_tokens:
        raise InvalidRequest("aborted.partial.token_ids", f"{len(partial.token_ids)} tokens; a request of max_tokens "
                             f"{req.spec.sampling.max_tokens} that long has finished")
    if partial.logprobs and len(partial.logprobs) != len(partial.token_ids):
        raise InvalidRequest("aborted.partial.logprobs",
                             f"{len(partial.logprobs)} logprobs for {len(partial.token_ids)} tokens")
    return partial
