"""Blocking client: I/O only; the logic is in ``_base``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client import _base
from bubblespec.client._base import ClientSettings, ProgressCallback, PromptLike, StepCollector
from bubblespec.client.errors import ServiceUnavailable
from bubblespec.common.types import Completion, SamplingParams, SchedulingPolicy, StepResult

__all__ = ["RolloutClient"]


class RolloutClient:
    """Synchronous SDK. ``RolloutClient("host:50051", token=...)`` or pass ``settings=``."""

    def __init__(self, target: str | None = None, *, settings: ClientSettings | None = None, **kwargs: Any):
        settings = settings or ClientSettings(**kwargs)
        self.settings = settings if target is None else ClientSettings(**{**settings.__dict__, "target": target})
        creds = self.settings.credentials()
        opts = self.settings.options()
        self._channel = (grpc.secure_channel(self.settings.target, creds, opts) if creds
                         else grpc.insecure_channel(self.settings.target, opts))
        self._stub = pbg.RolloutStub(self._channel)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _unary(self, method: Callable[..., Any], request: Any, timeout: float) -> Any:
        delays = self.settings.retry.delays()
        while True:
            try:
                return method(request, timeout=timeout, metadata=self.settings.metadata(), wait_for_ready=True)
            except grpc.RpcError as exc:
                err = _base.translate(exc)
                delay = next(delays, None) if _base.should_retry(err) else None
                if delay is None:
                    raise err from None
                time.sleep(delay)

    def stream(self, step: str | int, prompts: Sequence[PromptLike], sampling: SamplingParams = SamplingParams(), *,
               policy_version: int = 0, n: int | None = None, lookahead: Sequence[PromptLike] = (),
               policy: SchedulingPolicy | None = None, drafts: bool = True, straggler_watch: bool = True,
               on_progress: ProgressCallback | None = None, _collector: StepCollector | None = None) -> Iterator[Completion]:
        """Yield each completion of the step once, as it finishes (resuming across retries)."""
        request = _base.make_generate_request(step, policy_version, prompts, sampling, n, lookahead, policy,
                                              drafts, straggler_watch)
        request.batch_completions = True  # this SDK reads CompletionBatch responses (StepCollector.add_all)
        collector = _collector or StepCollector(request, on_progress)
        delays = self.settings.retry.delays()
        while not collector.done:
            before = len(collector.completions)
            try:
                for msg in self._stub.Generate(request, timeout=self.settings.step_timeout_seconds,
                                               metadata=self.settings.metadata(), wait_for_ready=True):
                    yield from collector.add_all(msg)
                if not collector.done:
                    raise ServiceUnavailable("stream ended before the step finished")
            except (grpc.RpcError, ServiceUnavailable) as exc:
                err = _base.translate(exc) if isinstance(exc, grpc.RpcError) else exc
                if len(collector.completions) > before:  # progress: a fresh retry budget
                    delays = self.settings.retry.delays()
                delay = next(delays, None) if _base.should_retry(err) else None
                if delay is None:
                    raise err from None
                time.sleep(delay)

    def generate(self, step: str | int, prompts: Sequence[PromptLike], sampling: SamplingParams = SamplingParams(), *,
                 progress: bool = False, on_progress: ProgressCallback | None = None,
                 **kwargs: Any) -> StepResult:
        """Run one rollout step; return every completion (prompt order, then sample index) and a summary."""
        _base.check_progress(progress, on_progress)
        request = _base.make_generate_request(step, kwargs.get("policy_version", 0), prompts, sampling,
                                              kwargs.get("n"))
        if progress and on_progress is None:
            on_progress = _base.progress_bar(len(request.prompts) * max(1, request.sampling.n))
        collector = StepCollector(request, on_progress)
        for _ in self.stream(step, prompts, sampling, _collector=collector, **kwargs):
            pass
        return collector.result()

    def complete(self, prompts: Sequence[PromptLike], sampling: SamplingParams = SamplingParams(), *,
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
                for msg in self._stub.Complete(request, timeout=self.settings.step_timeout_seconds,
                                               metadata=self.settings.metadata(), wait_for_ready=True):
                    collector.add(msg)
            except grpc.RpcError as exc:
                err = _base.translate(exc)
                delay = next(delays, None) if _base.should_retry(err) and not collector.completions else None
                if delay is None:
                    raise err from None
                time.sleep(delay)
                continue
            if not collector.done:
                raise ServiceUnavailable("the call's stream ended before every completion came")
            return collector.result()

    def announce(self, prompts: Sequence[PromptLike], sampling: SamplingParams = SamplingParams()) -> int:
        """Tell the scheduler about prompts of upcoming steps (draft targets)."""
        req = _base.make_announce_request(prompts, sampling)
        return self._unary(self._stub.Announce, req, self.settings.timeout_seconds).accepted

    def update_policy(self, version: int, weights_path: str) -> int:
        """Make every live worker load ``weights_path`` as ``version``; returns the worker count.

        Raises ``PreconditionFailed`` (``field`` ``weights_path``) when a worker could not load
        it, naming each such worker and its reason: the cluster then stays at its previous
        version, and the same version may be retried with a good path. Retries of this call
        (the SDK's own included) are safe: the same (version, path) joins the update in
        progress or gets the answer of the one that succeeded."""
        req = _base.make_update_policy_request(version, weights_path)
        return self._unary(self._stub.UpdatePolicy, req, self.settings.step_timeout_seconds).workers_loaded

    def status(self) -> dict:
        import json

        return json.loads(self._unary(self._stub.Status, pb.StatusRequest(), self.settings.timeout_seconds).json)

    def cancel(self, step: str | int) -> int:
        req = _base.make_cancel_request(step)
        return self._unary(self._stub.Cancel, req, self.settings.timeout_seconds).cancelled_requests
