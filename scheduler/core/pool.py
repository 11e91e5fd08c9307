"""Requests as first-class work: independent calls join one open step, the pool (pure).

Trainers that drive a rollout server by URL send one call per rollout or per turn, thousands at
once (prime-rl, SkyRL, TRL's async trainer, multi-turn agents). Such calls are not steps: they
join the cluster's work as they come and each is answered as it finishes, with no cap on the
calls in flight but the pool's limits on memory and queue depth (``CoreSettings.max_pending_requests``,
``max_pending_prompt_tokens``; beyond them a call is refused RESOURCE_EXHAUSTED with a retry
hint, HTTP 429 ``Retry-After``).

The pool is a step of the core (id ``POOL``) that exists while it holds requests, so dispatch,
the straggler watch, moves, drafts beside requests and the length history treat its requests
as they treat a step's. Calls with the same prompt tokens are one group: one prompt id, sample
indices counted on across calls, so that the worker's sibling drafts (by prompt), the length
history and the probes see them together. A delivered request leaves the pool at once: its
memory is the requests in flight, not the calls served.

vLLM's pause semantics (``core/pause.py`` asks the pool):

- a call that arrives while paused is parked: it waits, and joins the queue at ``resume``;
- ``wait``: requests admitted before the pause run to the end (``waiting`` until then);
- ``keep``: running requests stop on their workers and send what they generated
  (``Abort.keep_partial``); at ``resume`` each goes on from its own tokens, under the policy
  version of that moment, and its completion says which version made each span of its tokens
  (``Completion.version_spans``). A request submitted with ``single_version`` instead runs
  again from scratch when the version changed, so all its tokens are of one version;
- ``abort``: running requests stop and are answered with what they generated and
  ``finish_reason`` ``abort``; queued ones with no tokens.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from bubblespec.common.types import Completion, FinishReason, SamplingParams, SchedulingPolicy
from bubblespec.scheduler.core.adapters import AdapterTable, check_adapter
from bubblespec.scheduler.core.affinity import Affinity
from bubblespec.scheduler.core.checks import check_completion
from bubblespec.scheduler.core.types import (
    Abort,
    Action,
    Deliver,
    ErrorCode,
    InvalidRequest,
    ModelLimits,
    RequestFailed,
    RequestSpec,
    RequestsMoved,
    StepSpec,
    request_key,
)

if TYPE_CHECKING:
    from bubblespec.scheduler.core.records import CoreParts, RequestState, StepState, WorkerState

__all__ = ["POOL", "RETRY_AFTER_SECONDS", "RequestPool", "checked_partial", "continued", "sample_sampling",
           "version_spans"]

POOL = "requests"
"""Step id of the pool; its request keys are ``requests/<group>/<sample>``."""
RETRY_AFTER_SECONDS = 1.0
"""The retry hint of a call refused because the pool is full."""
AFFINITY_WINDOW = 1024
"""How far into the queue a worker with a free slot looks for the oldest request that prefers
it (``RequestPool.take_preferred``): a preferred request jumps at most this many others. In
``bench/sessions.py`` (1,024 sessions on 8 simulated workers, a queue of ~768) a window of 64
placed 55% of turns on their worker and 1,024 placed 97%."""


def sample_sampling(base: SamplingParams, i: int, max_tokens: int) -> SamplingParams:
    """Sample ``i``'s sampling of a call or step: n = 1, seed + i, the prompt's ``max_tokens``
    (``base`` itself where that changes nothing: the one sample of most calls)."""
    if base.n == 1 and base.max_tokens == max_tokens and (base.seed is None or i == 0):
        return base
    return replace(base, n=1, seed=None if base.seed is None else base.seed + i, max_tokens=max_tokens)


@dataclass
class _Group:
    """Requests in the pool with one prompt: one prompt id, sample indices counted on."""

    gid: str
    live: int = 0
    next_sample: int = 0


@dataclass
class _Stopping:
    """Running requests asked to stop and send their partial (``Abort.keep_partial``)."""

    held: set[str] = field(default_factory=set)
    """keep: each goes on from its partial at resume."""
    aborted: set[str] = field(default_factory=set)
    """abort: each is answered with its partial, ``finish_reason`` abort."""


class RequestPool:
    """The pool's groups, parked calls and stops; a collaborator of ``SchedulerCore``
    (``core.pool``), which owns the pool's ``StepState`` in ``core.steps`` like any step's."""

    def __init__(self, core: CoreParts):
        self.core = core
        self._groups: dict[tuple[tuple[str, int] | None, tuple[int, ...]], _Group] = {}
        """(adapter, prompt tokens) -> its group: siblings never cross LoRA adapters or versions."""
        self._ids = itertools.count()
        self.parked: list[str] = []
        """Requests submitted while paused, queued at ``resume``."""
        self.stopping = _Stopping()
        self.single_version: set[str] = set()
        """Requests that run again from scratch rather than go on under another version."""
        self.pending = 0
        self.pending_tokens = 0
        self.group_size = 1
        """Samples per call of the latest call (dispatch hands out a group at a time)."""
        self._where: dict[str, str] = {}
        """Group id -> the worker its latest request went to (``place_with_siblings``)."""
        self.affinity: Affinity | None = Affinity() if core.settings.session_affinity else None
        """Which worker holds each conversation's prefix (``core/affinity.py``); None: off."""
        self.adapters = AdapterTable()
        """The LoRA adapters served, their versions and holders (``core/adapters.py``)."""

    # ------------------------------------------------------------------ queries --

    @property
    def step(self) -> StepState | None:
        return self.core.steps.get(POOL)

    def waiting(self) -> bool:
        """Whether requests admitted before the pause are still to run (``pause(wait)``)."""
        return self.pending > len(self.parked)

    def check(self, spec: StepSpec) -> None:
        """Refuse, naming the field and changing nothing, a call the pool cannot take."""
        limits = self.core.settings
        count = spec.num_requests
        if self.pending + count > limits.max_pending_requests:
            raise InvalidRequest("request", f"{self.pending} requests are waiting or running, the limit is "
                                 f"{limits.max_pending_requests} (max_pending_requests); retry later",
                                 ErrorCode.RESOURCE_EXHAUSTED, retry_after=RETRY_AFTER_SECONDS)
        if spec.adapter is not None:
            check_adapter(self.adapters, spec.adapter, self.core.workers)
        tokens = sum(len(p.token_ids) for p in spec.prompts) * spec.sampling.n
        if self.pending_tokens + tokens > limits.max_pending_prompt_tokens:
            raise InvalidRequest("request", f"the requests waiting or running hold {self.pending_tokens} prompt "
                                 f"tokens, the limit is {limits.max_pending_prompt_tokens} "
                                 "(max_pending_prompt_tokens); retry later", ErrorCode.RESOURCE_EXHAUSTED,
                                 retry_after=RETRY_AFTER_SECONDS)

    # ------------------------------------------------------------------- calls --

    def submit(self, spec: StepSpec, single_version: bool = False, session_id: str = "") -> list[str]:
        """Add a call's requests (``spec``: validated by ``build_step``; its step id is not
        used) and return their keys, prompt by prompt, sample by sample. Checked first.
        ``session_id``: the conversation the call continues (``core/affinity.py``), if named."""
        self.check(spec)
        core = self.core
        step = self.step
        if step is None:
            sampling = SamplingParams(n=1)
            step = core.open_step(StepSpec(POOL, core.version, (), sampling, policy=SchedulingPolicy.QUEUE))
        version, n = step.spec.policy_version, spec.sampling.n
        keys: list[str] = []
        for p in spec.prompts:
            gkey = (spec.adapter, p.token_ids)
            group = self._groups.get(gkey)
            if group is None:
                group = self._groups[gkey] = _Group(f"g{next(self._ids)}")
            first = len(keys)
            for i in range(n):
                index = group.next_sample
                group.next_sample += 1
                group.live += 1
                key = request_key(POOL, group.gid, index)
                step.requests[key] = core.new_request(RequestSpec(
                    key, POOL, group.gid, index, p.token_ids, sample_sampling(spec.sampling, i, p.max_tokens),
                    version, spec.use_drafts, n, spec.adapter))
                keys.append(key)
            self.pending_tokens += len(p.token_ids) * n
            if self.affinity is not None:
                self.affinity.submitted(keys[first:], p.token_ids, session_id)
        self.pending += len(keys)
        if single_version:
            self.single_version.update(keys)
        if core.pauser.paused:
            self.parked.extend(keys)
        else:
            step.shared.extend(keys)
        self.group_size = n
        return keys

    def cancel(self, keys: list[str]) -> list[Action]:
        """The callers of ``keys`` went away: abort those running, unqueue the rest."""
        step = self.step
        if step is None:
            return []
        actions: list[Action] = []
        gone: set[str] = set()
        for key in keys:
            req = step.requests.get(key)
            if req is None:
                continue
            if req.worker is not None:
                w = self.core.workers.get(req.worker)
                if w is not None and key in w.running:
                    w.running.discard(key)
                    w.moved_in.discard(key)
                    actions.append(Abort(req.worker, key))
                if req.moving_to is not None:
                    self.core.mover.cancel(req)
            gone.add(key)
            self._drop(step, req)
        if gone:
            step.shared = deque(k for k in step.shared if k not in gone)
            self.parked = [k for k in self.parked if k not in gone]
            for w in self.core.workers.values():
                if w.private and any(k in gone for k in w.private):
                    w.private = deque(k for k in w.private if k not in gone)
        self._close_if_empty()
        return actions

    def unload_adapter(self, name: object) -> list[Action]:
        """Stop serving LoRA adapter ``name`` (``AdapterTable.unload``'s checks): its requests
        that have not started fail, naming ``model``; those running finish."""
        adapter = self.adapters.unload(name)
        step = self.step
        if step is None:
            return []
        queued = [key for key, req in step.requests.items()
                  if req.worker is None and req.spec.adapter is not None and req.spec.adapter[0] == adapter.name]
        self.cancel(queued)
        return [RequestFailed(key, "model", f"adapter '{adapter.name}' was unloaded before the request ran")
                for key in queued]

    # ----------------------------------------------------------------- results --

    def delivered(self, step: StepState, req: RequestState, completion: Completion) -> tuple[Completion, list[Action]]:
        """``req`` finished: its completion with the versions of its spans, and it leaves."""
        completion = continued(req.resume, completion)
        if self.affinity is not None:
            self.affinity.finished(req.spec.key, req.spec.prompt_token_ids, completion.token_ids, completion.worker_id)
        self._drop(step, req)
        self._close_if_empty()
        return completion, [Deliver(POOL, completion)]

    def failed(self, step: StepState, req: RequestState) -> list[Action]:
        """``req`` failed every attempt (``CoreSettings.max_attempts``): its caller gets the error."""
        spec = req.spec
        workers = ", ".join(w for w, _ in req.failures)
        message = (f"request {spec.key!r} failed {len(req.failures)} attempts (workers: {workers:.200}). "
                   f"Last error: {req.failures[-1][1]:.200}")
        self._drop(step, req)
        self._close_if_empty()
        return [RequestFailed(spec.key, "request", message)]

    def lost(self, step: StepState, req: RequestState, worker_id: str, reason: str) -> list[Action] | None:
        """``req``'s worker failed it while it was being stopped: an aborted one is answered
        with no tokens, a held one runs again from scratch, no failed attempt counted (None: not
        being stopped, the usual failed attempt)."""
        key = req.spec.key
        if key in self.stopping.aborted:
            return self._abort_answer(step, req, None)
        if key in self.stopping.held:
            self.stopping.held.discard(key)
            req.worker = None
            step.shared.appendleft(key)
            return [RequestsMoved(POOL, (key,), requeued=True)]
        return None

    def stopped(self, step: StepState, req: RequestState, worker_id: str, partial: Completion | None) -> list[Action] | None:
        """The answer to a pause's stop (``Abort.keep_partial``) came (None: ``req`` was not
        stopped by a pause). A partial that cannot continue ``req`` is dropped: held, it runs
        again from scratch; aborted, it is answered with no tokens."""
        key = req.spec.key
        if key not in self.stopping.held and key not in self.stopping.aborted:
            return None
        w = self.core.workers[worker_id]
        w.running.discard(key)
        w.moved_in.discard(key)
        if partial is not None:
            try:
                partial = checked_partial(partial, req, getattr(self.core, "limits", None))
            except InvalidRequest:
                partial = None
        if key in self.stopping.aborted:
            return self._abort_answer(step, req, partial) + self.core.dispatcher.fill(w)
        self.stopping.held.discard(key)
        req.worker = None
        if partial is not None and partial.token_ids:
            req.resume = continued(req.resume, partial)
            req.progress = len(partial.token_ids)
        self._rebase(req, step.spec.policy_version)  # the version may have moved while it stopped
        step.shared.appendleft(key)
        return [RequestsMoved(POOL, (key,), requeued=True), *self.core.dispatcher.fill(w)]

    # ---------------------------------------------------------------- dispatch --

    def placed(self, req: RequestState, worker_id: str) -> None:
        """``req`` started on ``worker_id``: its group's later requests prefer that worker."""
        self._where[req.spec.prompt_id] = worker_id
        if self.affinity is not None:
            self.affinity.placed(req.spec.key, worker_id)

    def take_preferred(self, w: WorkerState) -> str | None:
        """The oldest queued request that prefers ``w`` (its conversation's prefix is there),
        taken out of the queue if it is among its first ``AFFINITY_WINDOW``; None otherwise.
        The caller checked that ``w`` may take the pool's work (its version, not paused)."""
        step, affinity = self.step, self.affinity
        if affinity is None or not affinity.wanted or step is None:
            return None
        wid = w.hello.worker_id
        while (key := affinity.oldest_for(wid)) is not None:
            req = step.requests.get(key)
            if req is None or req.worker is not None or req.resume is not None or req.failures \
                    or req.spec.sampling.logprobs_mode not in ("", w.hello.logprobs_mode):
                affinity.unwant(key)  # the usual path (``Dispatcher.takeable``) decides for it
                continue
            try:
                i = step.shared.index(key, 0, AFFINITY_WINDOW)
            except ValueError:
                return None  # further back (or parked): it waits its turn like the others
            del step.shared[i]
            return key
        return None

    def worker_gone(self, worker_id: str) -> None:
        """``worker_id`` left the cluster: what preferred it prefers nothing now, and it holds no
        LoRA adapter (an engine that comes back has none until the next load)."""
        if self.affinity is not None:
            self.affinity.worker_gone(worker_id)
        self.adapters.left(worker_id)

    def place_with_siblings(self) -> list[Action]:
        """Queued requests whose group runs on a worker with room go there, ahead of the usual
        placement: samples of one prompt on one worker draft from each other (``sibling``), as a
        step's sample groups do, whether they came in one call or in many (one per rollout).
        Looks at the head of the queue only, as far as the free slots reach."""
        step, core = self.step, self.core
        wanted = self.affinity.wanted if self.affinity is not None else {}
        if step is None or not step.shared or not (self._where or wanted) or core.pauser.holds(POOL):
            return []
        version = step.spec.policy_version
        room = {w.hello.worker_id: w.capacity - len(w.running) for w in core.workers.values()
                if len(w.running) < w.capacity and w.loading is None and w.load_failed is None and w.version == version}
        if not room:
            return []
        actions: list[Action] = []
        skipped: list[str] = []
        now = core.clock()
        for _ in range(min(len(step.shared), 2 * sum(room.values()))):
            key = step.shared.popleft()
            req = step.requests.get(key)
            if req is None:
                continue  # its caller went away
            wid = self._where.get(req.spec.prompt_id) or wanted.get(key)
            if wid not in room or req.worker is not None or req.resume is not None or req.failures \
                    or req.spec.sampling.logprobs_mode not in ("", core.workers[wid].hello.logprobs_mode):
                skipped.append(key)
                continue
            actions += core.dispatcher.start_request(core.workers[wid], step, req, now)
            room[wid] -= 1
            if not room[wid]:
                del room[wid]
                if not room:
                    break
        step.shared.extendleft(reversed(skipped))
        return actions

    # ------------------------------------------------------------------ pauses --

    def hold(self) -> list[Action]:
        """``pause(keep)``: stop the running requests, each to go on from its partial."""
        return self._stop_running(self.stopping.held)

    def abort(self) -> list[Action]:
        """``pause(abort)``: answer every admitted request, running ones with their partial."""
        step = self.step
        if step is None:
            return []
        actions = self._stop_running(self.stopping.aborted)
        queued = [k for k in step.shared if k in step.requests]
        for w in self.core.workers.values():
            queued += [k for k in w.private if k in step.requests]
            w.private = deque(k for k in w.private if k not in step.requests)
        step.shared.clear()
        for key in queued:
            req = step.requests.get(key)
            if req is not None and req.worker is None:
                actions += self._abort_answer(step, req, None)
        return actions

    def unpark(self) -> None:
        """``resume``: calls that came while paused join the queue."""
        step = self.step
        if step is not None and self.parked:
            step.shared.extend(k for k in self.parked if k in step.requests)
        self.parked = []

    def rebase(self, version: int) -> None:
        """``version`` became the cluster's: every request not running goes on under it (a
        ``single_version`` one from scratch)."""
        step = self.step
        if step is None or step.spec.policy_version == version:
            return
        step.spec = replace(step.spec, policy_version=version)
        for req in step.requests.values():
            if req.worker is None:
                self._rebase(req, version)

    def _rebase(self, req: RequestState, version: int) -> None:
        if req.spec.policy_version != version:
            req.spec = replace(req.spec, policy_version=version)
            if req.spec.key in self.single_version and req.resume is not None:
                req.resume, req.progress = None, 0

    # ----------------------------------------------------------------- helpers --

    def _stop_running(self, into: set[str]) -> list[Action]:
        step = self.step
        if step is None:
            return []
        actions: list[Action] = []
        for key, req in step.requests.items():
            if req.worker is None or key in self.stopping.held or key in self.stopping.aborted:
                continue
            if req.moving_to is not None:  # a move under way: the pause's stop takes its place
                self.core.mover.cancel(req)
            into.add(key)
            actions.append(Abort(req.worker, key, keep_partial=True))
        return actions

    def _abort_answer(self, step: StepState, req: RequestState, partial: Completion | None) -> list[Action]:
        spec = req.spec
        done = continued(req.resume, partial) if partial is not None else req.resume
        tokens = () if done is None else tuple(done.token_ids)
        completion = Completion(
            POOL, spec.prompt_id, spec.sample_index, tokens, () if done is None else tuple(done.logprobs),
            "" if done is None else done.text, FinishReason.ABORT,
            spec.policy_version if done is None else done.policy_version,
            worker_id="" if done is None else done.worker_id, prompt_tokens=len(spec.prompt_token_ids),
            version_spans=() if done is None else done.version_spans)
        if done is not None:
            completion = replace(completion, provenance=done.provenance)
        return self.delivered(step, req, completion)[1]

    def _drop(self, step: StepState, req: RequestState) -> None:
        key = req.spec.key
        req.done = True
        if step.requests.pop(key, None) is None:
            return
        self.pending -= 1
        self.pending_tokens -= len(req.spec.prompt_token_ids)
        self.stopping.held.discard(key)
        self.stopping.aborted.discard(key)
        self.single_version.discard(key)
        if self.affinity is not None:
            self.affinity.dropped(key)
        gkey = (req.spec.adapter, req.spec.prompt_token_ids)
        group = self._groups.get(gkey)
        if group is not None and group.gid == req.spec.prompt_id:
            group.live -= 1
            if group.live <= 0:
                del self._groups[gkey]
                self._where.pop(group.gid, None)

    def _close_if_empty(self) -> None:
        """Forget the pool's step once it holds no request (it exists only while it does)."""
        step = self.step
        if step is not None and not step.requests:
            self.core.close_step(POOL)
            self.parked = []


def continued(before: Completion | None, after: Completion) -> Completion:
    """``after``, what a request's worker reported (every token from the start, its own policy
    version stamped: a worker that went on from ``before`` joins its tokens), with the versions
    of its spans where ``before`` was made with others."""
    spans = version_spans(before, after)
    return after if spans == after.version_spans else replace(after, version_spans=spans)


def version_spans(before: Completion | None, after: Completion) -> tuple[tuple[int, int], ...]:
    """(first token index, policy version) of each span of ``after``'s tokens made with one
    version, ``before`` being the partial it went on from; () when one version made them all."""
    if before is None:
        return after.version_spans
    spans = list(before.version_spans or ((0, before.policy_version),))
    if after.policy_version != spans[-1][1]:
        spans.append((len(before.token_ids), after.policy_version))
    return tuple(spans) if len(spans) > 1 else ()


def checked_partial(partial: Completion, req: RequestState, limits: ModelLimits | None) -> Completion:
    """``partial`` if ``req`` can go on from it (after a move, ``core/moves.py``, or a keep
    pause), else ``InvalidRequest`` naming the field: another request's, tokens outside the
    vocabulary, another policy version, as long as the request may be, logprobs that do not
    match its tokens."""
    partial = check_completion(partial, req.spec.key, limits, "aborted.partial", req.spec, partial=True)
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
