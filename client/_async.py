"""asyncio client: the twin of ``RolloutClient``; I/O only, logic in ``_base``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client import _base
from bubblespec.client._base import ClientSettings, ProgressCallback, PromptLike, StepCollector
from bubblespec.client.errors import ServiceUnavailable
from bubblespec.common.types import Completion, SamplingParams, SchedulingPolicy, StepResult

__all__ = ["AsyncRolloutClient"]


class AsyncRolloutClient:
    """asyncio SDK with the same methods as ``RolloutClient``, as coroutines."""

    def __init__(self, target: str | None = None, *, settings: ClientSettings | None = None, **kwargs: Any):
        settings = settings or ClientSettings(**kwargs)
        self.settings = settings if target is None else ClientSettings(**{**settings.__dict__, "target": target})
        creds = self.settings.credentials()
        opts = self.settings.options()
        self._channel = (grpc.aio.secure_channel(self.settings.target, creds, opts) if creds
                         else grpc.aio.insecure_channel(self.settings.target, opts))
        self._stub = pbg.RolloutStub(self._channel)

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _unary(self, method: Callable[..., Any], request: Any, timeout: float) -> Any:
        delays = self.settings.retry.delays()
        while True:
            try:
                return await method(request, timeout=timeout, metadata=self.settings.metadata(), wait_for_ready=True)
            except grpc.RpcError as exc:
                err = _base.translate(exc)
                delay = next(delays, None) if _base.should_retry(err) else None
                if delay is None:
                    raise err from None
                await asyncio.sleep(delay)

    async def stream(self, step: str | int, prompts: Sequence[PromptLike], sampling: SamplingParams = SamplingParams(),
                     *, policy_version: int = 0, n: int | None = None, lookahead: Sequence[PromptLike] = (),
                     policy: SchedulingPolicy | None = None, drafts: bool = True, straggler_watch: bool = True,
                     on_progress: ProgressCallback | None = None,
                     _collector: StepCollector | None = None) -> AsyncIterator[Completion]:
        """Yield each completion of the step once, as it finishes (resuming across retries)."""
        request = _base.make_generate_request(step, policy_version, prompts, sampling, n, lookahead, policy,
                                              drafts, straggler_watch)
        request.batch_completions = True  # this SDK reads CompletionBatch responses (StepCollector.add_all)
        collector = _collector or StepCollector(request, on_progress)
        delays = self.settings.retry.delays()
        while not collector.done:
            before = len(collector.completions)
            try:
                call = self._stub.Generate(request, timeout=self.settings.step_timeout_seconds,
                                           metadata=self.settings.metadata(), wait_for_ready=True)
                async for msg in call:
                    for c in collector.add_all(msg):
                        yield c
                if not collector.done:
                    raise ServiceUnavailable("stream ended before the step finished")
            except (grpc.RpcError, ServiceUnavailable) as exc:
                err = _base.translate(exc) if isinstance(exc, grpc.RpcError) else exc
                if len(collector.completions) > before:  # progress: a fresh retry budget
                    delays = self.settings.retry.delays()
                delay = next(delays, None) if _base.should_retry(err) else None
                if delay is None:
                    raise err from None
                await asyncio.sleep(delay)

    async def generate(self, step: str | int, prompts: Sequence[PromptLike],
                       sampling: SamplingParams = SamplingParams(), *, progress: bool = False,
                       on_progress: ProgressCallback | None = None, **kwargs: Any) -> StepResult:
        """Run one rollout step; return every completion (prompt order, then sample index) and a summary."""
        _base.check_progress(progress, on_progress)
        request = _base.make_generate_request(step, kwargs.get("policy_version", 0), prompts, sampling,
                                              kwargs.get("n"))
        if progress and on_progress is None:
            on_progress = _base.progress_bar(len(request.prompts) * max(1, request.sampling.n))
        collector = StepCollector(request, on_progress)
        async for _ in self.stream(step, prompts, sampling, _collector=collector, **kwargs):
            pass
        return collector.result()

    async def complete(self, prompts: Sequence[PromptLike], sampling: SamplingParams = SamplingParams(), *,
                       n: int | None = None, drafts: bool = True, single_version: bool = False) -> list[Completion]:
        """Independent requests, not a step: the prompts' requests join the scheduler's pool of
        calls at its current policy version (no step id, no step cap; sibling and history drafts
        as for a step's samples) and each finishes on its own. Returns every completion, prompt
        order then sample index. Retried (``RetryableError``: a full pool, a lost scheduler)
        only while nothing was delivered: a call has no id to resume by. ``single_version``:
        after a keep pause across a policy update, run again from scratch rather than go on
        (``Completion.version_spans`` says the versions of a completion that went on)."""
        request = _base.make_complete_request(prompts, sampling, n, drafts, single_version)
        delays = self.settings.retry.delays()
        while True:
            collector = _base.CallCollector(request)
            try:
                call = self._stub.Complete(request, timeout=self.settings.step_timeout_seconds,
                                           metadata=self.settings.metadata(), wait_for_ready=True)
                async for msg in call:
                    collector.add(msg)
            except grpc.RpcError as exc:
                err = _base.translate(exc)
                delay = next(delays, None) if _base.should_retry(err) and not collector.completions else None
                if delay is None:
                    raise err from None
                await asyncio.sleep(delay)
                continue
            if not collector.done:
                raise ServiceUnavailable("the call's stream ended before every completion came")
            return collector.result()

    async def announce(self, prompts: Sequence[PromptLike], sampling: SamplingParams = SamplingParams()) -> int:
        req = _base.make_announce_request(prompts, sampling)
        return (await self._unary(self._stub.Announce, req, self.settings.timeout_seconds)).accepted

    async def update_policy(self, version: int, weights_path: str) -> int:
        req = _base.make_update_policy_request(version, weights_path)
        return (await self._unary(self._stub.UpdatePolicy, req, self.settings.step_timeout_seconds)).workers_loaded

    async def status(self) -> dict:
        resp = await self._unary(self._stub.Status, pb.StatusRequest(), self.settings.timeout_seconds)
        return json.loads(resp.json)

    async def cancel(self, step: str | int) -> int:
        req = _base.make_cancel_request(step)
        return (await self._unary(self._stub.Cancel, req, self.settings.timeout_seconds)).cancelled_requests
