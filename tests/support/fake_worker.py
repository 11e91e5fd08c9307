"""A scripted worker on the real ``WorkerLink`` gRPC stream: no model, no vLLM.

It dials a scheduler, says hello (capacity, ``max_model_len=512``, ``vocab_size=128`` by
default), heartbeats, answers ``LoadPolicy`` and ``DraftJob`` at once, and either answers every
``Assignment`` with a well-formed completion (``auto=True``) or holds it until the test calls
``complete`` (or sends whatever malformed message it likes with ``send``)::

    async with FakeWorker(f"127.0.0.1:{scheduler.grpc_port}", "fw-0") as fw:
        await wait_until(lambda: "fw-0" in scheduler.core.workers)
        result = await client.generate("s1", [(5, 6, 7)], SamplingParams(temperature=0, max_tokens=4))

Completions are deterministic: ``min(max_tokens, 4)`` tokens derived from the prompt, so a
test can tell which worker's answer reached the trainer. ``fail``: a function of the
assignment that returns a reason to answer it with ``Aborted`` instead (None: run it).

``ControlCall`` (weight transfer, prefix-cache reset) is recorded in ``controls`` and answered
at once: ``control`` is a function of the call that returns None (ok; ``reset_prefix_cache``
answers ``{"success": true}``), a dict (ok, that JSON result), a string (failed, that error)
or ``FakeWorker.HOLD`` (no answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

import grpc

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg

__all__ = ["FakeWorker", "fake_tokens", "wait_until"]

_DEFAULT = object()
_HOLD = object()


def fake_tokens(prompt: tuple[int, ...] | list[int], max_tokens: int, vocab_size: int = 128) -> tuple[int, ...]:
    """The tokens a fake worker 'generates' for a prompt: deterministic, inside the vocabulary."""
    base = sum(prompt)
    return tuple((base + i) % vocab_size for i in range(min(max_tokens, 4)))


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` every 10 ms until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


class FakeWorker:
    HOLD = _HOLD
    """What ``control`` returns to leave a call unanswered."""

    def __init__(
        self,
        target: str,
        worker_id: str = "fake-0",
        *,
        capacity: int = 4,
        policy_version: int = 0,
        max_model_len: int = 512,
        vocab_size: int = 128,
        speculation: bool = False,
        token: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        auto: bool = True,
        first: pb.WorkerMessage | None | object = _DEFAULT,
        heartbeat_seconds: float = 0.5,
        fail: Callable[[pb.Assignment], str | None] | None = None,
        tensor_parallel_size: int = 0,
        control: Callable[[pb.ControlCall], dict | str | object | None] | None = None,
        assign_batches: bool = False,
    ):
        """``first``: the opening message (default: a proper hello; None: send nothing and
        half-close at once, an empty stream). ``assign_batches``: the hello says it reads
        ``assigns`` batches (each entry is handled as a single ``assign``)."""
        self.target = target
        self.worker_id = worker_id
        self.vocab_size = vocab_size
        self.version = policy_version
        self.token = token
        self.credentials = credentials
        self.auto = auto
        self.heartbeat_seconds = heartbeat_seconds
        self.fail = fail
        self.failed: list[str] = []  # request keys answered with Aborted
        self.control = control
        self.controls: list[pb.ControlCall] = []  # every control call received, in order
        hello = pb.Hello(worker_id=worker_id, capacity=capacity, policy_version=policy_version,
                         max_model_len=max_model_len, vocab_size=vocab_size, model="fake", speculation=speculation,
                         tensor_parallel_size=tensor_parallel_size, accepts_assign_batches=assign_batches)
        self.first = pb.WorkerMessage(hello=hello) if first is _DEFAULT else first
        self.assignments: dict[str, pb.Assignment] = {}  # held: assigned and not yet answered
        self.answered: list[str] = []
        self.received: list[pb.SchedulerMessage] = []
        self.error: grpc.RpcError | None = None
        self.ended = asyncio.Event()
        self._outbox: asyncio.Queue[pb.WorkerMessage | None] = asyncio.Queue()
        self._channel: grpc.aio.Channel | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------ lifecycle --

    async def start(self) -> FakeWorker:
        self._channel = (grpc.aio.secure_channel(self.target, self.credentials) if self.credentials
                         else grpc.aio.insecure_channel(self.target))
        if self.first is None:
            self._outbox.put_nowait(None)
        else:
            self._outbox.put_nowait(self.first)  # type: ignore[arg-type]
        metadata = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        call = pbg.WorkerLinkStub(self._channel).Connect(self._outgoing(), metadata=metadata)
        self._tasks.append(asyncio.create_task(self._read(call)))
        if self.first is not None and self.heartbeat_seconds > 0:
            self._tasks.append(asyncio.create_task(self._heartbeats()))
        return self

    async def stop(self) -> None:
        self._outbox.put_nowait(None)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> FakeWorker:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def closed(self, timeout: float = 10.0) -> grpc.RpcError | None:
        """Wait for the scheduler to end the stream; return its error (None for a clean end)."""
        await asyncio.wait_for(self.ended.wait(), timeout)
        return self.error

    # -------------------------------------------------------------- sending --

    def send(self, msg: pb.WorkerMessage | None = None, **kind) -> None:
        """Send any message, well-formed or not: ``send(progress=pb.Progress(...))``."""
        self._outbox.put_nowait(msg if msg is not None else pb.WorkerMessage(**kind))

    def completion(self, a: pb.Assignment, **overrides) -> pb.WorkerMessage:
        """A well-formed completion of assignment ``a``; ``overrides`` replace Completion fields
        (``request_key=`` replaces the envelope's key)."""
        key = overrides.pop("request_key", a.request_key)
        tokens = fake_tokens(a.prompt_token_ids, a.sampling.max_tokens, self.vocab_size)
        fields = dict(step_id=a.step_id, prompt_id=a.prompt_id, sample_index=a.sample_index,
                      token_ids=list(tokens), logprobs=[-0.5] * len(tokens), text="",
                      finish_reason=pb.FINISH_REASON_LENGTH if len(tokens) == a.sampling.max_tokens
                      else pb.FINISH_REASON_STOP,
                      policy_version=a.policy_version, worker_id=self.worker_id,
                      provenance=pb.Provenance(forward_passes=len(tokens)),
                      prompt_tokens=len(a.prompt_token_ids))
        fields.update(overrides)
        return pb.WorkerMessage(completion=pb.WorkerCompletion(request_key=key, completion=pb.Completion(**fields)))

    def complete(self, key: str | None = None, **overrides) -> None:
        """Answer a held assignment (the oldest when ``key`` is None) with a completion."""
        key = key if key is not None else next(iter(self.assignments))
        a = self.assignments.pop(key)
        self.answered.append(key)
        self.send(self.completion(a, **overrides))

    def complete_all(self) -> None:
        for key in list(self.assignments):
            self.complete(key)

    def progress(self, key: str, tokens: int) -> None:
        self.send(progress=pb.Progress(request_key=key, generated_tokens=tokens))

    # ------------------------------------------------------------- internals --

    async def _outgoing(self):
        while (msg := await self._outbox.get()) is not None:
            yield msg

    async def _heartbeats(self) -> None:
        while True:
            self.send(heartbeat=pb.Heartbeat(running=len(self.assignments), tokens_per_second=0.0))
            await asyncio.sleep(self.heartbeat_seconds)

    async def _read(self, call) -> None:
        try:
            async for msg in call:
                self.received.append(msg)
                self._handle(msg)
        except grpc.RpcError as exc:
            self.error = exc
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                call.cancel()
            raise
        finally:
            self.ended.set()

    def _handle(self, msg: pb.SchedulerMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "assign":
            self._assign(msg.assign)
        elif kind == "assigns":
            for a in msg.assigns.assignments:
                self._assign(a)
        elif kind == "abort":
            self.assignments.pop(msg.abort.request_key, None)
        elif kind == "load_policy":
            self.version = msg.load_policy.version
            self.send(policy_loaded=pb.PolicyLoaded(version=msg.load_policy.version, ok=True, seconds=0.01))
        elif kind == "draft_job":
            self.send(draft_result=pb.DraftResult(job_id=msg.draft_job.job_id, tokens=0, finished=True))
        elif kind == "control":
            self._control(msg.control)

    def _assign(self, a: pb.Assignment) -> None:
        reason = self.fail(a) if self.fail is not None else None
        if reason is not None:
            self.failed.append(a.request_key)
            self.send(aborted=pb.Aborted(request_key=a.request_key, reason=reason))
            return
        self.assignments[a.request_key] = a
        if self.auto:
            self.complete(a.request_key)

    def _control(self, call: pb.ControlCall) -> None:
        self.controls.append(call)
        outcome = self.control(call) if self.control is not None else None
        if outcome is _HOLD:
            return
        if isinstance(outcome, str):
            self.send(control_result=pb.ControlResult(call_id=call.call_id, ok=False, error=outcome))
            return
        if outcome is None:
            outcome = {"success": True} if call.op == pb.CONTROL_OP_RESET_PREFIX_CACHE else {}
        if call.op == pb.CONTROL_OP_FINISH_WEIGHT_UPDATE:
            self.version = call.policy_version
        self.send(control_result=pb.ControlResult(call_id=call.call_id, ok=True, json=json.dumps(outcome)))
