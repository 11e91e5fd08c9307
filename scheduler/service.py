"""The asyncio shell around ``SchedulerCore``: it owns the worker links, the step
subscriptions and the policy barriers, feeds worker events to the core (``core.handle``)
and executes the actions it returns.

The gRPC servicers and the HTTP app call into this class. Worker messages reach it already
turned into events, what it queues for a worker is the core's action itself, and a step's
stream is core types (``Completion`` lists, ``StepSummary``): ``scheduler/wire.py`` and the
servicers convert at the edge; no protobuf here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from bubblespec.common.types import Completion, SamplingParams, StepSummary
from bubblespec.scheduler.control import ControlCalls
from bubblespec.scheduler.core.checks import check_replayed
from bubblespec.scheduler.core.events import WorkerEvent, WorkerJoined, WorkerLeft
from bubblespec.scheduler.core.pause import PauseMode
from bubblespec.scheduler.core.pool import POOL
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.transfer import WeightTransfer
from bubblespec.scheduler.core.types import (
    Abort,
    Action,
    Assign,
    Deliver,
    Disconnect,
    ErrorCode,
    Ignored,
    InvalidRequest,
    LoadPolicy,
    PolicyFailed,
    PolicyLoadReported,
    PolicyReady,
    RequestFailed,
    StartDraft,
    StepFailed,
    StepFinished,
    StepSpec,
    StopDraft,
    WorkerHello,
    request_key,
)
from bubblespec.scheduler.pending import Pending

__all__ = ["END", "SchedulerService", "WorkerLink"]

logger = logging.getLogger(__name__)
END = object()
"""The last item of a worker's outbox and of a step subscriber's queue."""


@dataclass(eq=False)
class WorkerLink:
    """One connected worker: its outbound queue (core actions for it, control calls; the
    servicer turns what it holds at once into ``SchedulerMessage`` s: ``wire.scheduler_messages``)
    and, last, ``END``. ``accepts_assign_batches``: the worker's hello said it reads ``assigns``
    batches (consecutive assignments then go out as one message)."""

    worker_id: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepts_assign_batches: bool = False
    lora_config: dict | None = None
    """Its engine's LoRA config as vLLM dumps it (None: LoRA off): ``/server_info``'s (``lora_models``)."""

    def drain(self, first: object) -> tuple[list, bool]:
        """``first`` and what else the outbox holds now, in order, up to ``END``; and whether
        ``END`` was reached (the stream ends after these)."""
        items = [first]
        while items[-1] is not END and not self.outbox.empty():
            items.append(self.outbox.get_nowait())
        if items[-1] is END:
            return items[:-1], True
        return items, False

    def send(self, msg: object) -> None:
        self.outbox.put_nowait(msg)

    def close(self) -> None:
        self.outbox.put_nowait(END)


@dataclass
class WorkerMessages:
    """Messages on the workers' streams, a batch counting once
    (``bubblespec_worker_stream_messages_total``): a gRPC message costs the scheduler CPU of its
    own, whatever it carries (docs/LOAD.md), so messages per completion tell how well the
    workers' completions and the scheduler's assignments batch."""

    received: int = 0
    sent: int = 0


@dataclass
class LoopStalls:
    """Seconds the scheduler's event loop could not run its tick on time, summed
    (``bubblespec_scheduler_loop_stall_seconds_total``): time in which it read no worker stream
    and answered no call. Not counted as the workers' silence (``core/silence.py``); a stall of
    a second or more is logged as a warning."""

    seconds: float = 0.0
    warn_after: float = 1.0

    def observe(self, stalled: float) -> None:
        self.seconds += stalled
        if stalled >= self.warn_after:
            logger.warning("the scheduler's event loop stalled for %.1fs: no worker stream was read and no call "
                           "answered meanwhile (not counted as the workers' silence)", stalled)


class SchedulerService:
    """The asyncio side of the scheduler: worker links, trainer subscriptions, policy update
    barriers, the journal. Feeds events to ``SchedulerCore`` and executes its actions
    (``execute``); decides nothing the core decides (acceptance rules live in the core)."""

    def __init__(self, core: SchedulerCore, tokenize: Callable[[str], tuple[int, ...]] | None = None,
                 journal: Any = None, orphan_grace_seconds: float = 30.0):
        self.core = core
        self.tokenize = tokenize
        self.journal = journal  # StepJournal or None: what a restarted scheduler needs
        self.orphan_grace_seconds = orphan_grace_seconds
        self.links: dict[str, WorkerLink] = {}
        self.subscribers: dict[str, list[Pending]] = {}
        self.callers: dict[str, Pending] = {}  # pool request key -> its call's queue (``run_requests``)
        self.barriers: list[tuple[int, asyncio.Future]] = []
        self.listeners: list[Callable[[Action], None]] = []  # metrics exporter, persistence
        self.draining = False
        self._resumed: list[asyncio.Future] = []  # pause(wait) calls in progress: a resume ends them
        self.control = ControlCalls(self._send)  # engine control calls fanned out to workers (control.py)
        self.transfer = WeightTransfer(core)  # vLLM's weight-transfer group (core/transfer.py)
        self.worker_messages = WorkerMessages()  # counted by the WorkerLink servicer
        self.loop_stalls = LoopStalls()  # measured by ``tick_forever``
        self._dispatch_due = False  # a dispatch of the pool's new requests is scheduled (``run_requests``)
        self.on_join: list[Callable[[WorkerLink], None]] = []
        """Called with each worker's link once it joined (``lora_api``: it loads the cluster's adapters)."""

    # --------------------------------------------------------------- actions --

    def execute(self, actions: list[Action]) -> None:
        for action in actions:
            for listener in self.listeners:
                listener(action)
            if type(action) is Assign:  # most actions are assignments and deliveries: no pattern matching for those
                self._send(action.worker_id, action)
                continue
            if type(action) is Deliver:
                self._deliver(action.step_id, action.completion)
                continue
            match action:
                case Assign() | Abort() | LoadPolicy() | StartDraft() | StopDraft():
                    self._send(action.worker_id, action)
                case Disconnect(worker_id, reason):
                    link = self.links.pop(worker_id, None)
                    if link is not None:
                        logger.warning("worker %s disconnected: %s", worker_id, reason)
                        link.close()
                        self.control.lost(worker_id, f"disconnected before answering: {reason}")
                case Deliver(step_id, completion):
                    self._deliver(step_id, completion)
                case RequestFailed(key, _, message):
                    logger.error("request %s failed: %s", key, message)
                    if (caller := self.callers.get(key)) is not None:
                        caller.put_nowait(action)
                case StepFinished(step_id, summary):
                    self._publish(step_id, summary)
                    self._publish(step_id, END)
                    if self.journal is not None:  # delivered: keep it only briefly (retries right after)
                        self.journal.finish_step(step_id)
                    logger.info("step %s finished: %d completions in %.2fs", step_id, summary.completions,
                                summary.makespan_seconds)
                case StepFailed(step_id, field, message, code):
                    logger.error("step %s failed: %s: %s", step_id, field, message)
                    # a resume after a restart gets the same failure; one for want of workers (UNAVAILABLE) is
                    # not final: a retry resumes from the completions journaled (core/liveness.py)
                    if self.journal is not None and code != ErrorCode.UNAVAILABLE:
                        self.journal.save_failure(step_id, field, message)
                        self.journal.finish_step(step_id)
                    self._publish(step_id, action)
                    self._publish(step_id, END)
                case PolicyReady(version, _):
                    if self.journal is not None:  # only a version every live worker loaded is kept
                        self.journal.save_policy(version, self.core.policy_weights_path)
                    self._end_barrier(version, action)
                case PolicyFailed(version, code, field_, message):
                    logger.error("policy update to version %d failed: %s: %s", version, field_, message)
                    self._end_barrier(version, InvalidRequest(field_, message, code))
                case PolicyLoadReported(worker_id, version, ok, error, _) if not ok:
                    logger.error("worker %s failed to load version %d: %s", worker_id, version, error)
                case Ignored(worker_id, field_, reason):  # stale (moved, cancelled: info) or wrong (warning)
                    level = logging.INFO if field_.endswith(".request_key") else logging.WARNING
                    logger.log(level, "worker %s: ignored: %s: %s", worker_id, field_, reason)

    def _deliver(self, step_id: str, completion: Completion) -> None:
        if step_id == POOL:  # an independent call's request: to its caller only, never journaled
            caller = self.callers.get(request_key(POOL, completion.prompt_id, completion.sample_index))
            if caller is not None:
                caller.put_nowait(completion)
            return
        if self.journal is not None:
            key = request_key(step_id, completion.prompt_id, completion.sample_index)
            self.journal.save_completion(key, completion)
        self._publish(step_id, completion)

    def _end_barrier(self, version: int, outcome: PolicyReady | InvalidRequest) -> None:
        """Answer every ``UpdatePolicy`` call waiting for ``version``: its ``PolicyReady`` or an error."""
        for v, fut in self.barriers:
            if v == version and not fut.done():
                if isinstance(outcome, InvalidRequest):
                    fut.set_exception(outcome)
                else:
                    fut.set_result(outcome)
        self.barriers = [(v, f) for v, f in self.barriers if not f.done()]

    def _send(self, worker_id: str, msg: object) -> bool:
        """Queue ``msg`` (an action for the worker, or a control call) on its stream."""
        link = self.links.get(worker_id)
        if link is not None:
            link.send(msg)
        return link is not None

    def _publish(self, step_id: str, msg: object) -> None:
        for queue in self.subscribers.get(step_id, []):
            queue.put_nowait(msg)

    # ---------------------------------------------------------------- trainer --

    async def run_step(self, spec: StepSpec) -> AsyncIterator[list[Completion] | StepSummary]:
        """Submit (or resume) a step and stream its completions, then its summary: each item is
        every completion delivered since the last one (a list, in delivery order; the trainer's
        servicer may send it as one ``CompletionBatch``), or the summary. A failed step raises
        ``InvalidRequest`` (FAILED_PRECONDITION naming the prompt); a cancelled one CANCELLED."""
        if self.draining:
            raise InvalidRequest("step_id", "the scheduler is shutting down", ErrorCode.UNAVAILABLE)
        existing = self.core.check_step(spec)
        done = await self._journaled(spec) if existing is None else {}
        existing = self.core.check_step(spec)  # another call may have submitted it meanwhile
        queue = Pending()
        for c in done.values():  # delivered by an earlier scheduler: replay
            queue.put_nowait(c)
        if existing is not None:  # resume: replay what is done, then follow
            for c in existing.completions:
                queue.put_nowait(c)
            if existing.summary is not None:
                queue.put_nowait(existing.summary)
                queue.put_nowait(END)
            elif existing.failure is not None:  # the same failure, not a re-run
                raise _failed(existing.failure)
            elif existing.cancelled:
                raise InvalidRequest("step_id", f"step {spec.step_id!r} was cancelled", ErrorCode.CANCELLED)
        self.subscribers.setdefault(spec.step_id, []).append(queue)
        try:
            if existing is None:
                if self.journal is not None:
                    self.journal.save_step(spec.step_id, spec.fingerprint)
                self.execute(self.core.submit_step(spec, done))
            async for item in _items(queue):
                yield item
            step = self.core.step(spec.step_id)
            if step is not None and step.cancelled:
                raise InvalidRequest("step_id", f"step {spec.step_id!r} was cancelled", ErrorCode.CANCELLED)
        finally:
            subs = self.subscribers.get(spec.step_id, [])
            if queue in subs:
                subs.remove(queue)
            if not subs:
                self.subscribers.pop(spec.step_id, None)
                step = self.core.step(spec.step_id)
                if step is not None and step.active:  # the trainer went away mid-step
                    asyncio.get_running_loop().call_later(self.orphan_grace_seconds, self._cancel_orphan, spec.step_id)

    async def run_requests(self, spec: StepSpec, single_version: bool = False,
                           session_id: str = "") -> AsyncIterator[tuple[int, Completion]]:
        """An independent call (``core/pool.py``): its requests join the cluster's work, and
        each completion comes as it finishes, with its index in the call (prompt by prompt,
        sample by sample). Raises ``InvalidRequest`` when the call is refused (nothing joined)
        or a request failed every attempt; a caller that stops listening aborts what is left.
        ``session_id``: the conversation the call continues, if named (``core/affinity.py``)."""
        if self.draining:
            raise InvalidRequest("request", "the scheduler is shutting down", ErrorCode.UNAVAILABLE)
        keys, actions = self.core.submit_requests(spec, single_version, dispatch=False, session_id=session_id)
        self._dispatch_soon()
        queue = Pending()
        index = {key: i for i, key in enumerate(keys)}
        for key in keys:
            self.callers[key] = queue
        try:
            self.execute(actions)
            while index:
                await queue.wait()
                for msg in queue.take():
                    if isinstance(msg, RequestFailed):
                        raise InvalidRequest(msg.field, msg.message, msg.code)
                    key = request_key(POOL, msg.prompt_id, msg.sample_index)
                    yield index.pop(key), msg
        finally:
            for key in keys:
                self.callers.pop(key, None)
            if index:  # the caller went away (or one request failed): the rest is of no use
                self.execute(self.core.cancel_requests(list(index)))

    def _dispatch_soon(self) -> None:
        """Dispatch the pool's new requests once the event loop comes round: the calls that
        joined meanwhile (a burst of them, thousands at once) share one dispatch, whose cost
        grows with the workers and the running requests, instead of one each."""
        if not self._dispatch_due:
            self._dispatch_due = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._dispatch_due = False
        self.execute(self.core.dispatch())

    async def _journaled(self, spec: StepSpec) -> dict:
        """Completions of this step that an earlier scheduler delivered (restart), if any."""
        if self.journal is None:
            return {}
        prior = await self.journal.load_step(spec.step_id)
        if prior is None:
            return {}
        fingerprint, done = prior
        if fingerprint != spec.fingerprint:
            raise InvalidRequest("step_id", f"step {spec.step_id!r} exists with different content",
                                 ErrorCode.ALREADY_EXISTS)
        failure = await self.journal.load_failure(spec.step_id)
        if failure is not None:  # an earlier scheduler ended it in failure: the same failure, not a re-run
            raise _failed(StepFailed(spec.step_id, *failure))
        kept = {}
        for key, c in done.items():  # authentic (MAC checked), but checked like a live completion too
            try:
                kept[key] = check_replayed(c, key, spec, self.core.model_limits)
            except InvalidRequest as exc:
                self.journal.reject(f"a completion of step {spec.step_id!r}", str(exc))
        logger.info("step %s resumed from the journal: %d completions already delivered", spec.step_id, len(kept))
        return kept

    def _cancel_orphan(self, step_id: str) -> None:
        step = self.core.step(step_id)
        if step is not None and step.active and not self.subscribers.get(step_id):
            logger.warning("step %s: no trainer attached for %.0fs, cancelling", step_id, self.orphan_grace_seconds)
            self.execute(self.core.cancel_step(step_id))

    async def update_policy(self, version: int | None, weights_path: str, field: str = "version") -> PolicyReady:
        """Wait for every live worker to load ``version`` (None: the next version, which the core
        numbers; ``field``: the caller's name for the version, which a refusal names); a retry
        with the same version and path joins the update in progress, or gets the answer of the
        one that succeeded. Raises ``InvalidRequest`` when it was refused or failed, naming each
        worker that did not load it."""
        actions = self.core.update_policy(version, weights_path, field)  # refused: raises, nothing changed
        target = version if version is not None else self.core.policy_loading
        if target is None:  # not taken, and no update in progress: the core broke its contract (core/policy.py)
            raise InvalidRequest(field, "the core opened no policy update for the next version", ErrorCode.INTERNAL)
        fut = asyncio.get_running_loop().create_future()
        self.barriers.append((target, fut))
        try:
            self.execute(actions)
            ready = await fut
            if self.journal is not None:  # answer once a restarted scheduler would know the version
                try:
                    await self.journal.flush()
                except TimeoutError:  # Redis slow: the update holds; only its resumability is at risk
                    logger.warning("policy version %d: journal write not confirmed within 5 s", target)
            return ready
        finally:
            if (target, fut) in self.barriers:  # the caller went away: the update goes on
                self.barriers.remove((target, fut))

    def announce(self, prompts: list[tuple[int, ...]], sampling: SamplingParams) -> int:
        return self.core.announce(prompts, sampling)

    def cancel(self, step_id: str) -> int:
        step = self.core.step(step_id)
        pending = 0 if step is None else step.pending
        self.execute(self.core.cancel_step(step_id))
        return pending

    async def pause(self, mode: str) -> bool:
        """vLLM's ``/pause`` (``core/pause.py``): new steps are refused from now on; ``abort``
        cancels the active steps, ``keep`` holds them, ``wait`` returns once every active step
        not held has ended. False when a ``/resume`` came first (the pause is over)."""
        self.execute(self.core.pause(mode))
        loop = asyncio.get_running_loop()
        while mode == PauseMode.WAIT and self.core.paused and self.core.pause_waiting():
            ended = loop.create_future()

            def wake(action: Action, ended: asyncio.Future = ended) -> None:
                if isinstance(action, (StepFinished, StepFailed, Deliver, RequestFailed)) and not ended.done():
                    ended.set_result(None)

            self.listeners.append(wake)
            self._resumed.append(ended)
            try:
                await ended
            finally:
                self.listeners.remove(wake)
                self._resumed.remove(ended)
        return self.core.paused

    def resume(self) -> None:
        """vLLM's ``/resume``: held steps run again (at the current policy version), new steps
        are taken. Idempotent."""
        self.execute(self.core.resume())
        for ended in self._resumed:  # a pause still waiting is over
            if not ended.done():
                ended.set_result(None)

    # ---------------------------------------------------------------- workers --

    def attach_worker(self, hello: WorkerHello, accepts_assign_batches: bool = False) -> WorkerLink:
        old = self.links.pop(hello.worker_id, None)
        if old is not None:  # a reconnect supersedes the old stream
            old.close()
            self.control.lost(hello.worker_id, "reconnected before answering (its stream was replaced)")
            self.execute(self.core.handle(WorkerLeft(hello.worker_id, "the worker reconnected while running it")))
        actions = self.core.handle(WorkerJoined(hello))
        link = WorkerLink(hello.worker_id, accepts_assign_batches=accepts_assign_batches)
        self.links[hello.worker_id] = link
        self.execute(actions)
        for hook in self.on_join:
            hook(link)
        logger.info("worker %s joined (capacity %d, version %d)", hello.worker_id, hello.capacity, hello.policy_version)
        return link

    def detach_worker(self, link: WorkerLink) -> None:
        if self.links.get(link.worker_id) is link:
            del self.links[link.worker_id]
            self.control.lost(link.worker_id, "its stream ended before it answered")
            self.execute(self.core.handle(WorkerLeft(link.worker_id, "the worker's stream ended while running it")))
            logger.info("worker %s left", link.worker_id)

    def on_worker_event(self, event: WorkerEvent) -> None:
        """One event of a worker's stream (``wire.feed`` makes them): the core decides whether
        it is taken; raises ``InvalidRequest`` for one that breaks the protocol."""
        self.execute(self.core.handle(event))

    async def tick_forever(self, period: float) -> None:
        """The core's tick every ``period`` seconds, told how long the event loop stalled since
        the last one (the time between them beyond ``period``): those seconds are not counted as
        the workers' silence (``core/silence.py``)."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            stalled = max(0.0, now - last - period)
            last = now
            self.loop_stalls.observe(stalled)
            try:
                self.execute(self.core.tick(stalled))
            except Exception:  # keep ticking whatever one tick did
                logger.exception("tick failed")

    async def drain(self, timeout: float) -> None:
        """Refuse new steps and wait (up to ``timeout``) for running ones to finish."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.core.any_step_active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for link in list(self.links.values()):
            link.close()


async def _items(queue: Pending) -> AsyncIterator[list[Completion] | StepSummary]:
    """A step subscriber's queue up to its end (``END``): the completions waiting at once as
    one list, in order; a summary as it is; a ``StepFailed`` raises."""
    while True:
        group: list[Completion] = []
        await queue.wait()
        for msg in queue.take():
            if isinstance(msg, Completion):
                group.append(msg)
                continue
            if group:  # the completions before it first, in their place
                yield group
                group = []
            if msg is END:
                return
            if isinstance(msg, StepFailed):
                raise _failed(msg)
            yield msg
        if group:
            yield group


def _failed(failure: StepFailed) -> InvalidRequest:
    """A failed step, as the trainer sees it: FAILED_PRECONDITION naming the prompt (the SDK
    raises ``PreconditionFailed``, a fatal error: the same step id returns the same failure);
    UNAVAILABLE naming ``workers`` where no worker was left (retryable: ``core/liveness.py``)."""
    return InvalidRequest(failure.field, failure.message, failure.code)
