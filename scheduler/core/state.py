"""The scheduler's decision logic: a pure state machine (no I/O, no asyncio, clock injected).

Worker events in (``handle`` with ``core/events.py``: the one way in for them, for the shell
and the simulator alike), trainer calls in (``submit_step``, ``update_policy``, ...), ``tick``;
actions out (``Assign``, ``Deliver``, ``LoadPolicy``, ``RequestsMoved``, ...). The gRPC shell,
the tests and the cluster simulator all drive this same class; the shell reads it only through
its views (``stats``, ``step``, ``worker``: ``core/view.py``).

This module keeps the workers, the steps and their requests (joins and departures, steps
submitted, completed, failed, cancelled; the straggler watch). Work of a dead worker, and
queued work of a straggler, goes to the step's shared queue. Its collaborators own the rest:
dispatch (``core/dispatch.py``), draft jobs (``core/drafts.py``), the policy version and its
barrier (``core/policy.py``).
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

from bubblespec.common.types import (
    LOGPROBS_MODES,
    Completion,
    SamplingParams,
    SchedulingPolicy,
    StepSummary,
)
from bubblespec.scheduler.core.adapters import AdapterCommands
from bubblespec.scheduler.core.balance import Balancer
from bubblespec.scheduler.core.checks import check_completion
from bubblespec.scheduler.core.dispatch import Dispatcher
from bubblespec.scheduler.core.drafting import DraftPlanner
from bubblespec.scheduler.core.drafts import DraftJobs
from bubblespec.scheduler.core.probes import by_probes, probe_first
from bubblespec.scheduler.core.events import (
    Aborted,
    Completed,
    DraftResult,
    Heartbeat,
    PolicyLoaded,
    Progress,
    WorkerEvent,
    WorkerJoined,
    WorkerLeft,
    WorkerSeen,
)
from bubblespec.scheduler.core.history import LengthHistory
from bubblespec.scheduler.core.liveness import NoWorkers
from bubblespec.scheduler.core.moves import Mover
from bubblespec.scheduler.core.pause import Pauser
from bubblespec.scheduler.core.pool import POOL, RequestPool, sample_sampling
from bubblespec.scheduler.core.policy import PolicyVersions
from bubblespec.scheduler.core.records import RequestState, StepState, WorkerState
from bubblespec.scheduler.core.records import total_provenance as _total
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.silence import silent_workers
from bubblespec.scheduler.core.timing import TimeAccounting
from bubblespec.scheduler.core.types import (
    Abort,
    Action,
    Deliver,
    Disconnect,
    ErrorCode,
    Ignored,
    InvalidRequest,
    ModelLimits,
    RequestsMoved,
    RequestSpec,
    StepFailed,
    StepFinished,
    StepSpec,
    WorkerHello,
    request_key,
    step_of,
)
from bubblespec.scheduler.core.view import CoreView, StepView, step_view

__all__ = ["CoreSettings", "RequestState", "SchedulerCore", "StepState", "WorkerState", "request_key"]


class SchedulerCore(CoreView, AdapterCommands):
    """The scheduling state machine: worker events in (``handle``), trainer calls in
    (``submit_step``, ``update_policy``, ``announce``, ``cancel_step``, ``pause``), periodic
    ``tick``; actions out (``core/types.py``). Owns every acceptance rule: whether a worker's
    event is taken is decided here, never in the shell. The shell reads its state only through
    the read-only view (``stats``, ``step``, ``worker`` and the properties under "views").

    Collaborators, by composition: ``DraftPlanner`` (announced prompts), ``LengthHistory``
    (predicted response lengths), ``TimeAccounting`` (busy / idle / drafting seconds),
    ``Pauser`` (``/pause``), ``Balancer`` (who takes queued work), ``Dispatcher`` (handing it
    over), ``DraftJobs`` (draft jobs and what gates them), ``PolicyVersions`` (the version and
    an update in progress)."""

    def __init__(self, settings: CoreSettings = CoreSettings(), clock: Callable[[], float] = lambda: 0.0,
                 rng: random.Random | None = None):
        """``rng``: where draft jobs' seeds come from (``drafting.draft_seed``); a fresh
        OS-seeded one by default, a seeded one makes the core deterministic."""
        self.settings = settings
        self.clock = clock
        self.rng = rng if rng is not None else random.Random()
        self.workers: dict[str, WorkerState] = {}
        self.steps: dict[str, StepState] = {}
        self.limits: ModelLimits | None = None
        self.planner = DraftPlanner()
        self.history = LengthHistory(settings.max_length_history)  # predicted response lengths (core/history.py)
        self.timing = TimeAccounting(settings.timeline_segments, self.current_step)  # core/timing.py
        self.pauser = Pauser(self)  # /pause and /resume (core/pause.py)
        self.balancer = Balancer(self)  # which worker takes queued work (core/balance.py)
        self.mover = Mover(self)  # long requests moved to idle workers (core/moves.py)
        self.pool = RequestPool(self)  # independent calls' requests (core/pool.py)
        self.versions = PolicyVersions(self)  # the policy version and its barrier (core/policy.py)
        self.drafts = DraftJobs(self)  # draft jobs and what gates them (core/drafts.py)
        self.dispatcher = Dispatcher(self)  # queued requests to workers (core/dispatch.py)
        self.liveness = NoWorkers(self)  # calls fail once no worker is left for too long (core/liveness.py)

    # ------------------------------------------------------------- workers --

    def add_worker(self, hello: WorkerHello) -> list[Action]:
        now = self.clock()
        if hello.worker_id in self.workers:
            raise InvalidRequest("hello.worker_id", f"worker {hello.worker_id!r} is already connected", ErrorCode.ALREADY_EXISTS)
        if hello.capacity < 1:
            raise InvalidRequest("hello.capacity", f"must be >= 1, got {hello.capacity}")
        if hello.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequest("hello.logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)}, "
                                 f"got {hello.logprobs_mode!r:.40}")
        if self.limits is not None and hello.limits != self.limits:
            raise InvalidRequest("hello", f"model limits {hello.limits} differ from the cluster's {self.limits}",
                                 ErrorCode.FAILED_PRECONDITION)
        version = self.versions.admit(hello, fresh=not self.weights_path and not self.workers and not self.steps)
        # every check passed: only now change state
        self.limits = hello.limits
        w = WorkerState(hello, hello.policy_version, now, now, state_since=now)
        self.workers[hello.worker_id] = w
        actions = self.versions.joined(w, version)  # it loads the cluster's version, or the update in progress
        self.timing.set_state(w, now)
        return actions + self.dispatcher.fill(w)

    def remove_worker(self, worker_id: str, reason: str = "the worker left") -> list[Action]:
        """The worker's stream ended or it timed out: re-queue everything it held. Each request
        it was running counts a failed attempt (``CoreSettings.max_attempts``); its queued ones
        never started there and do not."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        self.versions.left(worker_id)
        self.pool.worker_gone(worker_id)
        now = self.clock()
        self.timing.close(w, now)
        if not self.workers:
            self.liveness.emptied(now)
        actions: list[Action] = []
        for key in list(w.running):
            step, req = self._unfinished(key)
            if step is not None and req is not None and step.active:
                if req.moving_to is not None:
                    self.mover.cancel(req)
                actions += self.take_back(step, req, worker_id, reason)
        for key in list(w.private):
            step, req = self._unfinished(key)
            if step is not None and req is not None:
                req.worker = None
                step.shared.appendleft(key)
                step.requeued += 1
                actions.append(RequestsMoved(step.spec.step_id, (key,), requeued=True))
        self.drafts.worker_gone(w)
        return actions + self.versions.check() + self.dispatcher.fill_all()

    def _unfinished(self, key: str) -> tuple[StepState | None, RequestState | None]:
        step = self.steps.get(_step_of(key))
        req = step.requests.get(key) if step else None
        if step is None or req is None or req.done or not step.active:
            return None, None
        return step, req

    def take_back(self, step: StepState, req: RequestState, worker_id: str, reason: str) -> list[Action]:
        """``worker_id`` failed ``req``: count the attempt and re-queue it (preferably for
        another worker), or fail its step once ``max_attempts`` attempts failed."""
        if step.spec.step_id == POOL and (answer := self.pool.lost(step, req, worker_id, reason)) is not None:
            return answer
        req.worker, req.moved_from = None, worker_id
        req.failures.append((worker_id, reason))
        if len(req.failures) >= self.settings.max_attempts:
            return self._fail_step(step, req)
        step.shared.appendleft(req.spec.key)
        step.requeued += 1
        return [RequestsMoved(step.spec.step_id, (req.spec.key,), requeued=True)]

    def heartbeat(self, worker_id: str, tokens_per_second: float) -> None:
        """The worker's throughput (finite, >= 0, else ``InvalidRequest`` and no change)."""
        if not math.isfinite(tokens_per_second) or tokens_per_second < 0:
            raise InvalidRequest("heartbeat.tokens_per_second", f"must be a finite number >= 0, got {tokens_per_second}")
        w = self.workers.get(worker_id)
        if w is not None:
            w.last_seen = self.clock()
            w.tokens_per_second = tokens_per_second
            if w.running and tokens_per_second > 0:
                w.busy_tokens_per_second = tokens_per_second

    def touch(self, worker_id: str) -> None:
        """Any message from a worker proves it is alive."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.last_seen = self.clock()

    # ---------------------------------------------------------------- steps --

    def check_step(self, spec: StepSpec) -> StepView | None:
        """Refuse a step that conflicts with state; on resume, the existing one (with its
        delivered completions)."""
        existing = self.steps.get(spec.step_id)
        if existing is not None and existing.spec.fingerprint == spec.fingerprint and self.liveness.retry(existing):
            existing = None  # it failed for want of workers: it runs again (core/liveness.py)
        if existing is not None:
            if existing.spec.fingerprint != spec.fingerprint:
                raise InvalidRequest("step_id", f"step {spec.step_id!r} exists with different content", ErrorCode.ALREADY_EXISTS)
            return step_view(existing, completions=True)
        self.pauser.check_new_step()
        self.liveness.check("workers")
        self.versions.check_step(spec.policy_version)
        active = sum(1 for s in self.steps.values() if s.active and s.spec.step_id != POOL)
        if active >= self.settings.max_active_steps:
            raise InvalidRequest("step_id", f"the scheduler already runs {active} steps, its limit (max_active_steps); "
                                 "wait for one to finish or cancel it", ErrorCode.RESOURCE_EXHAUSTED)
        self.planner.check_room(spec.lookahead, self.settings.max_announced_prompts, "lookahead",
                                leaving=[p.token_ids for p in spec.prompts])
        self._check_logprobs_mode(spec)
        return None

    def _check_logprobs_mode(self, spec: StepSpec) -> None:
        """Refuse a step or call asking for a logprobs mode no connected worker returns (the
        workers are looked at only for a call that asks for one)."""
        mode = spec.sampling.logprobs_mode
        modes = {w.hello.logprobs_mode for w in self.workers.values()} if mode else set()
        if modes and mode not in modes:
            raise InvalidRequest("sampling.logprobs_mode", f"no connected worker returns {mode!r} logprobs (they "
                                 f"return {', '.join(sorted(modes))}; EngineSettings.logprobs_mode)",
                                 ErrorCode.FAILED_PRECONDITION)

    def submit_step(self, spec: StepSpec, done: Mapping[str, Completion] | None = None) -> list[Action]:
        """Queue a step's requests. ``done``: completions an earlier scheduler already delivered
        (restart from the journal); those requests are not run again."""
        if self.check_step(spec) is not None:
            return []  # resume: nothing new to schedule
        now = self.clock()
        self.timing.flush(self.workers.values(), now)
        self.drafts.step_arrives(spec, now, idle=not any(s.active for s in self.steps.values()))
        reqs = {r.key: RequestState(r) for r in _expand(spec)}
        step = StepState(spec, reqs, deque(), now)
        for key, completion in (done or {}).items():
            if key in reqs:
                reqs[key].done = True
                step.completions[key] = completion
        order = [k for k in reqs if not reqs[k].done]
        if spec.policy is SchedulingPolicy.LONGEST_FIRST:
            order.sort(key=lambda k: -self.history.predicted(reqs[k].spec.prompt_token_ids))
        self.steps[spec.step_id] = step
        live = [w for w in self.workers.values() if w.load_failed is None
                and spec.policy_version in (w.version, w.loading)]
        if spec.policy is SchedulingPolicy.STATIC and live:
            for i, keys in enumerate(_split(order, len(live))):
                live[i].private.extend(keys)
        else:
            room = sum(max(0, w.capacity - len(w.running)) for w in live)
            step.shared.extend(probe_first(order, reqs) if len(order) > room and spec.sampling.n > 1 else order)
        for p in spec.prompts:
            self.planner.forget(p.token_ids)
        stopped = self.drafts.stop_arrived(spec)
        for ids in spec.lookahead:
            self.planner.announce(ids, spec.sampling, "", self.history.predicted(ids))
        self._trim_steps()
        if len(step.completions) == len(reqs):
            return stopped + self._finish(step)
        return stopped + self.dispatcher.fill_all()

    def announce(self, prompts: list[tuple[int, ...]], sampling: SamplingParams) -> int:
        self.planner.check_room(prompts, self.settings.max_announced_prompts, "prompts")
        for ids in prompts:
            self.planner.announce(ids, sampling, "", self.history.predicted(ids))
        return len(prompts)

    # ---------------------------------------------------------------- calls --

    def check_requests(self, spec: StepSpec) -> None:
        """Refuse (naming the field, nothing changed) a call whose requests cannot join the pool."""
        self._check_workers_serve(spec)
        self.pool.check(spec)

    def _check_workers_serve(self, spec: StepSpec) -> None:
        """The workers can serve the call: ``check_requests`` less the pool's own check (``RequestPool.submit``
        makes that one)."""
        self.liveness.check("workers")
        self.versions.check_held()
        self._check_logprobs_mode(spec)

    def submit_requests(self, spec: StepSpec, single_version: bool = False, dispatch: bool = True,
                        session_id: str = "") -> tuple[list[str], list[Action]]:
        """An independent call's requests join the pool (``core/pool.py``): their keys, prompt
        by prompt and sample by sample, and the actions that dispatch them. ``spec``'s step id
        and policy version are not used: the requests run under the cluster's version of the
        moment they start (``single_version``: never two versions in one completion). With
        ``dispatch`` off they only join the queue, and no actions come: ``dispatch()`` hands
        them out later, once for many calls (a dispatch looks at every worker and every
        running request; a call's own work is only its requests)."""
        self._check_workers_serve(spec)
        keys = self.pool.submit(spec, single_version, session_id)  # checked first (``RequestPool.check``)
        if spec.use_drafts:
            self.drafts.wanted = True
        return keys, self.dispatcher.fill_all() if dispatch else []

    def dispatch(self) -> list[Action]:
        """Hand out the queued work (after ``submit_requests(..., dispatch=False)``)."""
        return self.dispatcher.fill_all()

    def cancel_requests(self, keys: list[str]) -> list[Action]:
        """The callers of these pool requests went away: abort what runs, unqueue the rest."""
        return self.pool.cancel(keys) + self.dispatcher.fill_all()

    def open_step(self, spec: StepSpec) -> StepState:
        """A step with no requests yet, that requests join (the pool)."""
        step = self.steps[spec.step_id] = StepState(spec, {}, deque(), self.clock())
        return step

    def close_step(self, step_id: str) -> None:
        """Forget an open step that has no requests left (no summary: it is no trainer's step)."""
        self.steps.pop(step_id, None)
        self.balancer.stalls.forget(set(self.steps))

    @staticmethod
    def new_request(spec: RequestSpec) -> RequestState:
        return RequestState(spec)

    def forget_history(self) -> None:
        """Drop length history and announced prompts (benchmarks compare arms from scratch)."""
        self.history.clear()
        self.planner = DraftPlanner()
        self.drafts.forget()

    def cancel_step(self, step_id: str) -> list[Action]:
        step = self.steps.get(step_id)
        if step is None:
            raise InvalidRequest("step_id", f"no step {step_id!r}", ErrorCode.NOT_FOUND)
        if not step.active:
            return []
        step.cancelled = True
        return self._drop_work(step) + self._finish(step) + self.dispatcher.fill_all()

    def _drop_work(self, step: StepState) -> list[Action]:
        """Abort the step's running requests on their workers and unqueue the rest."""
        actions: list[Action] = []
        for key, req in step.requests.items():
            if req.worker and not req.done and key in self.workers.get(req.worker, _NOBODY).running:
                self.workers[req.worker].running.discard(key)
                actions.append(Abort(req.worker, key))
        for w in self.workers.values():
            w.private = deque(k for k in w.private if _step_of(k) != step.spec.step_id)
        step.shared.clear()
        return actions

    def _fail_step(self, step: StepState, req: RequestState) -> list[Action]:
        """``req`` failed ``max_attempts`` times: end its step with ``StepFailed`` (no summary,
        no longer active; a resume gets the same failure) and abort the rest of its work. In the
        pool only the request fails: its caller gets the error (``RequestFailed``)."""
        if step.spec.step_id == POOL:
            return self.pool.failed(step, req)
        spec = req.spec
        index = next(i for i, p in enumerate(step.spec.prompts) if p.prompt_id == spec.prompt_id)
        workers = ", ".join(w for w, _ in req.failures)
        step.failure = StepFailed(
            step.spec.step_id, f"prompts[{index}]",
            f"prompt {spec.prompt_id!r} sample {spec.sample_index} failed {len(req.failures)} attempts "
            f"(workers: {workers:.200}); the step is abandoned. Last error: {req.failures[-1][1]:.200}")
        actions = self._drop_work(step)
        now = self.clock()
        self.timing.flush(self.workers.values(), now)
        step.finished_at = now
        return [*actions, step.failure]

    # ------------------------------------------------------------- progress --

    def handle(self, event: WorkerEvent) -> list[Action]:
        """The one entry point for worker events (``core/events.py``). Any event but a join or
        a leave proves the worker alive. Raises ``InvalidRequest`` (naming the field, nothing
        changed) for an event that breaks the protocol; a stale one comes back ``Ignored``."""
        match event:
            case WorkerJoined(hello):
                return self.add_worker(hello)
            case WorkerLeft(worker_id, reason):
                return self.remove_worker(worker_id, reason)
            case Heartbeat(worker_id, tps):
                self.heartbeat(worker_id, tps)
                return []
        self.touch(event.worker_id)
        match event:
            case Progress(worker_id, key, tokens):
                return self.on_progress(worker_id, key, tokens)
            case Completed(worker_id, key, completion):
                return self.on_completion(worker_id, key, completion)
            case Aborted(worker_id, key, reason, partial):
                return self.on_aborted(worker_id, key, reason, partial)
            case DraftResult(worker_id, job_id, tokens, finished):
                return self.on_draft_result(worker_id, job_id, tokens, finished)
            case PolicyLoaded(worker_id, version, ok, error, weights_unknown, seconds):
                return self.on_policy_loaded(worker_id, version, ok, error, weights_unknown, seconds)
            case WorkerSeen():
                return []
        raise InvalidRequest("kind", f"unexpected worker event {type(event).__name__}")

    def on_progress(self, worker_id: str, key: str, tokens: int) -> list[Action]:
        """Request ``key`` generated ``tokens`` tokens so far (the stall watch's clock)."""
        req = self._owned(worker_id, key)
        if req is None:
            return [_not_running(worker_id, "progress", key)]
        if tokens > req.progress:
            req.progress, req.progress_at = tokens, self.clock()
        return []

    def on_completion(self, worker_id: str, key: str, completion: Completion) -> list[Action]:
        """Accept a completion once, from the worker that holds the request (stamped with that
        worker's id, whatever it claims); a stale one comes back ``Ignored``. One that names
        another request or leaves the vocabulary raises ``InvalidRequest`` (nothing changes:
        the request runs on, and times out if the worker never sends a good one); one made
        with another policy version than asked is a failed attempt (``on_aborted``)."""
        req = self._owned(worker_id, key)
        if req is None:
            return [_not_running(worker_id, "completion", key)]
        if completion.worker_id != worker_id:  # the wire stamps it already: copy only when it differs
            completion = replace(completion, worker_id=worker_id)
        completion = check_completion(completion, key, self.limits, request=req.spec)
        wanted = req.spec.policy_version
        if completion.policy_version != wanted:  # made with other weights than asked
            wrong = f"completion from policy version {completion.policy_version}, not {wanted}"
            return [Ignored(worker_id, "completion.policy_version", f"{key!r:.80} is from policy version "
                            f"{completion.policy_version}, the request asked for {wanted}; running it again"),
                    *self.on_aborted(worker_id, key, wrong)]
        step = self.steps[req.spec.step_id]
        w = self.workers[worker_id]
        w.last_seen = self.clock()
        w.running.discard(key)
        w.moved_in.discard(key)
        self.history.record(req.spec.prompt_token_ids, len(completion.token_ids))
        if completion.provenance.sources:
            self.drafts.note_saving(completion.provenance, len(completion.token_ids))
        actions: list[Action]
        if step.spec.step_id == POOL:  # delivered and gone: the pool keeps no completion
            completion, actions = self.pool.delivered(step, req, completion)
        else:
            req.done = True
            step.completions[key] = completion
            actions = [Deliver(step.spec.step_id, completion)]
            if len(step.completions) == len(step.requests):
                actions += self._finish(step)
        actions += self.dispatcher.fill(w)
        if req.moving_to is not None:  # it finished before its worker stopped it: the move is off
            self.mover.cancel(req)
        if self.settings.move_long_requests:  # out of work, or nearly (``Mover._can_take``): take over a long request
            actions += self.mover.take_for(w)
        return actions

    def on_aborted(self, worker_id: str, key: str, reason: str = "", partial: Completion | None = None) -> list[Action]:
        """The worker could not run the request (a failed attempt): give it to someone else,
        or fail the step after ``max_attempts``. With ``partial``, the worker stopped a request
        the core is moving (``core/moves.py``): it goes on from there on its new worker."""
        req = self._owned(worker_id, key)
        if req is None:
            return [_not_running(worker_id, "aborted", key)]
        step = self.steps[req.spec.step_id]
        if step.spec.step_id == POOL and (stopped := self.pool.stopped(step, req, worker_id, partial)) is not None:
            return stopped  # a pause stopped it (core/pool.py)
        if req.moving_to is not None and partial is not None:
            return self.mover.arrived(step, req, worker_id, partial)
        moving = req.moving_to is not None
        self.workers[worker_id].running.discard(key)
        self.workers[worker_id].moved_in.discard(key)
        actions = self.take_back(step, req, worker_id, f"aborted by the worker: {reason or 'no reason given'}")
        if moving:  # it was to move, and failed first: it runs again from the start
            self.mover.cancel(req)
        return actions + self.dispatcher.fill_all()

    def on_draft_result(self, worker_id: str, job_id: str, tokens: int, finished: bool = True) -> list[Action]:
        """A draft job ended: ``finished`` when its response ran to the end, else it was
        stopped (or failed) after ``tokens`` tokens; its partial draft is kept all the same."""
        w = self.workers.get(worker_id)
        return [] if w is None else self.drafts.result(w, job_id, tokens, finished)

    # --------------------------------------------------------------- policy --

    def update_policy(self, version: int | None, weights_path: str, field: str = "version",
                      pushed_to: Collection[str] | None = None) -> list[Action]:
        """The one command that changes the policy version (``core/policy.py``): every live
        worker loads ``weights_path`` as ``version`` (None: the next version), which becomes the
        cluster's only once all of them did (``PolicyReady``); else the cluster stays where it
        was (``PolicyFailed``). ``field``: the caller's name for the version, which a refusal
        names; ``pushed_to``: weight transfer's group, whose weights the trainer pushes
        (``core/transfer.py``). A retry joins the update in progress or gets its answer again."""
        return self.versions.update(version, weights_path, field, pushed_to)

    def on_policy_loaded(self, worker_id: str, version: int, ok: bool, error: str = "",
                         weights_unknown: bool = False, seconds: float = 0.0) -> list[Action]:
        """A worker answered ``LoadPolicy`` (``PolicyVersions.loaded``)."""
        return self.versions.loaded(worker_id, version, ok, error, weights_unknown, seconds)

    @property
    def version(self) -> int:
        """The cluster's policy version (``core.versions`` owns it)."""
        return self.versions.version

    @property
    def weights_path(self) -> str:
        """Where the cluster's version's weights are (``core.versions`` owns it)."""
        return self.versions.weights_path

    # ----------------------------------------------------------------- tick --

    def tick(self, stalled: float = 0.0) -> list[Action]:
        """Periodic checks: dead workers, stragglers, stalled requests. ``stalled``: seconds
        since the last tick in which the scheduler could not listen (``core/silence.py``)."""
        now = self.clock()
        actions: list[Action] = []
        if self.drafts.expire(now):  # a draft result that never came: run the requests without the draft
            actions += self.dispatcher.fill_all()
        for w, seconds in silent_workers(self.workers.values(), now, stalled, self.settings.worker_timeout_seconds):
            silent = f"silent for {seconds:.1f}s"
            actions.append(Disconnect(w.hello.worker_id, silent))
            actions += self.remove_worker(w.hello.worker_id, f"worker {silent} while running it")
        actions += self.liveness.tick(now)
        for step in [s for s in self.steps.values() if s.active and s.spec.straggler_watch]:
            actions += self._rebalance(step, now)
        if self.settings.move_long_requests:  # idle workers take over long requests (core/moves.py)
            actions += self.mover.tick()
        for step in self.steps.values():  # multi-wave queues: what the probes say (core/probes.py)
            if step.active and len(step.shared) > 1 and step.spec.sampling.n > 1 \
                    and step.spec.policy is not SchedulingPolicy.STATIC:
                running = (step.requests[k] for w in self.workers.values() for k in w.running if k in step.requests)
                by_probes(step, self.history.predicted, running, now)
        return actions

    def _rebalance(self, step: StepState, now: float) -> list[Action]:
        """Move queued work off a worker that is slow (throughput under ``straggler_ratio`` of
        the median) or that still holds queued work while a worker of the step's version idles;
        move running requests that made no progress for ``stall_seconds``."""
        moved: list[str] = []
        actions: list[Action] = []
        bar: tuple[float, bool] | None = None  # (median rate, someone idle), once a worker holds queued work
        for w in self.workers.values():
            if not w.private:
                continue  # nothing queued to move (most workers: this runs every tick over all of them)
            if bar is None:  # before any queue below changes: the values a scan up front would give
                rates = [o.busy_tokens_per_second for o in self.workers.values() if o.busy_tokens_per_second > 0]
                bar = (statistics.median(rates) if rates else 0.0,
                       any(not o.running and not o.private and o.loading is None and o.load_failed is None
                           and o.version == step.spec.policy_version for o in self.workers.values()))
            median, someone_idle = bar
            slow = (median > 0 and w.running and now - step.started_at > self.settings.straggler_grace_seconds
                    and w.tokens_per_second < self.settings.straggler_ratio * median)
            if slow or someone_idle:
                mine = [k for k in w.private if _step_of(k) == step.spec.step_id]
                w.private = deque(k for k in w.private if _step_of(k) != step.spec.step_id)
                for key in mine:
                    step.requests[key].moved_from = w.hello.worker_id
                moved += mine
        stall = self.settings.stall_seconds
        self.balancer.stalls.forget({s.spec.step_id for s in self.steps.values() if s.active})
        for wid, key in self.balancer.stalls.due(step.spec.step_id, step.requests, self.workers, now, stall):
            req, w = step.requests[key], self.workers[wid]  # only those due: not every running request each tick
            w.running.discard(key)
            actions.append(Abort(wid, key))
            req.worker, req.moved_from = None, wid
            req.failures.append((wid, f"no progress for {stall:g}s"))
            if len(req.failures) >= self.settings.max_attempts:  # a stall is a failed attempt
                return actions + self._fail_step(step, req) + self.dispatcher.fill_all()
            moved.append(key)
        step.shared.extendleft(reversed(moved))
        step.moved += len(moved)
        if moved:
            actions += [RequestsMoved(step.spec.step_id, tuple(moved)), *self.dispatcher.fill_all()]
        return actions

    # --------------------------------------------------------------- finish --

    def _finish(self, step: StepState) -> list[Action]:
        now = self.clock()
        self.timing.flush(self.workers.values(), now)
        step.finished_at = now
        self.planner.repredict(self.history.predicted)
        comps = step.completions.values()
        prov = _total(c.provenance for c in comps)
        step.summary = StepSummary(
            step_id=step.spec.step_id, policy_version=step.spec.policy_version,
            completions=len(step.completions), makespan_seconds=now - step.started_at,
            generated_tokens=sum(len(c.token_ids) for c in comps), provenance=prov,
            busy_worker_seconds=step.busy, idle_worker_seconds=step.idle,
            drafting_worker_seconds=step.drafting, requests_moved=step.moved,
            requests_requeued=step.requeued,
        )
        # Draft jobs go on through the trainer's gap between steps (reward, training): the
        # workers idle there anyway. ``update_policy`` or the next step's work stops them.
        return [StepFinished(step.spec.step_id, step.summary), *self.drafts.step_finished(now, now - step.started_at)]

    def _trim_steps(self) -> None:
        done = [sid for sid, s in self.steps.items() if not s.active]
        for sid in done[: max(0, len(done) - self.settings.keep_steps)]:
            del self.steps[sid]

    # ------------------------------------------------------- time accounting --

    def current_step(self) -> StepState | None:
        """The first active step; the pool (``core/pool.py``) only when no step runs."""
        pool = None
        for step in self.steps.values():
            if step.active:
                if step.spec.step_id != POOL:
                    return step
                pool = step
        return pool

    def _owned(self, worker_id: str, key: str) -> RequestState | None:
        step = self.steps.get(_step_of(key))
        req = step.requests.get(key) if step else None
        if req is None or req.done or req.worker != worker_id or not step.active:  # type: ignore[union-attr]
            return None
        return req


_NOBODY = WorkerState(WorkerHello("", 1, 0, ModelLimits(1, 1)), 0, 0.0, 0.0)


def _not_running(worker_id: str, kind: str, key: str) -> Ignored:
    """A worker event about a request it does not run (stale: moved, cancelled; or forged)."""
    return Ignored(worker_id, f"{kind}.request_key", f"{key!r:.80} is not running on this worker")


_step_of = step_of


def _expand(spec: StepSpec) -> list[RequestSpec]:
    """A step's requests, prompt by prompt, sample by sample (8,192 in the load test's steps)."""
    out: list[RequestSpec] = []
    step_id, version, use_drafts, base = spec.step_id, spec.policy_version, spec.use_drafts, spec.sampling
    n = base.n
    samplings: dict[int, list[SamplingParams]] = {}  # max_tokens -> sample i's: one object per pair, not per request
    for p in spec.prompts:
        per_sample = samplings.get(p.max_tokens)
        if per_sample is None:
            per_sample = samplings[p.max_tokens] = [sample_sampling(base, i, p.max_tokens) for i in range(n)]
        prompt_id, ids = p.prompt_id, p.token_ids
        for i, sampling in enumerate(per_sample):
            out.append(RequestSpec(request_key(step_id, prompt_id, i), step_id, prompt_id, i, ids, sampling, version,
                                   use_drafts, n))
    return out


def _split(keys: list[str], parts: int) -> list[list[str]]:
    """Contiguous, even chunks (samples of one prompt stay together where sizes allow)."""
    n = len(keys)
    return [keys[i * n // parts:(i + 1) * n // parts] for i in range(parts)]
