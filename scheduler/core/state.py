"""The scheduler's decision logic: a pure state machine (no I/O, no asyncio, clock injected).

Worker events in (``handle`` with ``core/events.py``; or the ``on_*`` methods it calls),
trainer calls in (``submit_step``, ``update_policy``, ...), ``tick``; actions out (``Assign``,
``Deliver``, ``LoadPolicy``, ``RequestsMoved``, ...). The gRPC shell, the tests and the
cluster simulator all drive this same class; the shell reads it only through its views
(``stats``, ``step``, ``worker``: ``core/view.py``).

Dispatch: every worker has a private queue (filled up front by the ``static`` policy) and
every step a shared queue (``queue`` and ``longest-first``). A worker takes from its private
queue first, then from the shared queues of steps in arrival order, up to its capacity, and
only work of the policy version it has loaded. Work of a dead worker, and queued work of a
straggler, goes to the step's shared queue. A worker with nothing left to take drafts.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

from bubblespec.client.types import (
    LOGPROBS_MODES,
    Completion,
    Provenance,
    SamplingParams,
    SchedulingPolicy,
    StepSummary,
)
from bubblespec.scheduler.core.adapters import AdapterCommands
from bubblespec.scheduler.core.balance import Balancer
from bubblespec.scheduler.core.checks import check_completion
from bubblespec.scheduler.core.drafting import DraftPlanner, draft_seed, job_sampling
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
from bubblespec.scheduler.core.timing import TimeAccounting
from bubblespec.scheduler.core.types import (
    Abort,
    Action,
    Assign,
    Deliver,
    Disconnect,
    DraftJobSpec,
    ErrorCode,
    Ignored,
    InvalidRequest,
    ModelLimits,
    RequestsMoved,
    RequestSpec,
    StartDraft,
    StepFailed,
    StepFinished,
    StepSpec,
    StopDraft,
    WorkerHello,
    request_key,
    step_of,
)
from bubblespec.scheduler.core.view import CoreView, StepView, step_view

__all__ = ["CoreSettings", "RequestState", "SchedulerCore", "StepState", "WorkerState", "request_key"]


HOLD_SECONDS = 1.0
"""Longest dispatch waits for the results of a new step's stopped draft jobs (``_stop_arrived``)."""
BESIDE_MIN_SAVING = 0.2
"""Share of a completion's tokens from accepted future drafts (a running mean over completions
offered any) below which no draft job runs beside requests."""


class SchedulerCore(CoreView, AdapterCommands):
    """The scheduling state machine: worker events in (``handle``), trainer calls in
    (``submit_step``, ``update_policy``, ``announce``, ``cancel_step``, ``pause``), periodic
    ``tick``; actions out (``core/types.py``). Owns every acceptance rule: whether a worker's
    event is taken is decided here, never in the shell. The shell reads its state only through
    the read-only view (``stats``, ``step``, ``worker`` and the properties under "views").

    Collaborators, by composition: ``DraftPlanner`` (announced prompts), ``LengthHistory``
    (predicted response lengths), ``TimeAccounting`` (busy / idle / drafting seconds),
    ``Pauser`` (``/pause``), ``Balancer`` (who takes queued work), ``PolicyVersions`` (the
    version and an update in progress)."""

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
        self.timing = TimeAccounting(settings.timeline_segments, self._current_step)  # core/timing.py
        self._jobs = itertools.count()
        self._drafts_wanted = False  # the latest step asked for drafts of its lookahead
        self._held: dict[tuple[int, ...], list[float]] = {}  # prompt -> [stopped jobs whose result is pending, since]
        self._future_saving = -1.0  # running share of tokens from accepted future drafts (-1: none seen yet)
        self._last_finish: tuple[float, float] | None = None  # (when, makespan) of the step that finished last
        self._long_gap = False  # the trainer's last gap lasted at least as long as the step before it
        self._tail: str | None = None  # the worker whose running out of the step's work began its tail (``_tail_begins``)
        self.pauser = Pauser(self)  # /pause and /resume (core/pause.py)
        self.balancer = Balancer(self)  # which worker takes queued work (core/balance.py)
        self.mover = Mover(self)  # long requests moved to idle workers (core/moves.py)
        self.pool = RequestPool(self)  # independent calls' requests (core/pool.py)
        self.versions = PolicyVersions(self)  # the policy version and its barrier (core/policy.py)
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
        return actions + self._fill(w)

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
                actions += self._take_back(step, req, worker_id, reason)
        for key in list(w.private):
            step, req = self._unfinished(key)
            if step is not None and req is not None:
                req.worker = None
                step.shared.appendleft(key)
                step.requeued += 1
                actions.append(RequestsMoved(step.spec.step_id, (key,), requeued=True))
        for prompt in (*w.drafts.values(), *w.stopping.values()):
            self.planner.done(prompt, complete=False)
            self._release(prompt)
        return actions + self.versions.check() + self._fill_all()

    def _unfinished(self, key: str) -> tuple[StepState | None, RequestState | None]:
        step = self.steps.get(_step_of(key))
        req = step.requests.get(key) if step else None
        if step is None or req is None or req.done or not step.active:
            return None, None
        return step, req

    def _take_back(self, step: StepState, req: RequestState, worker_id: str, reason: str) -> list[Action]:
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
        modes = {w.hello.logprobs_mode for w in self.workers.values()}
        if modes and spec.sampling.logprobs_mode and spec.sampling.logprobs_mode not in modes:
            raise InvalidRequest("sampling.logprobs_mode", f"no connected worker returns {spec.sampling.logprobs_mode!r} "
                                 f"logprobs (they return {', '.join(sorted(modes))}; EngineSettings.logprobs_mode)",
                                 ErrorCode.FAILED_PRECONDITION)
        return None

    def submit_step(self, spec: StepSpec, done: Mapping[str, Completion] | None = None) -> list[Action]:
        """Queue a step's requests. ``done``: completions an earlier scheduler already delivered
        (restart from the journal); those requests are not run again."""
        if self.check_step(spec) is not None:
            return []  # resume: nothing new to schedule
        now = self.clock()
        self.timing.flush(self.workers.values(), now)
        if self._last_finish is not None and not any(s.active for s in self.steps.values()):
            finished_at, makespan = self._last_finish
            self._long_gap = makespan > 0 and now - finished_at >= makespan
        reqs = {r.key: RequestState(r) for r in _expand(spec)}
        step = StepState(spec, reqs, deque(), now)
        self._tail = None
        for key, completion in (done or {}).items():
            if key in reqs:
                reqs[key].done = True
                step.completions[key] = completion
        order = [k for k in reqs if not reqs[k].done]
        if spec.policy is SchedulingPolicy.LONGEST_FIRST:
            order.sort(key=lambda k: -self.history.predicted(reqs[k].spec.prompt_token_ids))
        self.steps[spec.step_id] = step
        self._drafts_wanted = spec.use_drafts
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
        stopped = self._stop_arrived(spec)
        for ids in spec.lookahead:
            self.planner.announce(ids, spec.sampling, "", self.history.predicted(ids))
        self._trim_steps()
        if len(step.completions) == len(reqs):
            return stopped + self._finish(step)
        return stopped + self._fill_all()

    def _stop_arrived(self, spec: StepSpec) -> list[Action]:
        """Stop the draft jobs of the step's own prompts, which have arrived (a job kept beside
        requests may still run one), and hold dispatch while any of them, or an earlier stopped
        job of those prompts, has not reported (``on_draft_result``): a job stores its partial
        draft before it reports, and a request dispatched earlier would read the draft store
        without it. The reports take a few milliseconds (``HOLD_SECONDS`` at most, ``tick``);
        then one fill places the whole step, as it would have at once (a fill per report
        would split the balancer's placement into rounds, and scan every worker each time)."""
        arrived = {p.token_ids for p in spec.prompts}
        actions: list[Action] = []
        now = self.clock()
        for w in self.workers.values():
            for job in [j for j, p in w.drafts.items() if p in arrived]:
                actions.append(StopDraft(w.hello.worker_id, job))
                w.stopping[job] = w.drafts.pop(job)
            if spec.use_drafts:
                for prompt in w.stopping.values():
                    if prompt in arrived:
                        self._held.setdefault(prompt, [0, now])[0] += 1
        return actions

    def _release(self, prompt: tuple[int, ...]) -> None:
        """One pending draft result of ``prompt`` came (or never will)."""
        held = self._held.get(prompt)
        if held is not None:
            held[0] -= 1
            if held[0] <= 0:
                del self._held[prompt]

    def announce(self, prompts: list[tuple[int, ...]], sampling: SamplingParams) -> int:
        self.planner.check_room(prompts, self.settings.max_announced_prompts, "prompts")
        for ids in prompts:
            self.planner.announce(ids, sampling, "", self.history.predicted(ids))
        return len(prompts)

    # ---------------------------------------------------------------- calls --

    def check_requests(self, spec: StepSpec) -> None:
        """Refuse (naming the field, nothing changed) a call whose requests cannot join the pool."""
        self.liveness.check("workers")
        self.versions.check_held()
        modes = {w.hello.logprobs_mode for w in self.workers.values()}
        if modes and spec.sampling.logprobs_mode and spec.sampling.logprobs_mode not in modes:
            raise InvalidRequest("sampling.logprobs_mode", f"no connected worker returns {spec.sampling.logprobs_mode!r} "
                                 f"logprobs (they return {', '.join(sorted(modes))}; EngineSettings.logprobs_mode)",
                                 ErrorCode.FAILED_PRECONDITION)
        self.pool.check(spec)

    def submit_requests(self, spec: StepSpec, single_version: bool = False, dispatch: bool = True,
                        session_id: str = "") -> tuple[list[str], list[Action]]:
        """An independent call's requests join the pool (``core/pool.py``): their keys, prompt
        by prompt and sample by sample, and the actions that dispatch them. ``spec``'s step id
        and policy version are not used: the requests run under the cluster's version of the
        moment they start (``single_version``: never two versions in one completion). With
        ``dispatch`` off they only join the queue, and no actions come: ``dispatch()`` hands
        them out later, once for many calls (a dispatch looks at every worker and every
        running request; a call's own work is only its requests)."""
        self.check_requests(spec)
        keys = self.pool.submit(spec, single_version, session_id)
        if spec.use_drafts:
            self._drafts_wanted = True
        return keys, self._fill_all() if dispatch else []

    def dispatch(self) -> list[Action]:
        """Hand out the queued work (after ``submit_requests(..., dispatch=False)``)."""
        return self._fill_all()

    def cancel_requests(self, keys: list[str]) -> list[Action]:
        """The callers of these pool requests went away: abort what runs, unqueue the rest."""
        return self.pool.cancel(keys) + self._fill_all()

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
        self._future_saving, self._last_finish, self._long_gap = -1.0, None, False

    def cancel_step(self, step_id: str) -> list[Action]:
        step = self.steps.get(step_id)
        if step is None:
            raise InvalidRequest("step_id", f"no step {step_id!r}", ErrorCode.NOT_FOUND)
        if not step.active:
            return []
        step.cancelled = True
        return self._drop_work(step) + self._finish(step) + self._fill_all()

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
            self._note_future_saving(completion.provenance, len(completion.token_ids))
        actions: list[Action]
        if step.spec.step_id == POOL:  # delivered and gone: the pool keeps no completion
            completion, actions = self.pool.delivered(step, req, completion)
        else:
            req.done = True
            step.completions[key] = completion
            actions = [Deliver(step.spec.step_id, completion)]
            if len(step.completions) == len(step.requests):
                actions += self._finish(step)
        actions += self._fill(w)
        if req.moving_to is not None:  # it finished before its worker stopped it: the move is off
            self.mover.cancel(req)
        if self.settings.move_long_requests:  # out of work, or nearly (``Mover._can_take``): take over a long request
            actions += self.mover.take_for(w)
        return actions

    def _note_future_saving(self, provenance: Provenance, tokens: int) -> None:
        """Fold the share of a completion's tokens that came from accepted future drafts into
        the running share that gates draft jobs beside requests (only completions that were
        offered future draft tokens count; ``CoreSettings.max_draft_jobs_beside_requests``)."""
        if tokens and provenance.drafted("future"):
            share = provenance.accepted("future") / tokens
            self._future_saving = share if self._future_saving < 0 else self._future_saving + 0.1 * (share - self._future_saving)

    def _predicted(self, prompt: tuple[int, ...]) -> float:
        """Expected response length of ``prompt`` (``LengthHistory.predicted``)."""
        return self.history.predicted(prompt)

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
        actions = self._take_back(step, req, worker_id, f"aborted by the worker: {reason or 'no reason given'}")
        if moving:  # it was to move, and failed first: it runs again from the start
            self.mover.cancel(req)
        return actions + self._fill_all()

    def on_draft_result(self, worker_id: str, job_id: str, tokens: int, finished: bool = True) -> list[Action]:
        """A draft job ended: ``finished`` when its response ran to the end, else it was
        stopped (or failed) after ``tokens`` tokens; its partial draft is kept all the same."""
        w = self.workers.get(worker_id)
        if w is None or (job_id not in w.drafts and job_id not in w.stopping):
            return []
        prompt = w.drafts.pop(job_id, None) or w.stopping.pop(job_id)
        self.planner.done(prompt, complete=finished and tokens > 0)
        self.timing.set_state(w, self.clock())
        if self._held:  # dispatch waits (``_stop_arrived``): one fill, when the last pending
            self._release(prompt)  # partial draft is stored, places the work and plans drafts
            return [] if self._held else self._fill_all()
        actions = self._fill(w)
        if w.running and self._tail is not None and (first := self.workers.get(self._tail)) is not None \
                and not first.running:  # e.g. a job the tail stopped: the idle worker that began the tail drafts it
            actions += self._plan_drafts(first)
        return actions

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

    def tick(self) -> list[Action]:
        """Periodic checks: dead workers, stragglers, stalled requests."""
        now = self.clock()
        actions: list[Action] = []
        expired = [p for p, (_, since) in self._held.items() if now - since > HOLD_SECONDS]
        for prompt in expired:  # a draft result that never came: run the requests without the draft
            del self._held[prompt]
        if expired:
            actions += self._fill_all()
        for w in [w for w in self.workers.values() if now - w.last_seen > self.settings.worker_timeout_seconds]:
            silent = f"silent for {now - w.last_seen:.1f}s"
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
                by_probes(step, self._predicted, running, now)
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
                return actions + self._fail_step(step, req) + self._fill_all()
            moved.append(key)
        step.shared.extendleft(reversed(moved))
        step.moved += len(moved)
        if moved:
            actions += [RequestsMoved(step.spec.step_id, tuple(moved)), *self._fill_all()]
        return actions

    # ------------------------------------------------------------- dispatch --

    def _fill_all(self) -> list[Action]:
        """Spread available work: one sample group at a time (one request at a time with
        ``spread_samples``) to the worker with the fewest predicted tokens to go (core/balance.py)."""
        actions = self.pool.place_with_siblings() + self.balancer.fill(self._group_size())
        # the tail may begin now (``_tail_begins``): before any worker plans jobs beside its requests
        if self._tail is None and self.settings.min_requests_beside_draft_jobs_at_tail:
            for w in self.workers.values():
                if cleared := self._tail_begins(w):
                    actions += cleared
                    break
        for w in self.workers.values():
            actions += self._fill(w, limit=0)  # idle workers without work: drafts
        return actions

    def _group_size(self) -> int:
        step = self._current_step()
        if step is None or self.settings.spread_samples:
            return 1
        return self.pool.group_size if step.spec.step_id == POOL else step.spec.sampling.n

    def _fill(self, w: WorkerState, limit: int | None = None, plan: bool = True) -> list[Action]:
        """Give ``w`` up to ``limit`` more requests (default: up to its capacity), then plan its
        draft jobs unless ``plan`` is off (``_fill_all`` plans once the whole placement is done:
        a job planned beside a worker's first request would be stopped by its second)."""
        wid = w.hello.worker_id
        if w.loading is not None or w.load_failed is not None or w.asleep or wid not in self.workers:
            return []
        now = self.clock()
        actions: list[Action] = []
        running, capacity = w.running, w.hello.capacity  # read once: this runs once per completion
        budget = capacity if limit is None else limit
        while len(running) < capacity and budget > 0:
            budget -= 1
            key = self._next_for(w)
            if key is None:
                break
            step = self.steps[_step_of(key)]
            actions += self.start_request(w, step, step.requests[key], now)
        if plan and running and self.settings.max_draft_jobs_beside_requests:
            actions += self._plan_drafts(w, self._beside(w, len(running)))
        elif plan and not running and not self._held:  # held: work is due the moment the held results come
            actions += self._tail_begins(w) + self._plan_drafts(w)
        self.timing.set_state(w, now)
        return actions

    def start_request(self, w: WorkerState, step: StepState, req: RequestState, now: float) -> list[Action]:
        """Hand queued ``req`` (taken off its queue) to ``w``, which has room and may run it."""
        wid, key = w.hello.worker_id, req.spec.key
        actions: list[Action] = []
        if req.resume is not None:
            w.moved_in.add(key)
        if w.drafts:
            actions += self._stop_drafts(w, keep=self._beside(w, len(w.running) + 1))
        req.worker, req.started_at, req.progress, req.progress_at = wid, now, req.progress if req.resume else 0, now
        w.running.add(key)
        if step.spec.step_id == POOL:
            self.pool.placed(req, wid)
        self.balancer.stalls.started(step.spec.step_id, key, wid, now, self.settings.stall_seconds)
        actions.append(Assign(wid, req.spec, min(self._predicted(req.spec.prompt_token_ids),
                                                 float(req.spec.sampling.max_tokens)), req.resume))
        return actions

    def _beside(self, w: WorkerState, busy: int) -> int:
        """Draft jobs ``w`` may run beside ``busy`` requests (never in a request's slot; none
        beside fewer than ``min_requests_beside_draft_jobs``, or at the step's tail than
        ``min_requests_beside_draft_jobs_at_tail``, beside a moved request, while future drafts
        do not pay or while the trainer's gaps are long; ``CoreSettings.max_draft_jobs_beside_requests``)."""
        if busy < self.settings.min_requests_beside_draft_jobs or self._long_gap or not self._future_drafts_pay() \
                or w.moved_in or (self._tail is not None and busy < self.settings.min_requests_beside_draft_jobs_at_tail):
            return 0
        return max(0, min(self.settings.max_draft_jobs_beside_requests, w.capacity - busy))

    def _future_drafts_pay(self) -> bool:
        """Whether completions show future drafts paying (``BESIDE_MIN_SAVING``). Before any
        completion was offered one: yes through the first step (``draft_beside_first_step``),
        no after it (where workers propose no draft tokens, nothing will ever show them paying)."""
        if self._future_saving < 0:
            return self._last_finish is None and self.settings.draft_beside_first_step
        return self._future_saving >= BESIDE_MIN_SAVING

    def _next_for(self, w: WorkerState) -> str | None:
        if self._held:  # a step's own prompts wait for their stopped draft jobs' results (``_stop_arrived``)
            return None
        while w.private:
            key = w.private.popleft()
            if self._takeable(w, key):
                return key
        for step in self.steps.values():
            # an empty queue first: the cheapest test and, at a step's tail, the usual answer
            if step.shared and step.active and step.spec.policy_version == w.version \
                    and not self.pauser.holds(step.spec.step_id):
                if step.spec.step_id == POOL and (key := self.pool.take_preferred(w)) is not None:
                    return key  # its conversation's prefix is in ``w``'s KV cache (core/affinity.py)
                for _ in range(len(step.shared)):  # keys it may not take go to the back, once
                    key = step.shared.popleft()
                    if self._takeable(w, key):
                        return key
        return None

    def _takeable(self, w: WorkerState, key: str) -> bool:
        step = self.steps.get(_step_of(key))
        if step is None or not step.active:
            return False
        req = step.requests.get(key)
        if req is None or req.done or req.worker is not None:  # None: a pool request whose caller went away
            return False
        if step.spec.policy_version != w.version or not _serves(w, step.spec.sampling) \
                or (req.spec.adapter is not None and not self.pool.adapters.holds(w.hello.worker_id, req.spec.adapter)):
            step.shared.append(key)  # someone with the right version, logprobs and adapter will take it
            return False
        if req.moved_from is None and not req.failures:
            return True  # the common case: never moved nor failed, so no worker to keep it from
        if req.resume is not None and not w.hello.accepts_resume:
            if any(o.hello.accepts_resume for o in self.workers.values()):
                step.shared.append(key)  # it goes on from a partial: only a worker that can continue one
                return False
            req.resume = None  # no worker left that can: it runs again from the start, as after a failure
        tried = {wid for wid, _ in req.failures}
        if (req.moved_from == w.hello.worker_id or w.hello.worker_id in tried) and self._another_can_run(w, step, tried):
            step.shared.append(key)  # moved off this (slow or stalled) worker, or failed on it: not back to it
            return False
        return True

    def _another_can_run(self, w: WorkerState, step: StepState, tried: set[str] = frozenset()) -> bool:  # type: ignore[assignment]
        """Whether a worker other than ``w``, and none of those in ``tried``, can run the step's work."""
        return any(o is not w and o.hello.worker_id not in tried and o.load_failed is None
                   and o.version == step.spec.policy_version and _serves(o, step.spec.sampling)
                   for o in self.workers.values())

    def _drafter(self, w: WorkerState) -> bool:
        """Whether ``w`` may run draft jobs now."""
        return self.settings.drafting and w.hello.speculation and w.version == self.version and not w.asleep

    def _tail_begins(self, w: WorkerState) -> list[Action]:
        """If ``w`` is the first worker of the running step to have none of its work and to be
        able to draft, the step's tail begins (``CoreSettings.min_requests_beside_draft_jobs_at_tail``):
        stop the draft jobs beside the requests of every worker with fewer than that; none
        starts beside so few again until the next step (``_beside``). Once a step: a pass over the workers."""
        least = self.settings.min_requests_beside_draft_jobs_at_tail
        if self._tail is not None or not least or w.running or self._held or w.loading is not None \
                or w.load_failed is not None or not self._drafter(w) or self._current_step() is None:
            return []
        self._tail = w.hello.worker_id
        return [a for o in self.workers.values() if o.running and o.drafts and len(o.running) < least
                for a in self._stop_drafts(o)]

    def _plan_drafts(self, w: WorkerState, width: int | None = None) -> list[Action]:
        """Start draft jobs on ``w`` until it runs ``width`` (default: an idle worker's width)."""
        if not self._drafter(w):
            return []
        if not self._drafts_wanted:  # drafting goes on after the step, until the next policy
            return []
        actions: list[Action] = []
        if width is None:
            width = self.settings.max_draft_jobs_per_worker
            if self.settings.max_draft_jobs_during_step is not None and self._current_step() is not None:
                width = min(width, self.settings.max_draft_jobs_during_step)
            width = min(w.capacity, width)
        while len(w.drafts) < width:
            up = self.planner.pick()
            if up is None:
                break
            # never a request's seed (nor its random stream); logprobs of a draft are not used
            sampling = job_sampling(up, draft_seed(self.rng), w.hello.logprobs_mode)
            job = DraftJobSpec(f"d{next(self._jobs)}", up.token_ids, sampling, self.version, up.for_step)
            w.drafts[job.job_id] = up.token_ids
            actions.append(StartDraft(w.hello.worker_id, job))
        return actions

    def _stop_drafts(self, w: WorkerState, keep: int = 0) -> list[Action]:
        """Preempt ``w``'s draft jobs but the ``keep`` most valuable (their prompts predicted
        longest); each stopped one still reports its (partial) result."""
        if len(w.drafts) <= keep:
            return []
        jobs = list(w.drafts)
        if keep:
            upcoming = self.planner.upcoming
            jobs.sort(key=lambda j: -(u.predicted_len if (u := upcoming.get(w.drafts[j])) is not None else -1.0))
            jobs = jobs[keep:]
        actions: list[Action] = []
        for job in jobs:
            actions.append(StopDraft(w.hello.worker_id, job))
            w.stopping[job] = w.drafts.pop(job)
        return actions

    # --------------------------------------------------------------- finish --

    def _finish(self, step: StepState) -> list[Action]:
        now = self.clock()
        self.timing.flush(self.workers.values(), now)
        step.finished_at = now
        self._last_finish = (now, now - step.started_at)
        self._tail = None
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
        actions: list[Action] = [StepFinished(step.spec.step_id, step.summary)]
        if self.settings.max_draft_jobs_during_step is not None and self._current_step() is None:  # the gap: full width
            actions += [a for w in self.workers.values() if not w.running for a in self._plan_drafts(w)]
        return actions

    def _trim_steps(self) -> None:
        done = [sid for sid, s in self.steps.items() if not s.active]
        for sid in done[: max(0, len(done) - self.settings.keep_steps)]:
            del self.steps[sid]

    # ------------------------------------------------------- time accounting --

    def _current_step(self) -> StepState | None:
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


def _serves(w: WorkerState, sampling: SamplingParams) -> bool:
    """``w`` returns the logprobs ``sampling`` asks for ('' = any: the shell resolves the default)."""
    return sampling.logprobs_mode in ("", w.hello.logprobs_mode)


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
