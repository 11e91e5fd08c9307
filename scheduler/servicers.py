"""gRPC servicers: parse, call the service, map the result. Nothing else lives here.

``RolloutServicer`` serves the trainer's API (Generate, Complete, Announce, UpdatePolicy,
Status, Cancel); ``WorkerLinkServicer`` one bidirectional stream per worker, converting at the edge
(``wire.py``): worker messages in as core events, the worker's outbox out as messages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.common import codec as cv
from bubblespec.common.types import LOGPROBS_MODES, SamplingParams, SchedulingPolicy
from bubblespec.scheduler.core.types import ErrorCode, InvalidRequest, ModelLimits, WorkerHello
from bubblespec.scheduler.core.validate import (
    Limits,
    build_step,
    check_id,
    check_request_bytes,
    check_sampling,
    check_weights_path,
    prompt_tokens,
    worker_message_bound,
)
from bubblespec.scheduler.lora_models import lora_config_of
from bubblespec.scheduler.service import SchedulerService
from bubblespec.scheduler.status_view import StatusView
from bubblespec.scheduler.wire import feed, generate_responses, scheduler_messages

__all__ = ["RolloutServicer", "WorkerLinkServicer"]

logger = logging.getLogger(__name__)
MAX_TENSOR_PARALLEL = 4096
"""Largest ``hello.tensor_parallel_size`` accepted (ranks of one engine)."""


async def _abort(context: grpc.aio.ServicerContext, exc: InvalidRequest) -> None:
    await context.abort(grpc.StatusCode[exc.code], str(exc))


class RolloutServicer(pbg.RolloutServicer):
    """The trainer's gRPC API: validates each request into core types (``core/validate.py``),
    calls ``SchedulerService``, maps ``InvalidRequest`` to the gRPC status it names."""

    def __init__(self, service: SchedulerService, limits: Limits, default_policy: SchedulingPolicy,
                 status: StatusView | None = None,
                 default_logprobs_mode: str = "processed"):
        self.service = service
        self.limits = limits
        self.default_policy = default_policy
        if default_logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"default_logprobs_mode: must be one of {', '.join(LOGPROBS_MODES)}, "
                             f"got {default_logprobs_mode!r:.40}")
        self.default_logprobs_mode = default_logprobs_mode
        self.status = status or StatusView(service.core)  # shared with /status: one document serves both

    def _sampling(self, msg: pb.SamplingParams) -> SamplingParams:
        """A step's sampling, its logprobs mode defaulted (``SchedulerSettings.default_logprobs_mode``)."""
        sampling = cv.sampling_from_pb(msg)
        return replace(sampling, logprobs_mode=sampling.logprobs_mode or self.default_logprobs_mode)

    def _model(self) -> ModelLimits:
        limits = self.service.core.model_limits
        if limits is None:
            raise InvalidRequest("workers", "no worker has connected yet", ErrorCode.UNAVAILABLE)
        return limits

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        try:
            check_request_bytes(request.ByteSize(), self.limits.max_request_bytes)
            spec = build_step(
                step_id=request.step_id, policy_version=request.policy_version,
                prompts=[cv.prompt_from_pb(p) for p in request.prompts],
                sampling=self._sampling(request.sampling),
                lookahead=[cv.prompt_from_pb(p) for p in request.lookahead],
                policy=_policy(request.policy) or self.default_policy,
                use_drafts=not request.disable_drafts, straggler_watch=not request.disable_straggler_watch,
                limits=self.limits, model=self._model(), tokenize=self.service.tokenize,
            )
            async for item in self.service.run_step(spec):
                for msg in generate_responses(item, request.batch_completions):
                    yield msg
        except InvalidRequest as exc:
            await _abort(context, exc)

    async def Complete(self, request: pb.CompleteRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        try:
            check_request_bytes(request.ByteSize(), self.limits.max_request_bytes)
            spec = build_step(
                step_id="call", policy_version=self.service.core.policy_version,
                prompts=[cv.prompt_from_pb(p) for p in request.prompts], sampling=self._sampling(request.sampling),
                use_drafts=not request.disable_drafts, limits=self.limits, model=self._model(),
                tokenize=self.service.tokenize, resumable=False)
            n = spec.sampling.n
            async for index, c in self.service.run_requests(spec, request.single_version):
                mine = replace(c, step_id="", prompt_id=spec.prompts[index // n].prompt_id, sample_index=index % n)
                yield pb.GenerateResponse(completion=cv.completion_to_pb(mine))
        except InvalidRequest as exc:
            await _abort(context, exc)

    async def Announce(self, request: pb.AnnounceRequest, context: Any) -> Any:
        try:
            check_request_bytes(request.ByteSize(), self.limits.max_announce_bytes)
            model = self._model()
            sampling = cv.sampling_from_pb(request.sampling)
            check_sampling(sampling, self.limits, model)
            if len(request.prompts) > self.limits.max_lookahead:
                raise InvalidRequest("prompts", f"at most {self.limits.max_lookahead} prompts")
            ids = [prompt_tokens(cv.prompt_from_pb(p), f"prompts[{i}]", model, self.service.tokenize, self.limits)
                   for i, p in enumerate(request.prompts)]
            return pb.AnnounceResponse(accepted=self.service.announce(ids, sampling))
        except InvalidRequest as exc:
            await _abort(context, exc)

    async def UpdatePolicy(self, request: pb.UpdatePolicyRequest, context: Any) -> Any:
        try:
            check_weights_path(request.weights_path, self.limits)
            ready = await self.service.update_policy(request.version, request.weights_path)
            return pb.UpdatePolicyResponse(version=ready.version, workers_loaded=ready.workers)
        except InvalidRequest as exc:
            await _abort(context, exc)

    async def Status(self, request: pb.StatusRequest, context: Any) -> Any:
        doc = await self.status.document(current=True)
        snap = doc.view
        workers = [pb.WorkerStatus(worker_id=w["worker_id"], state=w["state"], policy_version=w["policy_version"],
                                   running=w["running"], capacity=w["capacity"],
                                   tokens_per_second=w["tokens_per_second"]) for w in snap["workers"]]
        steps = [cv.summary_to_pb(s.summary) for s in self.service.core.stats().steps if s.summary is not None]
        return pb.StatusResponse(policy_version=snap["policy_version"], workers=workers, steps=steps,
                                 requests_waiting=snap["requests_waiting"], requests_running=snap["requests_running"],
                                 json=doc.body.decode())

    async def Cancel(self, request: pb.CancelRequest, context: Any) -> Any:
        try:
            return pb.CancelResponse(cancelled_requests=self.service.cancel(request.step_id))
        except InvalidRequest as exc:
            await _abort(context, exc)


class WorkerLinkServicer(pbg.WorkerLinkServicer):
    """``Connect``: the worker's hello joins it (``attach_worker``); then its messages are fed
    to the service (``wire.feed``) while its outbox streams back, until either side ends."""

    def __init__(self, service: SchedulerService, limits: Limits = Limits(), max_message_bytes: int = 64 * 2**20):
        self.service = service
        self.limits = limits
        self.max_message_bytes = max_message_bytes  # the scheduler's gRPC send limit

    async def Connect(self, request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        first = await anext(aiter(request_iterator), None)
        self.service.worker_messages.received += first is not None  # the hello, joined or refused
        try:
            if first is None or first.WhichOneof("kind") != "hello":
                raise InvalidRequest("hello", "the first worker message must be hello")
            h = first.hello
            check_id(h.worker_id, "hello.worker_id")
            self._check_message_bound(h.max_model_len)
            if not 0 <= h.tensor_parallel_size <= MAX_TENSOR_PARALLEL:
                raise InvalidRequest("hello.tensor_parallel_size", f"must be in [0, {MAX_TENSOR_PARALLEL}] (0 = 1), "
                                     f"got {h.tensor_parallel_size}")
            lora_config = lora_config_of(h.lora_config)
            link = self.service.attach_worker(WorkerHello(
                h.worker_id, h.capacity, h.policy_version, ModelLimits(h.max_model_len, h.vocab_size), h.speculation,
                h.logprobs_mode or "processed", model=h.model, tensor_parallel_size=max(1, h.tensor_parallel_size),
                accepts_resume=h.accepts_resume, dtype=h.dtype[:40]),
                accepts_assign_batches=h.accepts_assign_batches)
            link.lora_config = lora_config
        except InvalidRequest as exc:
            await _abort(context, exc)
            return
        reader = asyncio.create_task(self._read(link.worker_id, request_iterator, link))
        counts = self.service.worker_messages
        try:
            ended = False
            while not ended:  # what the outbox holds at once goes out together (assignment batches)
                items, ended = link.drain(await link.outbox.get())
                for msg in scheduler_messages(items, link.accepts_assign_batches, self.max_message_bytes):
                    counts.sent += 1
                    yield msg
        finally:
            reader.cancel()
            self.service.detach_worker(link)

    def _check_message_bound(self, max_model_len: int) -> None:
        """Refuse a worker whose model length would let a valid request make an assignment
        larger than the scheduler may send: the send would break the worker's stream."""
        bound = worker_message_bound(self.limits, max_model_len)
        if bound > self.max_message_bytes:
            raise InvalidRequest("hello.max_model_len", f"assignments for {max_model_len} tokens may take {bound} bytes, "
                                 f"over the scheduler's max_message_bytes {self.max_message_bytes}",
                                 ErrorCode.FAILED_PRECONDITION)

    async def _read(self, worker_id: str, request_iterator: AsyncIterator[Any], link: Any) -> None:
        counts = self.service.worker_messages
        try:
            async for msg in request_iterator:
                counts.received += 1
                try:
                    feed(self.service, worker_id, msg)
                except InvalidRequest as exc:
                    logger.warning("worker %s sent a bad message: %s", worker_id, exc)
        except (grpc.RpcError, grpc.aio.AbortError, asyncio.CancelledError):
            pass  # AbortError: undecodable bytes, already answered INVALID_ARGUMENT (auth.py)
        finally:
            link.close()


def _policy(value: int) -> SchedulingPolicy | None:
    try:
        return cv.policy_from_pb(value)
    except ValueError as exc:
        raise InvalidRequest("policy", str(exc)) from None
