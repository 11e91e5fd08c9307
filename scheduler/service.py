"""The asyncio shell around ``SchedulerCore``: it owns the worker links, the step
subscriptions and the policy barriers, feeds events to the core and executes its actions.

The gRPC servicers and the HTTP app call into this class; it never parses protobuf
except to build outgoing worker messages.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.client import _convert as cv
from bubblespec.client.types import Completion, SamplingParams
from bubblespec.scheduler.control import ControlCalls
from bubblespec.scheduler.core.checks import check_completion, check_replayed
from bubblespec.scheduler.core.state import SchedulerCore, request_key
from bubblespec.scheduler.core.transfer import WeightTransfer
from bubblespec.scheduler.core.types import (
    Abort, Action, Assign, Deliver, Disconnect, InvalidRequest, LoadPolicy, PolicyFailed, PolicyReady, StartDraft, StepFailed,
    StepFinished, StepSpec, StopDraft, WorkerHello,
)

__all__ = ["SchedulerService", "WorkerLink"]

logger = logging.getLogger(__name__)
_END = object()


@dataclass(eq=False)
class WorkerLink:
    """One connected worker: its outbound message queue."""

    worker_id: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)

    def send(self, msg: pb.SchedulerMessage | object) -> None:
        self.outbox.put_nowait(msg)

    def close(self) -> None:
        self.outbox.put_nowait(_END)


class SchedulerService:
    def __init__(self, core: SchedulerCore, tokenize: Callable[[str], tuple[int, ...]] | None = None,
                 journal=None, orphan_grace_seconds: float = 30.0):
        self.core = core
        self.tokenize = tokenize
        self.journal = journal  # StepJournal or None: what a restarted scheduler needs
        self.orphan_grace_seconds = orphan_grace_seconds
        self.links: dict[str, WorkerLink] = {}
        self.subscribers: dict[str, list[asyncio.Queue]] = {}
        self.barriers: list[tuple[int, asyncio.Future]] = []
        self.listeners: list[Callable[[Action], None]] = []  # metrics exporter, persistence
        self.load_listeners: list[Callable[[str, int, bool, float], None]] = []  # (worker, version, ok, seconds)
        self.draining = False
        self._resumed: list[asyncio.Future] = []  # pause(wait) calls in progress: a resume ends them
        self.control = ControlCalls(self._send)  # engine control calls fanned out to workers (control.py)
        self.transfer = WeightTransfer(core)  # vLLM's weight-transfer group (core/transfer.py)

    # --------------------------------------------------------------- actions --

    def execute(self, actions: list[Action]) -> None:
        for action in actions:
            for listener in self.listeners:
                listener(action)
            match action:
                case Assign(worker_id, req):
                    self._send(worker_id, pb.SchedulerMessage(assign=pb.Assignment(
                        request_key=req.key, step_id=req.step_id, prompt_id=req.prompt_id,
                        sample_index=req.sample_index, prompt_token_ids=list(req.prompt_token_ids),
                        sampling=cv.sampling_to_pb(req.sampling), policy_version=req.policy_version,
                        use_drafts=req.use_drafts, group_size=req.group_size)))
                case Abort(worker_id, key):
                    self._send(worker_id, pb.SchedulerMessage(abort=pb.Abort(request_key=key)))
                case LoadPolicy(worker_id, version, path):
                    self._send(worker_id, pb.SchedulerMessage(load_policy=pb.LoadPolicy(version=version, weights_path=path)))
                case StartDraft(worker_id, job):
                    self._send(worker_id, pb.SchedulerMessage(draft_job=pb.DraftJob(
                        job_id=job.job_id, step_id=job.for_step, prompt_token_ids=list(job.prompt_token_ids),
                        sampling=cv.sampling_to_pb(job.sampling), policy_version=job.policy_version)))
                case StopDraft(worker_id, job_id):
                    self._send(worker_id, pb.SchedulerMessage(stop_draft=pb.StopDraft(job_id=job_id)))
                case Disconnect(worker_id, reason):
                    link = self.links.pop(worker_id, None)
                    if link is not None:
                        logger.warning("worker %s disconnected: %s", worker_id, reason)
                        link.close()
                        self.control.lost(worker_id, f"disconnected before answering: {reason}")
                case Deliver(step_id, completion):
                    encoded = cv.completion_to_pb(completion)  # once, for the journal and every subscriber
                    if self.journal is not None:
                        key = request_key(step_id, completion.prompt_id, completion.sample_index)
                        self.journal.save_completion(key, completion, encoded.SerializeToString())
                    self._publish(step_id, encoded)
                case StepFinished(step_id, summary):
                    self._publish(step_id, pb.GenerateResponse(summary=cv.summary_to_pb(summary)))
                    self._publish(step_id, _END)
                    if self.journal is not None:  # delivered: keep it only briefly (retries right after)
                        self.journal.finish_step(step_id)
                    logger.info("step %s finished: %d completions in %.2fs", step_id, summary.completions,
                                summary.makespan_seconds)
                case StepFailed(step_id, field, message):
                    logger.error("step %s failed: %s: %s", step_id, field, message)
                    if self.journal is not None:  # a resume after a restart gets the same failure
                        self.journal.save_failure(step_id, field, message)
                        self.journal.finish_step(step_id)
                    self._publish(step_id, action)
                    self._publish(step_id, _END)
                case PolicyReady(version, workers):
                    if self.journal is not None:  # only a version every live worker loaded is kept
                        self.journal.save_policy(version, self.core.weights_path)
                    self._end_barrier(version, workers)
                case PolicyFailed(version, code, field_, message):
                    logger.error("policy update to version %d failed: %s: %s", version, field_, message)
                    self._end_barrier(version, InvalidRequest(field_, message, code))

    def _end_barrier(self, version: int, outcome: int | InvalidRequest) -> None:
        """Answer every ``UpdatePolicy`` call waiting for ``version``: a worker count or an error."""
        for v, fut in self.barriers:
            if v == version and not fut.done():
                if isinstance(outcome, InvalidRequest):
                    fut.set_exception(outcome)
                else:
                    fut.set_result(outcome)
        self.barriers = [(v, f) for v, f in self.barriers if not f.done()]

    def _send(self, worker_id: str, msg: pb.SchedulerMessage) -> bool:
        link = self.links.get(worker_id)
        if link is not None:
            link.send(msg)
        return link is not None

    def _publish(self, step_id: str, msg: object) -> None:
        for queue in self.subscribers.get(step_id, []):
            queue.put_nowait(msg)

    # ---------------------------------------------------------------- trainer --

    async def run_step(self, spec: StepSpec, batch: bool = False) -> AsyncIterator[pb.GenerateResponse]:
        """Submit (or resume) a step and stream its completions, then its summary. ``batch``: the
        completions waiting at once go out as one ``CompletionBatch`` response (``_responses``);
        else one ``completion`` response each."""
        if self.draining:
            raise InvalidRequest("step_id", "the scheduler is shutting down", "UNAVAILABLE")
        existing = self.core.check_step(spec)
        done = await self._journaled(spec) if existing is None else {}
        existing = self.core.check_step(spec)  # another call may have submitted it meanwhile
        queue: asyncio.Queue = asyncio.Queue()
        for c in done.values():  # delivered by an earlier scheduler: replay
            queue.put_nowait(cv.completion_to_pb(c))
        if existing is not None:  # resume: replay what is done, then follow
            for c in existing.completions.values():
                queue.put_nowait(cv.completion_to_pb(c))
            if existing.summary is not None:
                queue.put_nowait(pb.GenerateResponse(summary=cv.summary_to_pb(existing.summary)))
                queue.put_nowait(_END)
            elif existing.failure is not None:  # the same failure, not a re-run
                raise _failed(existing.failure)
            elif existing.cancelled:
                raise InvalidRequest("step_id", f"step {spec.step_id!r} was cancelled", "CANCELLED")
        self.subscribers.setdefault(spec.step_id, []).append(queue)
        try:
            if existing is None:
                if self.journal is not None:
                    self.journal.save_step(spec.step_id, spec.fingerprint)
                self.execute(self.core.submit_step(spec, done))
            async for msg in _responses(queue, batch):
                yield msg
            step = self.core.steps.get(spec.step_id)
            if step is not None and step.cancelled:
                raise InvalidRequest("step_id", f"step {spec.step_id!r} was cancelled", "CANCELLED")
        finally:
            subs = self.subscribers.get(spec.step_id, [])
            if queue in subs:
                subs.remove(queue)
            if not subs:
                self.subscribers.pop(spec.step_id, None)
                step = self.core.steps.get(spec.step_id)
                if step is not None and step.active:  # the trainer went away mid-step
                    asyncio.get_running_loop().call_later(self.orphan_grace_seconds, self._cancel_orphan, spec.step_id)

    async def _journaled(self, spec: StepSpec) -> dict:
        """Completions of this step that an earlier scheduler delivered (restart), if any."""
        if self.journal is None:
            return {}
        prior = await self.journal.load_step(spec.step_id)
        if prior is None:
            return {}
        fingerprint, done = prior
        if fingerprint != spec.fingerprint:
            raise InvalidRequest("step_id", f"step {spec.step_id!r} exists with different content", "ALREADY_EXISTS")
        failure = await self.journal.load_failure(spec.step_id)
        if failure is not None:  # an earlier scheduler ended it in failure: the same failure, not a re-run
            raise _failed(StepFailed(spec.step_id, *failure))
        kept = {}
        for key, c in done.items():  # authentic (MAC checked), but checked like a live completion too
            try:
                kept[key] = check_replayed(c, key, spec, self.core.limits)
            except InvalidRequest as exc:
                self.journal.reject(f"a completion of step {spec.step_id!r}", str(exc))
        logger.info("step %s resumed from the journal: %d completions already delivered", spec.step_id, len(kept))
        return kept

    def _cancel_orphan(self, step_id: str) -> None:
        step = self.core.steps.get(step_id)
        if step is not None and step.active and not self.subscribers.get(step_id):
            logger.warning("step %s: no trainer attached for %.0fs, cancelling", step_id, self.orphan_grace_seconds)
            self.execute(self.core.cancel_step(step_id))

    async def update_policy(self, version: int, weights_path: str) -> int:
        """Wait for every live worker to load ``version`` (a retry with the same version and
        path joins the update in progress, or gets the answer of the one that succeeded);
        raises ``InvalidRequest`` when it failed, naming each worker that did not load it."""
        fut = asyncio.get_running_loop().create_future()
        self.barriers.append((version, fut))
        try:
            self.execute(self.core.update_policy(version, weights_path))
            loaded = await fut
            if self.journal is not None:  # answer once a restarted scheduler would know the version
                try:
                    await self.journal.flush()
                except TimeoutError:  # Redis slow: the update holds; only its resumability is at risk
                    logger.warning("policy version %d: journal write not confirmed within 5 s", version)
            return loaded
        finally:
            if (version, fut) in self.barriers:  # refused, or the caller went away: the update goes on
                self.barriers.remove((version, fut))

    def announce(self, prompts: list[tuple[int, ...]], sampling: SamplingParams) -> int:
        return self.core.announce(prompts, sampling)

    def cancel(self, step_id: str) -> int:
        step = self.core.steps.get(step_id)
        pending = 0 if step is None else sum(1 for r in step.requests.values() if not r.done)
        self.execute(self.core.cancel_step(step_id))
        return pending

    async def pause(self, mode: str) -> bool:
        """vLLM's ``/pause`` (``core/pause.py``): new steps are refused from now on; ``abort``
        cancels the active steps, ``keep`` holds them, ``wait`` returns once every active step
        not held has ended. False when a ``/resume`` came first (the pause is over)."""
        self.execute(self.core.pauser.pause(mode))
        loop = asyncio.get_running_loop()
        while mode == "wait" and self.core.pauser.paused and self.core.pauser.waiting():
            ended = loop.create_future()

            def wake(action, ended=ended) -> None:
                if isinstance(action, (StepFinished, StepFailed)) and not ended.done():
                    ended.set_result(None)

            self.listeners.append(wake)
            self._resumed.append(ended)
            try:
                await ended
            finally:
                self.listeners.remove(wake)
                self._resumed.remove(ended)
        return self.core.pauser.paused

    def resume(self) -> None:
        """vLLM's ``/resume``: held steps run again (at the current policy version), new steps
        are taken. Idempotent."""
        self.execute(self.core.pauser.resume())
        for ended in self._resumed:  # a pause still waiting is over
            if not ended.done():
                ended.set_result(None)

    # ---------------------------------------------------------------- workers --

    def attach_worker(self, hello: WorkerHello) -> WorkerLink:
        old = self.links.pop(hello.worker_id, None)
        if old is not None:  # a reconnect supersedes the old stream
            old.close()
            self.control.lost(hello.worker_id, "reconnected before answering (its stream was replaced)")
            self.execute(self.core.remove_worker(hello.worker_id, "the worker reconnected while running it"))
        actions = self.core.add_worker(hello)
        link = WorkerLink(hello.worker_id)
        self.links[hello.worker_id] = link
        self.execute(actions)
        logger.info("worker %s joined (capacity %d, version %d)", hello.worker_id, hello.capacity, hello.policy_version)
        return link

    def detach_worker(self, link: WorkerLink) -> None:
        if self.links.get(link.worker_id) is link:
            del self.links[link.worker_id]
            self.control.lost(link.worker_id, "its stream ended before it answered")
            self.execute(self.core.remove_worker(link.worker_id, "the worker's stream ended while running it"))
            logger.info("worker %s left", link.worker_id)

    def on_worker_message(self, worker_id: str, msg: pb.WorkerMessage) -> None:
        core = self.core
        kind = msg.WhichOneof("kind")
        if kind == "heartbeat":
            tps = msg.heartbeat.tokens_per_second
            if not math.isfinite(tps) or tps < 0:
                raise InvalidRequest("heartbeat.tokens_per_second", f"must be a finite number >= 0, got {tps}")
            core.heartbeat(worker_id, tps)
            return
        core.touch(worker_id)
        if kind == "completions":  # a batch: each as its own completion message, in order
            for i, wc in enumerate(msg.completions.completions):
                try:
                    self._on_completion(worker_id, wc)
                except InvalidRequest as exc:  # one bad entry costs only itself
                    logger.warning("worker %s sent a bad message: completions[%d]: %s", worker_id, i, exc)
            return
        if kind == "progress_batch":  # each as its own progress message
            for p in msg.progress_batch.progress:
                if _holds(core, worker_id, p.request_key):
                    core.on_progress(worker_id, p.request_key, p.generated_tokens)
                else:
                    logger.info("worker %s: ignored progress: progress.request_key %.80r is not running on this worker",
                                worker_id, p.request_key)
            return
        if kind in ("progress", "completion", "aborted") and not _holds(core, worker_id, getattr(msg, kind).request_key):
            logger.info("worker %s: ignored %s: %s.request_key %.80r is not running on this worker",
                        worker_id, kind, kind, getattr(msg, kind).request_key)  # stale (moved, cancelled) or forged
            return
        if kind == "progress":
            core.on_progress(worker_id, msg.progress.request_key, msg.progress.generated_tokens)
        elif kind == "completion":
            self._on_completion(worker_id, msg.completion, held=True)
        elif kind == "aborted":
            self.execute(core.on_aborted(worker_id, msg.aborted.request_key, msg.aborted.reason))
        elif kind == "policy_loaded":
            m = msg.policy_loaded
            w = core.workers.get(worker_id)
            if w is None or w.loading != m.version:  # nobody asked: ignore (no state, no metrics)
                logger.warning("worker %s sent a bad message: policy_loaded.version: %d was not asked of it",
                               worker_id, m.version)
                return
            if not m.ok:
                logger.error("worker %s failed to load version %d: %s", worker_id, m.version, m.error)
            for listener in self.load_listeners:
                listener(worker_id, m.version, m.ok, m.seconds)
            self.execute(core.on_policy_loaded(worker_id, m.version, m.ok, m.error, m.weights_unknown))
        elif kind == "control_result":
            self.control.answer(worker_id, msg.control_result)
        elif kind == "draft_result":
            self.execute(core.on_draft_result(worker_id, msg.draft_result.job_id, msg.draft_result.tokens,
                                              msg.draft_result.finished))
        else:
            raise InvalidRequest("kind", f"unexpected worker message {kind!r}")

    def _on_completion(self, worker_id: str, wc: pb.WorkerCompletion, held: bool = False) -> None:
        """One completion from ``worker_id`` (``held``: ``_holds`` already checked)."""
        core = self.core
        if not held and not _holds(core, worker_id, wc.request_key):
            logger.info("worker %s: ignored completion: completion.request_key %.80r is not running on this worker",
                        worker_id, wc.request_key)  # stale (moved, cancelled) or forged
            return
        wc.completion.worker_id = worker_id  # stamped: the worker that sent it, whatever it claims
        c = _checked_completion(wc, core.limits)
        wanted = _requested_version(core, wc.request_key)
        if c.policy_version != wanted:  # made with other weights than asked: a failed attempt
            logger.error("worker %s: completion of %.80r is from policy version %d, the request asked for %d; "
                         "running it again", worker_id, wc.request_key, c.policy_version, wanted)
            self.execute(core.on_aborted(worker_id, wc.request_key,
                                         f"completion from policy version {c.policy_version}, not {wanted}"))
            return
        self.execute(core.on_completion(worker_id, wc.request_key, c))

    async def tick_forever(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                self.execute(self.core.tick())
            except Exception:  # keep ticking whatever one tick did
                logger.exception("tick failed")

    async def drain(self, timeout: float) -> None:
        """Refuse new steps and wait (up to ``timeout``) for running ones to finish."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while any(s.active for s in self.core.steps.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for link in list(self.links.values()):
            link.close()


BATCH_BYTES = 2**20
"""Most bytes of completions one ``CompletionBatch`` response carries (a single larger
completion goes alone): far under the gRPC message limits of both ends (64 MiB by default)."""
BATCH_MAX = 512
"""Most completions one ``CompletionBatch`` response carries."""


async def _responses(queue: asyncio.Queue, batch: bool) -> AsyncIterator[pb.GenerateResponse]:
    """A step subscriber's queue as trainer responses, up to its end (``_END``): completions
    (``pb.Completion``) one per response, or with ``batch`` every completion already waiting
    (up to ``BATCH_MAX`` / ``BATCH_BYTES``) in one ``CompletionBatch``, in order; summaries as
    they are; a ``StepFailed`` raises."""
    pending = None
    while True:
        msg = pending if pending is not None else await queue.get()
        pending = None
        if msg is _END:
            return
        if isinstance(msg, StepFailed):
            raise _failed(msg)
        if not isinstance(msg, pb.Completion):
            yield msg
        elif not batch:
            yield pb.GenerateResponse(completion=msg)
        else:
            group, size = [msg], msg.ByteSize()
            while not queue.empty() and len(group) < BATCH_MAX:
                nxt = queue.get_nowait()
                if not isinstance(nxt, pb.Completion) or size + nxt.ByteSize() > BATCH_BYTES:
                    pending = nxt  # handled next, in its place
                    break
                group.append(nxt)
                size += nxt.ByteSize()
            yield pb.GenerateResponse(completions=pb.CompletionBatch(completions=group))


def _failed(failure: StepFailed) -> InvalidRequest:
    """A failed step, as the trainer sees it: FAILED_PRECONDITION naming the prompt (the SDK
    raises ``PreconditionFailed``, a fatal error: the same step id returns the same failure)."""
    return InvalidRequest(failure.field, failure.message, "FAILED_PRECONDITION")


def _requested_version(core: SchedulerCore, key: str) -> int:
    """The policy version the request ``key`` (held by a worker: see ``_holds``) asked for."""
    return core.steps[key.split("/", 1)[0]].requests[key].spec.policy_version


def _holds(core: SchedulerCore, worker_id: str, key: str) -> bool:
    """Whether ``key`` is an unfinished request of an active step, running on ``worker_id``."""
    step = core.steps.get(key.split("/", 1)[0])
    req = step.requests.get(key) if step is not None else None
    return req is not None and step.active and not req.done and req.worker == worker_id


def _checked_completion(msg: pb.WorkerCompletion, limits) -> Completion:
    """A worker's completion, refused when it names another request or leaves the vocabulary
    (the same check a completion replayed from the journal passes: ``core.checks``)."""
    return check_completion(cv.completion_from_pb(msg.completion), msg.request_key, limits)
