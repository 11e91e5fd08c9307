"""Everything the two clients share, with no I/O: request building, retries, de-duplication.

``RolloutClient`` and ``AsyncRolloutClient`` only move bytes; the decisions live here so that
one test suite covers both.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import grpc

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.client import _convert as cv
from bubblespec.client.errors import BubbleSpecError, RetryableError, error_from_status
from bubblespec.client.types import Completion, Prompt, SamplingParams, SchedulingPolicy, StepResult, StepSummary

__all__ = ["ClientSettings", "PromptLike", "Retry", "StepCollector", "make_generate_request", "to_prompts"]

PromptLike = str | Sequence[int] | Prompt
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class Retry:
    """Exponential backoff with jitter for retryable errors (same idempotency key each time)."""

    attempts: int = 5
    """Tries in all, the first included."""
    initial_seconds: float = 0.2
    """Delay before the second try."""
    max_seconds: float = 5.0
    """Longest delay between tries."""
    multiplier: float = 2.0
    """Growth of the delay per try."""

    def delays(self) -> Iterator[float]:
        delay = self.initial_seconds
        for _ in range(self.attempts - 1):
            yield delay * (0.5 + random.random() / 2)
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
    """Retry policy for retryable errors."""
    max_message_bytes: int = 64 * 2**20
    """Largest message sent or received."""

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(self.root_certificates, self.client_key, self.client_certificate)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def options(self) -> list[tuple[str, int]]:
        return [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes)]


def to_prompts(prompts: Sequence[PromptLike]) -> list[Prompt]:
    """Text, token-id lists or ``Prompt`` objects; unnamed prompts get ids ``p0, p1, ...``."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, Prompt):
            out.append(p)
        elif isinstance(p, str):
            out.append(Prompt(f"p{i}", text=p))
        else:
            out.append(Prompt(f"p{i}", token_ids=tuple(int(t) for t in p)))
    return out


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
    if n is not None:
        sampling = replace(sampling, n=n)
    return pb.GenerateRequest(
        step_id=str(step), policy_version=policy_version,
        prompts=[cv.prompt_to_pb(p) for p in to_prompts(prompts)],
        sampling=cv.sampling_to_pb(sampling),
        lookahead=[cv.prompt_to_pb(p) for p in to_prompts(lookahead)],
        policy=cv.policy_to_pb(policy), disable_drafts=not drafts,
        disable_straggler_watch=not straggler_watch,
    )


class StepCollector:
    """Gathers one step's completions exactly once across retries and resumes."""

    def __init__(self, request: pb.GenerateRequest, on_progress: ProgressCallback | None = None):
        self.order = {p.prompt_id: i for i, p in enumerate(request.prompts)}
        self.total = len(request.prompts) * max(1, request.sampling.n)
        self.completions: dict[tuple[str, int], Completion] = {}
        self.summary: StepSummary | None = None
        self.on_progress = on_progress

    def add(self, msg: pb.GenerateResponse) -> Completion | None:
        """Record one stream message; return the completion if it is new."""
        if msg.WhichOneof("event") == "summary":
            self.summary = cv.summary_from_pb(msg.summary)
            return None
        c = cv.completion_from_pb(msg.completion)
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
    return error_from_status(exc.code(), exc.details())  # type: ignore[attr-defined]


def should_retry(err: BubbleSpecError) -> bool:
    return isinstance(err, RetryableError)


def progress_bar(total: int) -> ProgressCallback:
    """A tqdm bar as a progress callback (``pip install 'bubblespec[progress]'``)."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="completion")

    def update(done: int, _total: int) -> None:
        bar.update(done - bar.n)
        if done >= _total:
            bar.close()

    return update
