"""Everything the two clients share, with no I/O: request building, retries, de-duplication.

``RolloutClient`` and ``AsyncRolloutClient`` only move bytes; the decisions live here so that
one test suite covers both.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import grpc

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.client import _check as ck
from bubblespec.client.errors import BubbleSpecError, RetryableError, ServerError, error_from_status
from bubblespec.common import codec as cv
from bubblespec.common.transport import keepalive_options
from bubblespec.common.types import Completion, Prompt, SamplingParams, SchedulingPolicy, StepResult, StepSummary

__all__ = ["ClientSettings", "PromptLike", "Retry", "StepCollector", "make_announce_request",
           "make_cancel_request", "make_generate_request", "make_update_policy_request", "to_prompts"]

PromptLike = str | Sequence[int] | Prompt
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class Retry:
    """Capped exponential backoff with jitter for retryable errors (same idempotency key each time).

    The budget is time, not a count: the SDK keeps retrying for ``budget_seconds`` after the
    first failure of an unbroken run of failures, long enough to ride out a scheduler restart
    (the new process starts, workers re-dial it, the step resumes from the journal). A stream
    that delivers a new completion starts a fresh budget. ``attempts`` optionally caps the count.
    """

    attempts: int = 0
    """Tries in all, the first included (0 = no cap: ``budget_seconds`` alone decides)."""
    initial_seconds: float = 0.2
    """Delay before the second try."""
    max_seconds: float = 2.0
    """Longest delay between tries."""
    multiplier: float = 2.0
    """Growth of the delay per try."""
    budget_seconds: float = 120.0
    """How long to keep retrying, counted from the first failure (0 = no time limit)."""

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.initial_seconds < 0 or self.max_seconds < 0 or self.budget_seconds < 0:
            raise ValueError(f"Retry fields must be >= 0: {self}")
        if self.attempts == 0 and self.budget_seconds == 0:
            raise ValueError("Retry needs a bound: attempts > 0 or budget_seconds > 0")

    def delays(self, clock: Callable[[], float] = time.monotonic) -> Iterator[float]:
        """Sleep times between tries; ends when the budget is spent. The clock starts at the first ``next``."""
        start = clock()
        delay = self.initial_seconds
        tries = 1
        while self.attempts == 0 or tries < self.attempts:
            left = self.budget_seconds - (clock() - start) if self.budget_seconds else math.inf
            if left <= 0:
                return
            yield min(left, delay * (0.5 + random.random() / 2))
            tries += 1
            delay = min(self.max_seconds, delay * self.multiplier)


@dataclass(frozen=True)
class ClientSettings:
    """How a client reaches the scheduler."""

    target: str = "localhost:50051"
    """Scheduler address, host:port."""
    token: str = field(default="", repr=False)
    """Trainer bearer token (sent as ``authorization: Bearer ...``)."""
    tls: bool = False
    """Use TLS."""
    root_certificates: bytes | None = field(default=None, repr=False)
    """PEM roots to verify the scheduler (None = system roots)."""
    client_certificate: bytes | None = field(default=None, repr=False)
    """PEM certificate chain for mutual TLS."""
    client_key: bytes | None = field(default=None, repr=False)
    """PEM private key for mutual TLS."""
    timeout_seconds: float = 30.0
    """Deadline of unary calls (status, announce, cancel)."""
    step_timeout_seconds: float = 3600.0
    """Deadline of one generate call or policy update."""
    retry: Retry = Retry()
    """Retry policy for retryable errors: by default 120 s of capped backoff (see ``Retry``)."""
    max_message_bytes: int = 64 * 2**20
    """Largest message sent or received."""
    keepalive_seconds: float = 5.0
    """Ping the scheduler after this long without traffic, during calls and between them (0 = off)."""
    keepalive_timeout_seconds: float = 5.0
    """A ping unanswered this long closes the connection: running calls fail UNAVAILABLE and are
    retried, so a frozen or unreachable scheduler is noticed in keepalive + timeout seconds."""
    reconnect_max_seconds: float = 2.0
    """Longest gap between the channel's reconnection attempts while the scheduler is down
    (gRPC's own default is 120 s, which would leave a restarted scheduler unused for minutes)."""

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(self.root_certificates, self.client_key, self.client_certificate)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def options(self) -> list[tuple[str, int]]:
        return [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
                *keepalive_options(self.keepalive_seconds, self.keepalive_timeout_seconds, self.reconnect_max_seconds)]


def to_prompts(prompts: Sequence[PromptLike], field: str = "prompts") -> list[Prompt]:
    """Text, token-id lists or ``Prompt`` objects; unnamed prompts get ids ``p0, p1, ...``.
    ``InvalidArgument`` naming ``field[i]...`` for anything else (a list of lists included)."""
    return ck.check_prompts(prompts, field)


def make_generate_request(
    step: str | int,
    policy_version: int,
    prompts: Sequence[PromptLike],
    sampling: SamplingParams,
    n: int | None = None,
    lookahead: Sequence[PromptLike] = (),
    policy: SchedulingPolicy | None = None,
    drafts: bool = True,
    straggler_watch: bool = True,
) -> pb.GenerateRequest:
    """The Generate request; ``InvalidArgument`` naming the field for a malformed argument."""
    step_id = ck.check_step(step)
    ck.check_version(policy_version, "policy_version")
    ck.check_sampling(sampling, n)
    policy = ck.check_policy(policy)
    ck.check_bool(drafts, "drafts")
    ck.check_bool(straggler_watch, "straggler_watch")
    if n is not None:
        sampling = replace(sampling, n=n)
    return pb.GenerateRequest(
        step_id=step_id, policy_version=policy_version,
        prompts=[cv.prompt_to_pb(p) for p in to_prompts(prompts)],
        sampling=cv.sampling_to_pb(sampling),
        lookahead=[cv.prompt_to_pb(p) for p in to_prompts(lookahead, "lookahead")],
        policy=cv.policy_to_pb(policy), disable_drafts=not drafts,
        disable_straggler_watch=not straggler_watch,
    )


def make_complete_request(prompts: Sequence[PromptLike], sampling: SamplingParams, n: int | None = None,
                          drafts: bool = True, single_version: bool = False) -> pb.CompleteRequest:
    """The Complete request (independent requests, no step); ``InvalidArgument`` naming the field."""
    ck.check_sampling(sampling, n)
    ck.check_bool(drafts, "drafts")
    ck.check_bool(single_version, "single_version")
    if n is not None:
        sampling = replace(sampling, n=n)
    return pb.CompleteRequest(prompts=[cv.prompt_to_pb(p) for p in to_prompts(prompts)],
                              sampling=cv.sampling_to_pb(sampling), disable_drafts=not drafts,
                              single_version=single_version)


class CallCollector:
    """One ``complete`` call's completions: each (prompt, sample) once, in prompt order."""

    def __init__(self, request: pb.CompleteRequest):
        self.order = {p.prompt_id: i for i, p in enumerate(request.prompts)}
        self.total = len(request.prompts) * max(1, request.sampling.n)
        self.completions: dict[tuple[str, int], Completion] = {}

    def add(self, msg: pb.GenerateResponse) -> Completion:
        c = cv.completion_from_pb(msg.completion)
        key = (c.prompt_id, c.sample_index)
        if key in self.completions or c.prompt_id not in self.order:
            raise ServerError(f"completion: the scheduler sent {key} twice or for no prompt of the call")
        self.completions[key] = c
        return c

    @property
    def done(self) -> bool:
        return len(self.completions) >= self.total

    def result(self) -> list[Completion]:
        return sorted(self.completions.values(), key=lambda c: (self.order[c.prompt_id], c.sample_index))


def make_announce_request(prompts: Sequence[PromptLike], sampling: SamplingParams) -> pb.AnnounceRequest:
    ck.check_sampling(sampling)
    return pb.AnnounceRequest(prompts=[cv.prompt_to_pb(p) for p in to_prompts(prompts)],
                              sampling=cv.sampling_to_pb(sampling))


def make_update_policy_request(version: int, weights_path: str | os.PathLike[str]) -> pb.UpdatePolicyRequest:
    path = os.fspath(weights_path) if isinstance(weights_path, os.PathLike) else weights_path
    return pb.UpdatePolicyRequest(version=ck.check_version(version, "version"),
                                  weights_path=ck.check_str(path, "weights_path"))


def make_cancel_request(step: str | int) -> pb.CancelRequest:
    return pb.CancelRequest(step_id=ck.check_step(step))


def check_progress(progress: object, on_progress: object) -> None:
    ck.check_bool(progress, "progress")
    ck.check_callable(on_progress, "on_progress")


class StepCollector:
    """Gathers one step's completions exactly once across retries and resumes."""

    def __init__(self, request: pb.GenerateRequest, on_progress: ProgressCallback | None = None):
        self.order = {p.prompt_id: i for i, p in enumerate(request.prompts)}
        self.total = len(request.prompts) * max(1, request.sampling.n)
        self.completions: dict[tuple[str, int], Completion] = {}
        self.summary: StepSummary | None = None
        self.on_progress = on_progress

    def add_all(self, msg: pb.GenerateResponse) -> list[Completion]:
        """Record one stream message (a completion, a ``CompletionBatch`` or the summary);
        return its completions that are new, in order."""
        event = msg.WhichOneof("event")
        if event == "completions":
            return [c for c in map(self._add, msg.completions.completions) if c is not None]
        if event == "completion":
            c = self._add(msg.completion)
            return [] if c is None else [c]
        self.add(msg)
        return []

    def add(self, msg: pb.GenerateResponse) -> Completion | None:
        """Record one stream message; return the completion if it is new (the first new one of
        a ``CompletionBatch``: ``add_all`` returns them all)."""
        if msg.WhichOneof("event") == "summary":
            self.summary = cv.summary_from_pb(msg.summary)
            return None
        if msg.WhichOneof("event") == "completions":
            return next(iter(self.add_all(msg)), None)
        return self._add(msg.completion)

    def _add(self, completion: pb.Completion) -> Completion | None:
        c = cv.completion_from_pb(completion)
        key = (c.prompt_id, c.sample_index)
        if key in self.completions:
            return None
        self.completions[key] = c
        if self.on_progress is not None:
            self.on_progress(len(self.completions), self.total)
        return c

    @property
    def done(self) -> bool:
        return self.summary is not None and len(self.completions) >= self.total

    def result(self) -> StepResult:
        assert self.summary is not None
        ordered = sorted(self.completions.values(), key=lambda c: (self.order.get(c.prompt_id, 0), c.sample_index))
        return StepResult(tuple(ordered), self.summary)


def translate(exc: grpc.RpcError) -> BubbleSpecError:
    return error_from_status(exc.code(), exc.details())  # raised RpcErrors are grpc.Call objects too


def should_retry(err: BubbleSpecError) -> bool:
    """Retryable errors, except a message over a size limit: the same request would fail the same way."""
    return isinstance(err, RetryableError) and "message larger than max" not in err.message


def progress_bar(total: int) -> ProgressCallback:
    """A tqdm bar as a progress callback (``pip install 'bubblespec[progress]'``)."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="completion")

    def update(done: int, _total: int) -> None:
        bar.update(done - bar.n)
        if done >= _total:
            bar.close()

    return update
