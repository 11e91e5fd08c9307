"""Protobuf at the edge: worker messages in as core events, core actions out as worker
messages, a step's stream out as trainer responses.

``SchedulerService`` neither builds nor takes protobuf: the ``WorkerLink`` servicer hands each
worker message to ``feed`` (which turns it into ``core/events.py`` events for the service) and
turns what a worker's outbox holds into ``SchedulerMessage`` s with ``scheduler_messages``; the
``Rollout`` servicer turns what ``run_step`` yields into ``GenerateResponse`` s with
``generate_responses``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.types import Completion, SamplingParams, StepSummary
from bubblespec.scheduler.core.events import (
    Aborted,
    Completed,
    DraftResult,
    Heartbeat,
    PolicyLoaded,
    Progress,
    WorkerEvent,
    WorkerSeen,
)
from bubblespec.scheduler.core.pool import POOL
from bubblespec.scheduler.core.types import (
    Abort,
    Action,
    Assign,
    ControlCall,
    InvalidRequest,
    LoadPolicy,
    RequestSpec,
    StartDraft,
    StopDraft,
)

if TYPE_CHECKING:
    from bubblespec.scheduler.service import SchedulerService

__all__ = ["ASSIGN_BATCH_MAX", "BATCH_BYTES", "BATCH_MAX", "feed", "generate_responses", "scheduler_message",
           "scheduler_messages", "worker_event"]

logger = logging.getLogger(__name__)


def feed(service: SchedulerService, worker_id: str, msg: pb.WorkerMessage) -> None:
    """Hand one message of ``worker_id``'s stream to ``service``: a batch as one event per
    entry (a bad entry costs only itself, logged), a control call's answer to the control
    fan-out. Raises ``InvalidRequest`` for a bad single message."""
    kind = msg.WhichOneof("kind")
    if kind == "completions":
        for i, wc in enumerate(msg.completions.completions):
            try:
                service.on_worker_event(_completed(worker_id, wc))
            except InvalidRequest as exc:
                logger.warning("worker %s sent a bad message: completions[%d]: %s", worker_id, i, exc)
        return
    if kind == "progress_batch":
        for p in msg.progress_batch.progress:
            service.on_worker_event(Progress(worker_id, p.request_key, p.generated_tokens))
        return
    if kind == "control_result":
        service.on_worker_event(WorkerSeen(worker_id))
        service.control.answer(worker_id, msg.control_result)
        return
    service.on_worker_event(worker_event(worker_id, msg))


def worker_event(worker_id: str, msg: pb.WorkerMessage) -> WorkerEvent:
    """One (non-batch) worker message as a core event."""
    kind = msg.WhichOneof("kind")
    if kind == "heartbeat":
        return Heartbeat(worker_id, msg.heartbeat.tokens_per_second)
    if kind == "progress":
        return Progress(worker_id, msg.progress.request_key, msg.progress.generated_tokens)
    if kind == "completion":
        return _completed(worker_id, msg.completion)
    if kind == "aborted":
        a = msg.aborted
        partial = None
        if a.HasField("partial"):
            a.partial.worker_id = worker_id  # stamped, as a completion is
            partial = cv.completion_from_pb(a.partial)
        return Aborted(worker_id, a.request_key, a.reason, partial)
    if kind == "policy_loaded":
        m = msg.policy_loaded
        return PolicyLoaded(worker_id, m.version, m.ok, m.error, m.weights_unknown, m.seconds)
    if kind == "draft_result":
        r = msg.draft_result
        return DraftResult(worker_id, r.job_id, r.tokens, r.finished)
    raise InvalidRequest("kind", f"unexpected worker message {kind!r}")


def _completed(worker_id: str, wc: pb.WorkerCompletion) -> Completed:
    msg = wc.completion
    msg.worker_id = worker_id  # stamped here, whatever it claims: the core need not copy it
    c = cv.completion_from_pb(msg)
    if msg.finish_reason in _FINISH_KNOWN and not wc.request_key.startswith(_POOL_PREFIX):
        # (else the decoded one says STOP: encode that instead; an independent call's completion
        # goes to its HTTP caller only, never to the journal or a trainer's stream: nothing to keep)
        kept = pb.Completion()
        kept.CopyFrom(msg)  # a copy (a C copy, cheaper than encoding): a kept one never pins the whole worker message
        kept.DiscardUnknownFields()  # only what this scheduler knows goes on to the journal and trainer
        _keep(c, kept)  # the journal and the trainer's stream take the received encoding
    return Completed(worker_id, wc.request_key, c)


_POOL_PREFIX = POOL + "/"
_FINISH_KNOWN = frozenset(cv._FINISH_FROM_PB)
"""``pb.FinishReason`` values that decode to themselves (any other decodes as STOP)."""

_SAMPLING_MEMO_MAX = 64
_sampling_memo: dict[int, tuple[SamplingParams, pb.SamplingParams]] = {}


def _sampling_pb(sampling: SamplingParams) -> pb.SamplingParams:
    """``sampling`` as protobuf, built once per object: a step's requests share a few
    ``SamplingParams`` objects (one per sample index and token budget), so each assignment
    copies an encoded one instead of encoding it again."""
    hit = _sampling_memo.get(id(sampling))
    if hit is not None and hit[0] is sampling:
        return hit[1]
    msg = cv.sampling_to_pb(sampling)
    if len(_sampling_memo) >= _SAMPLING_MEMO_MAX:
        del _sampling_memo[next(iter(_sampling_memo))]
    _sampling_memo[id(sampling)] = (sampling, msg)  # the reference keeps the id from being reused
    return msg


COMPLETION_MEMO_MAX = 1024
"""Most delivered completions whose encoding waits for the trainer's stream (``completion_pb``):
far fewer than the kept steps' completions the core holds anyway."""
_completion_memo: dict[int, tuple[Completion, pb.Completion]] = {}


def completion_pb(c: Completion, keep: bool = False) -> pb.Completion:
    """``c`` as protobuf, encoded once per delivery: the journal encodes it with ``keep`` (the
    trainer's stream will want it next), the stream's first use takes the kept encoding
    (``generate_responses``). At most ``COMPLETION_MEMO_MAX`` wait, the oldest dropped first
    (encoded again if a stream asks for it later); never mutate what this returns."""
    hit = _completion_memo.get(id(c)) if keep else _completion_memo.pop(id(c), None)
    if hit is not None and hit[0] is c:
        return hit[1]
    msg = cv.completion_to_pb(c)
    if keep:
        _keep(c, msg)
    return msg


def _keep(c: Completion, msg: pb.Completion) -> None:
    """Keep ``msg`` as ``c``'s encoding for the next ``completion_pb`` (a copy of a received
    completion's message, when ``c`` was decoded from it: the core delivers that very object
    unless it had to change it, and a changed one is another object, encoded anew)."""
    if len(_completion_memo) >= COMPLETION_MEMO_MAX:
        del _completion_memo[next(iter(_completion_memo))]
    _completion_memo[id(c)] = (c, msg)  # the reference keeps the id from being reused


def scheduler_message(item: Action | ControlCall) -> pb.SchedulerMessage:
    """What a worker's outbox holds (an action for that worker, or a control call: core types
    only) as the message its stream carries."""
    match item:
        case ControlCall(_, call_id, op, arguments, policy_version):
            return pb.SchedulerMessage(control=pb.ControlCall(
                call_id=call_id, op=pb.ControlOp.Value(f"CONTROL_OP_{op.upper()}"), json=arguments,
                policy_version=policy_version))
        case Assign(_, req, predicted, resume):
            return pb.SchedulerMessage(assign=_assignment(req, predicted, resume=resume))
        case Abort(_, key, keep_partial):
            return pb.SchedulerMessage(abort=pb.Abort(request_key=key, keep_partial=keep_partial))
        case LoadPolicy(_, version, path):
            return pb.SchedulerMessage(load_policy=pb.LoadPolicy(version=version, weights_path=path))
        case StartDraft(_, job):
            return pb.SchedulerMessage(draft_job=pb.DraftJob(
                job_id=job.job_id, step_id=job.for_step, prompt_token_ids=list(job.prompt_token_ids),
                sampling=cv.sampling_to_pb(job.sampling), policy_version=job.policy_version))
        case StopDraft(_, job_id):
            return pb.SchedulerMessage(stop_draft=pb.StopDraft(job_id=job_id))
    raise TypeError(f"not a worker message: {item!r:.80}")


def _assignment(req: RequestSpec, predicted: float = 0.0, make: Callable[..., pb.Assignment] = pb.Assignment,
                resume: Completion | None = None) -> pb.Assignment:
    """``req`` as an ``Assignment`` built by ``make``: a new message, or a batch's ``add`` (built
    in place); ``resume``: the partial it goes on from (a moved request)."""
    msg = make(
        request_key=req.key, step_id=req.step_id, prompt_id=req.prompt_id,
        sample_index=req.sample_index, prompt_token_ids=req.prompt_token_ids,  # the tuple as it is: no list copy
        sampling=_sampling_pb(req.sampling), policy_version=req.policy_version,
        use_drafts=req.use_drafts, group_size=req.group_size, predicted_tokens=predicted)
    if resume is not None:
        msg.resume.CopyFrom(cv.completion_to_pb(resume))
    if req.adapter is not None:
        msg.adapter, msg.adapter_version = req.adapter
    return msg


def scheduler_messages(items: list, batch: bool, max_bytes: int = 0) -> Iterator[pb.SchedulerMessage]:
    """What a worker's outbox held at once, as its stream's messages, in order. With ``batch``
    (the worker's hello set ``accepts_assign_batches``) consecutive assignments go out as
    ``assigns`` batches of up to ``ASSIGN_BATCH_MAX`` assignments and ``max_bytes`` bytes
    (0 = ``BATCH_BYTES``; one alone, or one larger than that, as a single ``assign``); any other
    item ends a run of them, so an Abort never overtakes the Assign before it. Without
    ``batch``: one message per item."""
    cap = min(max_bytes or BATCH_BYTES, BATCH_BYTES)
    msg: pb.SchedulerMessage | None = None  # the batch being filled: each entry built in place, never copied
    size = count = 0
    for item in items:
        if not batch or not isinstance(item, Assign):
            if msg is not None:
                yield _assign_batch(msg, count)
                msg, size, count = None, 0, 0
            yield scheduler_message(item)
            continue
        if msg is None:
            msg = pb.SchedulerMessage()
            add = msg.assigns.assignments.add
        # an entry's tag and length prefix take at most 6 bytes
        n = _assignment(item.request, item.predicted_tokens, add, item.resume).ByteSize() + 6
        if count and (count >= ASSIGN_BATCH_MAX or size + n > cap - 16):
            del msg.assigns.assignments[-1]  # it opens the next batch
            yield _assign_batch(msg, count)
            msg, size, count = pb.SchedulerMessage(), 0, 0
            add = msg.assigns.assignments.add
            _assignment(item.request, item.predicted_tokens, add, item.resume)
        size += n
        count += 1
    if msg is not None:
        yield _assign_batch(msg, count)


def _assign_batch(msg: pb.SchedulerMessage, count: int) -> pb.SchedulerMessage:
    """A filled ``assigns`` batch of ``count`` entries; one alone goes as a single ``assign``."""
    return pb.SchedulerMessage(assign=msg.assigns.assignments[0]) if count == 1 else msg


BATCH_BYTES = 2**20
"""Most bytes of completions one ``CompletionBatch`` response carries (a single larger
completion goes alone): far under the gRPC message limits of both ends (64 MiB by default)."""
BATCH_MAX = 512
"""Most completions one ``CompletionBatch`` response carries."""
ASSIGN_BATCH_MAX = 512
"""Most assignments one ``AssignBatch`` message carries."""


def generate_responses(item: list[Completion] | StepSummary, batch: bool) -> Iterator[pb.GenerateResponse]:
    """One item of ``SchedulerService.run_step`` as trainer responses: a summary as one; the
    completions one ``completion`` response each, or with ``batch`` as ``CompletionBatch``
    responses of up to ``BATCH_MAX`` completions / ``BATCH_BYTES`` bytes, in order."""
    if isinstance(item, StepSummary):
        yield pb.GenerateResponse(summary=cv.summary_to_pb(item))
        return
    encoded = [completion_pb(c) for c in item]
    if not batch:
        yield from (pb.GenerateResponse(completion=c) for c in encoded)
        return
    group: list[pb.Completion] = []
    size = 0
    for c in encoded:
        n = c.ByteSize()
        if group and (len(group) >= BATCH_MAX or size + n > BATCH_BYTES):
            yield _completion_batch(group)
            group, size = [], 0
        group.append(c)
        size += n
    if group:
        yield _completion_batch(group)


def _completion_batch(group: list[pb.Completion]) -> pb.GenerateResponse:
    msg = pb.GenerateResponse()
    msg.completions.completions.extend(group)  # one copy of each, not one into a batch and one more into the response
    return msg
