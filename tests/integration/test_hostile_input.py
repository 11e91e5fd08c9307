"""Malformed and hostile input: a real scheduler (gRPC on loopback), scripted workers that speak
the real WorkerLink stream (``tests/support/fake_worker.py``), a real redis-server. No vLLM.

Every row of ``TABLE`` is one test id. Trainer-side rows must be refused with a gRPC status
whose details start with the field they name, and leave the scheduler's core state (steps,
completions, requests, workers, policy version, announced prompts) and the delivery metrics
exactly as they were. Worker-side junk sent on an established stream is ignored (logged where
it is malformed, not merely stale) without any state change, and the step it targets still
completes with the rightful worker's answers. Corrupt Redis entries are skipped and counted.

Rows (id: what is sent -> expected answer):

  via SDK (AsyncRolloutClient) and raw gRPC, Rollout API
    raw-garbage-generate        bytes that are no protobuf -> INVALID_ARGUMENT request
    raw-bad-utf8-step-id        step_id bytes not UTF-8 -> INVALID_ARGUMENT request
    raw-truncated-message       length prefix past the end -> INVALID_ARGUMENT request
    raw-corrupt-nested-prompt   prompts[0] is garbage -> INVALID_ARGUMENT request
    raw-garbage-update-policy   garbage to a unary method -> INVALID_ARGUMENT request
    raw-garbage-announce        garbage to a unary method -> INVALID_ARGUMENT request
    raw-empty-generate          GenerateRequest() with every field unset -> INVALID_ARGUMENT step_id
    raw-unknown-method          /bubblespec.v1.Rollout/Nope -> UNIMPLEMENTED
    step-id-dotdot              "../etc" -> INVALID_ARGUMENT step_id
    step-id-slash               "a/b" (would forge request keys) -> INVALID_ARGUMENT step_id
    step-id-emoji               "step-🔥" -> INVALID_ARGUMENT step_id
    step-id-10kb                10 kB id -> INVALID_ARGUMENT step_id
    step-id-nul                 "a\\x00b" -> INVALID_ARGUMENT step_id
    prompt-id-dotdot            "../p" -> INVALID_ARGUMENT prompts[0].prompt_id
    prompt-id-slash             "p/0" -> INVALID_ARGUMENT prompts[0].prompt_id
    prompt-id-emoji             "🙂" -> INVALID_ARGUMENT prompts[0].prompt_id
    prompt-id-10kb              10 kB id -> INVALID_ARGUMENT prompts[0].prompt_id
    prompt-id-duplicate         two prompts "a" -> INVALID_ARGUMENT prompts[1].prompt_id
    temperature-nan             NaN -> INVALID_ARGUMENT sampling.temperature
    temperature-inf             +inf -> INVALID_ARGUMENT sampling.temperature
    temperature-neg-inf         -inf -> INVALID_ARGUMENT sampling.temperature
    top-p-nan                   NaN -> INVALID_ARGUMENT sampling.top_p
    top-p-inf                   +inf -> INVALID_ARGUMENT sampling.top_p
    top-p-negative              -0.5 -> INVALID_ARGUMENT sampling.top_p
    top-k-negative              -7 -> INVALID_ARGUMENT sampling.top_k
    max-tokens-int32-max        2**31-1 -> INVALID_ARGUMENT sampling.max_tokens
    max-tokens-negative         -1 -> INVALID_ARGUMENT sampling.max_tokens
    n-int32-max                 2**31-1 -> INVALID_ARGUMENT sampling.n
    n-negative                  -3 -> INVALID_ARGUMENT sampling.n
    min-tokens-over-max-tokens  10**6 -> INVALID_ARGUMENT sampling.min_tokens (seeds: any int64 is valid)
    logprobs-over-max           21 alternatives per token -> INVALID_ARGUMENT sampling.logprobs
    logprobs-mode-unknown       "logits" -> INVALID_ARGUMENT sampling.logprobs_mode
    logprobs-mode-not-served    "raw", every worker returns processed -> FAILED_PRECONDITION
                                sampling.logprobs_mode
    stop-empty-string           stop=("",) -> INVALID_ARGUMENT sampling.stop
    stop-string-5mib            a 5 MiB stop string (once broke every worker's stream: its
                                assignment exceeded gRPC's 4 MiB receive limit) -> INVALID_ARGUMENT
                                sampling.stop[0]
    stop-string-multibyte       300 emoji = 1,200 UTF-8 bytes (limit 1,024) -> INVALID_ARGUMENT
                                sampling.stop[1]
    stop-token-ids-2000         2,000 stop token ids -> INVALID_ARGUMENT sampling.stop_token_ids
    prompt-text-over-1mib       a 1 MiB + 1 byte text prompt -> INVALID_ARGUMENT prompts[0].text
    request-over-8mib           five 1.9 MiB text prompts, a 9.5 MB request (limit 8 MiB) -> INVALID_ARGUMENT
                                request
    announce-over-8mib          Announce of five 1.9 MiB text prompts -> INVALID_ARGUMENT request
    update-policy-path-6kb      weights_path of 6,000 bytes -> INVALID_ARGUMENT weights_path
    stop-token-outside-vocab    stop_token_ids=(10**6,) -> INVALID_ARGUMENT sampling.stop_token_ids[0]
    token-id-int32-max          2**31-1 -> INVALID_ARGUMENT prompts[0].token_ids[0]
    token-id-negative           -1 -> INVALID_ARGUMENT prompts[0].token_ids[1]
    prompt-without-content      neither text nor token_ids -> INVALID_ARGUMENT prompts[0]
    prompt-empty-token-list     token_ids=[] -> INVALID_ARGUMENT prompts[0]
    prompt-text-no-tokenizer    text on a scheduler without tokenizer -> INVALID_ARGUMENT prompts[0].text
    prompt-too-long             600 tokens, model length 512 -> INVALID_ARGUMENT prompts[0]
    prompt-max-tokens-negative  per-prompt max_tokens=-5 -> INVALID_ARGUMENT prompts[0].max_tokens
    prompt-max-tokens-overflow  per-prompt max_tokens=2**31-1 -> INVALID_ARGUMENT prompts[0].max_tokens
    policy-enum-unknown         policy=99 -> INVALID_ARGUMENT policy
    policy-version-int64-max    2**63-1 -> FAILED_PRECONDITION policy_version
    lookahead-bad-token         lookahead[0] = (5, -1) -> INVALID_ARGUMENT lookahead[0].token_ids[1]
    sdk-token-id-not-an-int     Prompt(token_ids=("5",)) -> InvalidArgument prompts[0].token_ids[0] in the SDK, nothing sent
    announce-nan-temperature    Announce with NaN -> INVALID_ARGUMENT sampling.temperature
    announce-bad-token          Announce (5, 128), vocab 128 -> INVALID_ARGUMENT prompts[0].token_ids[1]
    update-policy-stale         version -1 over a plain stub (the SDK refuses it) -> FAILED_PRECONDITION version
    update-policy-no-path       version 1, weights_path "" -> INVALID_ARGUMENT weights_path
    cancel-unknown-path-id      Cancel("../x") -> NOT_FOUND step_id

  worker stream refused at hello (the stream ends with the status; no worker is added)
    worker-empty-stream         no message at all -> INVALID_ARGUMENT hello
    worker-first-heartbeat      heartbeat before hello -> INVALID_ARGUMENT hello
    worker-first-completion     completion before hello -> INVALID_ARGUMENT hello
    worker-first-garbage        undecodable bytes -> INVALID_ARGUMENT request
    hello-empty-id              worker_id "" -> INVALID_ARGUMENT hello.worker_id
    hello-path-id               worker_id "../w/1" -> INVALID_ARGUMENT hello.worker_id
    hello-10kb-emoji-id         worker_id "🔥" * 2500 -> INVALID_ARGUMENT hello.worker_id
    hello-capacity-zero         capacity 0 -> INVALID_ARGUMENT hello.capacity
    hello-capacity-negative     capacity -4 -> INVALID_ARGUMENT hello.capacity
    hello-unknown-logprobs-mode logprobs_mode "logits" -> INVALID_ARGUMENT hello.logprobs_mode
    hello-other-model-len       max_model_len 1024 (cluster: 512) -> FAILED_PRECONDITION hello
    hello-other-vocab           vocab_size 50000 (cluster: 128) -> FAILED_PRECONDITION hello
    hello-unknown-version       policy_version 5, no weights to send -> FAILED_PRECONDITION
                                hello.policy_version
    worker-garbage-after-hello  hello, then undecodable bytes -> INVALID_ARGUMENT request, worker removed

  worker junk on an established stream, mid-step (ignored; no state change)
    completion-before-assignment    fresh worker completes a key it never got
    completion-unknown-step         completion for "no-such-step/p0/0"
    completion-path-key             request_key "../../etc/passwd"
    forged-completion               worker A completes worker B's request
    duplicate-completion            A completes its request twice (second differs)
    completion-wrong-version        policy_version 99 -> not delivered, request re-queued and re-run
    completion-identity-mismatch    envelope key is A's request, body names B's prompt
    completion-token-outside-vocab  token 128 with vocab_size 128
    completion-negative-token       token -1
    progress-unknown-key            progress for a key nobody holds
    progress-other-workers-key      A reports progress of B's request
    aborted-other-workers-key       A says B's request was aborted (would re-queue it)
    policy-loaded-never-asked       PolicyLoaded(version 77, ok) nobody asked for
    policy-load-failed-never-asked  PolicyLoaded(version 78, ok=False) nobody asked for
    draft-result-unknown-job        DraftResult for a job never started
    second-hello                    hello again mid-stream
    empty-worker-message            WorkerMessage() with no kind
    heartbeat-nan-throughput        tokens_per_second NaN
    heartbeat-negative-throughput   tokens_per_second -5

  Redis (draft store) corrupted behind the service's back (skipped, counted, callers unaffected)
    redis-garbage-draft         random bytes under the draft key
    redis-truncated-draft       a valid entry cut short
    redis-bad-magic-draft       a valid entry with its magic overwritten
    redis-garbage-length        "NaN" in the length list
    redis-wrong-type            a string where the draft list should be
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import grpc
import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client import AsyncRolloutClient, BubbleSpecError, Prompt, Retry, SamplingParams
from bubblespec.client._base import make_generate_request
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.validate import Limits
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from tests.support.fake_worker import FakeWorker, fake_tokens, wait_until

VOCAB, MODEL_LEN = 128, 512
LIMITS = Limits(max_prompts=8, max_samples=4, max_lookahead=8, max_stop_strings=4,
                max_request_bytes=8 * 2**20, max_announce_bytes=8 * 2**20)
HUGE_TEXTS = [Prompt(f"p{i}", text="z" * (19 * 2**20 // 10)) for i in range(5)]
OK_SAMPLING = SamplingParams(temperature=0.0, max_tokens=4)
OK_PROMPT = (5, 6, 7)
BIG = "x" * 10_000
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


# ----------------------------------------------------------------- environment --


@dataclass
class Env:
    scheduler: Scheduler
    target: str
    client: AsyncRolloutClient
    channel: grpc.aio.Channel
    a: FakeWorker  # holds one request of each held step
    b: FakeWorker  # holds the other
    fresh: FakeWorker  # joined, never assigned anything
    beats: int = 0

    @property
    def core(self):
        return self.scheduler.core

    @property
    def stub(self) -> pbg.RolloutStub:
        return pbg.RolloutStub(self.channel)

    async def sync(self, worker: FakeWorker) -> None:
        """Wait until the scheduler has handled everything ``worker`` sent so far: messages of
        one stream are handled in order, so a heartbeat with a unique rate is a barrier."""
        self.beats += 1
        rate = float(self.beats)
        worker.send(heartbeat=pb.Heartbeat(tokens_per_second=rate))
        await wait_until(lambda: self.core.workers[worker.worker_id].tokens_per_second == rate,
                         what=f"{worker.worker_id} to be heard")


def core_state(scheduler: Scheduler) -> dict:
    """Everything a hostile message must not change (worker liveness times and rates aside).
    Weight-load metrics are left out: see ``test_unasked_policy_loaded_is_not_a_weight_load``."""
    core, tally = scheduler.core, scheduler.metrics.tally
    return {
        "version": core.version,
        "weights_path": core.weights_path,
        "limits": core.limits,
        "announced": len(core.planner.upcoming),
        "workers": {wid: (w.version, w.loading, w.load_failed, tuple(sorted(w.running)), tuple(w.private),
                          tuple(w.drafts), w.capacity, math.isfinite(w.tokens_per_second) and w.tokens_per_second >= 0)
                    for wid, w in core.workers.items()},
        "steps": {sid: (s.active, s.cancelled, s.requeued, s.moved, tuple(s.shared),
                        {k: (r.worker, r.done, r.progress) for k, r in s.requests.items()},
                        {k: (c.token_ids, c.worker_id) for k, c in s.completions.items()})
                  for sid, s in core.steps.items()},
        "completions": sum(len(s.completions) for s in core.steps.values()),
        "delivered": tally.completions,
    }


@pytest.fixture(scope="module")
async def env():
    settings = SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1, limits=LIMITS, drain_seconds=1.0,
                                 core=CoreSettings(worker_timeout_seconds=3600, stall_seconds=3600, drafting=False))
    scheduler = Scheduler(settings)
    await scheduler.start()
    target = f"127.0.0.1:{scheduler.grpc_port}"
    workers = [FakeWorker(target, wid, capacity=cap, auto=False, heartbeat_seconds=0)
               for wid, cap in (("fw-a", 4), ("fw-b", 4), ("fw-fresh", 1))]
    for w in workers:  # in order: the core fills workers in join order
        await w.start()
        await wait_until(lambda w=w: w.worker_id in scheduler.core.workers, what=f"{w.worker_id} to join")
    client = AsyncRolloutClient(target, retry=Retry(attempts=1), timeout_seconds=10)
    channel = grpc.aio.insecure_channel(target)
    yield Env(scheduler, target, client, channel, *workers)
    await client.close()
    await channel.close()
    for w in workers:
        await w.stop()
    await scheduler.stop(1.0)


# ------------------------------------------------------------------------ rows --

Act = Callable[..., Awaitable[object]]


@dataclass(frozen=True)
class Row:
    id: str
    via: str  # sdk | raw | hello | junk | redis
    act: Act
    code: grpc.StatusCode | type[Exception] | None = None  # None: ignored (junk) / absorbed (redis)
    field: str = ""  # the field the status names; for junk, the text the warning names ("" = no log)
    marks: tuple = ()


def generate(**override) -> Act:
    """Generate through the SDK with one field spoiled."""
    async def act(env: Env):
        kw = dict(prompts=[OK_PROMPT], sampling=OK_SAMPLING, policy_version=env.core.version)
        kw.update(override)
        return await env.client.generate(kw.pop("step", "hostile"), kw.pop("prompts"), kw.pop("sampling"), **kw)
    return act


def sampling(**fields) -> Act:
    return generate(sampling=replace(OK_SAMPLING, **fields))


def prompts(*ps) -> Act:
    return generate(prompts=list(ps))


def raw(request_or_mutator) -> Act:
    """Generate over a plain stub: a request, or a function that spoils a valid one."""
    async def act(env: Env):
        if callable(request_or_mutator):
            req = make_generate_request("hostile", env.core.version, [OK_PROMPT], OK_SAMPLING)
            request_or_mutator(req)
        else:
            req = request_or_mutator
        return [m async for m in env.stub.Generate(req, timeout=10)]
    return act


def raw_update_policy(version: int, weights_path: str) -> Act:
    """UpdatePolicy over a plain stub (the SDK refuses a negative version before sending it)."""
    async def act(env: Env):
        return await env.stub.UpdatePolicy(pb.UpdatePolicyRequest(version=version, weights_path=weights_path),
                                           timeout=10)
    return act


def raw_bytes(method: str, data: bytes, streaming: bool = False) -> Act:
    """Bytes sent as they are (identity serializers) to a Rollout method."""
    async def act(env: Env):
        if streaming:
            return [m async for m in env.channel.unary_stream(method)(data, timeout=10)]
        return await env.channel.unary_unary(method)(data, timeout=10)
    return act


def sdk(call: Callable[[AsyncRolloutClient, Env], Awaitable[object]]) -> Act:
    async def act(env: Env):
        return await call(env.client, env)
    return act


GEN = "/bubblespec.v1.Rollout/Generate"
TRAINER_ROWS = [
    Row("raw-garbage-generate", "raw", raw_bytes(GEN, b"\xff\xff\xff\xff", streaming=True), INVALID, "request"),
    Row("raw-bad-utf8-step-id", "raw", raw_bytes(GEN, b"\x0a\x02\xff\xfe", streaming=True), INVALID, "request"),
    Row("raw-truncated-message", "raw", raw_bytes(GEN, b"\x0a\x40ab", streaming=True), INVALID, "request"),
    Row("raw-corrupt-nested-prompt", "raw", raw_bytes(GEN, b"\x0a\x01s\x1a\x03\xff\xff\xff", streaming=True),
        INVALID, "request"),
    Row("raw-garbage-update-policy", "raw", raw_bytes("/bubblespec.v1.Rollout/UpdatePolicy", b"\x08\xff"),
        INVALID, "request"),
    Row("raw-garbage-announce", "raw", raw_bytes("/bubblespec.v1.Rollout/Announce", b"\x0a\x05\x0a"),
        INVALID, "request"),
    Row("raw-empty-generate", "raw", raw(pb.GenerateRequest()), INVALID, "step_id"),
    Row("raw-unknown-method", "raw", raw_bytes("/bubblespec.v1.Rollout/Nope", b""), grpc.StatusCode.UNIMPLEMENTED),
    Row("step-id-dotdot", "sdk", generate(step="../etc"), INVALID, "step_id"),
    Row("step-id-slash", "sdk", generate(step="a/b"), INVALID, "step_id"),
    Row("step-id-emoji", "sdk", generate(step="step-\N{FIRE}"), INVALID, "step_id"),
    Row("step-id-10kb", "sdk", generate(step=BIG), INVALID, "step_id"),
    Row("step-id-nul", "sdk", generate(step="a\x00b"), INVALID, "step_id"),
    Row("prompt-id-dotdot", "sdk", prompts(Prompt("../p", token_ids=OK_PROMPT)), INVALID, "prompts[0].prompt_id"),
    Row("prompt-id-slash", "sdk", prompts(Prompt("p/0", token_ids=OK_PROMPT)), INVALID, "prompts[0].prompt_id"),
    Row("prompt-id-emoji", "sdk", prompts(Prompt("\N{SLIGHTLY SMILING FACE}", token_ids=OK_PROMPT)),
        INVALID, "prompts[0].prompt_id"),
    Row("prompt-id-10kb", "sdk", prompts(Prompt(BIG, token_ids=OK_PROMPT)), INVALID, "prompts[0].prompt_id"),
    Row("prompt-id-duplicate", "sdk", prompts(Prompt("a", token_ids=OK_PROMPT), Prompt("a", token_ids=(9,))),
        INVALID, "prompts[1].prompt_id"),
    Row("temperature-nan", "sdk", sampling(temperature=math.nan), INVALID, "sampling.temperature"),
    Row("temperature-inf", "sdk", sampling(temperature=math.inf), INVALID, "sampling.temperature"),
    Row("temperature-neg-inf", "sdk", sampling(temperature=-math.inf), INVALID, "sampling.temperature"),
    Row("top-p-nan", "sdk", sampling(top_p=math.nan), INVALID, "sampling.top_p"),
    Row("top-p-inf", "sdk", sampling(top_p=math.inf), INVALID, "sampling.top_p"),
    Row("top-p-negative", "sdk", sampling(top_p=-0.5), INVALID, "sampling.top_p"),
    Row("top-k-negative", "sdk", sampling(top_k=-7), INVALID, "sampling.top_k"),
    Row("max-tokens-int32-max", "sdk", sampling(max_tokens=2**31 - 1), INVALID, "sampling.max_tokens"),
    Row("max-tokens-negative", "sdk", sampling(max_tokens=-1), INVALID, "sampling.max_tokens"),
    Row("n-int32-max", "sdk", sampling(n=2**31 - 1), INVALID, "sampling.n"),
    Row("n-negative", "sdk", sampling(n=-3), INVALID, "sampling.n"),
    Row("min-tokens-over-max-tokens", "sdk", sampling(min_tokens=10**6), INVALID, "sampling.min_tokens"),
    Row("logprobs-over-max", "sdk", sampling(logprobs=21), INVALID, "sampling.logprobs"),
    Row("logprobs-mode-unknown", "sdk", sampling(logprobs_mode="logits"), INVALID, "sampling.logprobs_mode"),
    Row("logprobs-mode-not-served", "sdk", sampling(logprobs_mode="raw"), PRECONDITION, "sampling.logprobs_mode"),
    Row("stop-empty-string", "sdk", sampling(stop=("",)), INVALID, "sampling.stop"),
    Row("stop-string-5mib", "sdk", sampling(stop=("x" * (5 * 2**20),)), INVALID, "sampling.stop[0]"),
    Row("stop-string-multibyte", "sdk", sampling(stop=("ok", "\N{FIRE}" * 300)), INVALID, "sampling.stop[1]"),
    Row("stop-token-ids-2000", "sdk", sampling(stop_token_ids=(5,) * 2000), INVALID, "sampling.stop_token_ids"),
    Row("prompt-text-over-1mib", "sdk", prompts("y" * (2**20 + 1)), INVALID, "prompts[0].text"),
    Row("request-over-8mib", "sdk", generate(prompts=HUGE_TEXTS), INVALID, "request"),
    Row("announce-over-8mib", "sdk", sdk(lambda c, e: c.announce(HUGE_TEXTS, OK_SAMPLING)), INVALID, "request"),
    Row("update-policy-path-6kb", "sdk", sdk(lambda c, e: c.update_policy(e.core.version + 1, "/w" * 3000)),
        INVALID, "weights_path"),
    Row("stop-token-outside-vocab", "sdk", sampling(stop_token_ids=(10**6,)), INVALID, "sampling.stop_token_ids[0]"),
    Row("token-id-int32-max", "sdk", prompts((2**31 - 1, 5)), INVALID, "prompts[0].token_ids[0]"),
    Row("token-id-negative", "sdk", prompts((5, -1)), INVALID, "prompts[0].token_ids[1]"),
    Row("prompt-without-content", "raw", raw(lambda r: r.prompts[0].ClearField("content")), INVALID, "prompts[0]"),
    Row("prompt-empty-token-list", "raw", raw(lambda r: r.prompts[0].token_ids.ClearField("ids")),
        INVALID, "prompts[0]"),
    Row("prompt-text-no-tokenizer", "sdk", prompts("What is 2+3?"), INVALID, "prompts[0].text"),
    Row("prompt-too-long", "sdk", prompts(tuple([5] * 600)), INVALID, "prompts[0]"),
    Row("prompt-max-tokens-negative", "sdk", prompts(Prompt("p0", token_ids=OK_PROMPT, max_tokens=-5)),
        INVALID, "prompts[0].max_tokens"),
    Row("prompt-max-tokens-overflow", "sdk", prompts(Prompt("p0", token_ids=OK_PROMPT, max_tokens=2**31 - 1)),
        INVALID, "prompts[0].max_tokens"),
    Row("policy-enum-unknown", "raw", raw(lambda r: setattr(r, "policy", 99)), INVALID, "policy"),
    Row("policy-version-int64-max", "sdk", generate(policy_version=2**63 - 1), PRECONDITION, "policy_version"),
    Row("lookahead-bad-token", "sdk", generate(lookahead=[(5, -1)]), INVALID, "lookahead[0].token_ids[1]"),
    Row("sdk-token-id-not-an-int", "sdk", prompts(Prompt("p0", token_ids=("5", 6))), INVALID, "prompts[0].token_ids[0]"),
    Row("announce-nan-temperature", "sdk",
        sdk(lambda c, e: c.announce([OK_PROMPT], replace(OK_SAMPLING, temperature=math.nan))),
        INVALID, "sampling.temperature"),
    Row("announce-bad-token", "sdk", sdk(lambda c, e: c.announce([(5, VOCAB)], OK_SAMPLING)),
        INVALID, "prompts[0].token_ids[1]"),
    Row("update-policy-stale", "raw", raw_update_policy(-1, "/weights"), PRECONDITION, "version"),
    Row("update-policy-no-path", "sdk", sdk(lambda c, e: c.update_policy(e.core.version + 1, "")),
        INVALID, "weights_path"),
    Row("cancel-unknown-path-id", "sdk", sdk(lambda c, e: c.cancel("../x")), grpc.StatusCode.NOT_FOUND, "step_id"),
]


def hello(**fields) -> pb.WorkerMessage:
    base = dict(worker_id="fw-hostile", capacity=2, policy_version=0, max_model_len=MODEL_LEN, vocab_size=VOCAB)
    base.update(fields)
    return pb.WorkerMessage(hello=pb.Hello(**base))


def opening(first: pb.WorkerMessage | None) -> Act:
    """A worker stream that opens with ``first`` (None: an empty stream)."""
    async def act(env: Env):
        async with FakeWorker(env.target, "fw-hostile", first=first, heartbeat_seconds=0) as w:
            error = await w.closed()
        if error is None:
            pytest.fail("the scheduler accepted the stream")
        raise error
    return act


def raw_worker(*frames: bytes) -> Act:
    """A worker stream of raw frames (identity serializers), held open until the scheduler answers."""
    async def act(env: Env):
        async def frames_then_wait():
            for frame in frames:
                yield frame
                await asyncio.sleep(0.2)
            await asyncio.sleep(30)
        call = env.channel.stream_stream("/bubblespec.v1.WorkerLink/Connect")(frames_then_wait(), timeout=10)
        return [m async for m in call]
    return act


HELLO_ROWS = [
    Row("worker-empty-stream", "hello", opening(None), INVALID, "hello"),
    Row("worker-first-heartbeat", "hello", opening(pb.WorkerMessage(heartbeat=pb.Heartbeat())), INVALID, "hello"),
    Row("worker-first-completion", "hello",
        opening(pb.WorkerMessage(completion=pb.WorkerCompletion(request_key="s/p0/0"))), INVALID, "hello"),
    Row("worker-first-garbage", "hello", raw_worker(b"\xff\xff\xff"), INVALID, "request"),
    Row("hello-empty-id", "hello", opening(hello(worker_id="")), INVALID, "hello.worker_id"),
    Row("hello-path-id", "hello", opening(hello(worker_id="../w/1")), INVALID, "hello.worker_id"),
    Row("hello-10kb-emoji-id", "hello", opening(hello(worker_id="\N{FIRE}" * 2500)), INVALID, "hello.worker_id"),
    Row("hello-capacity-zero", "hello", opening(hello(capacity=0)), INVALID, "hello.capacity"),
    Row("hello-capacity-negative", "hello", opening(hello(capacity=-4)), INVALID, "hello.capacity"),
    Row("hello-unknown-logprobs-mode", "hello", opening(hello(logprobs_mode="logits")), INVALID,
        "hello.logprobs_mode"),
    Row("hello-other-model-len", "hello", opening(hello(max_model_len=1024)), PRECONDITION, "hello"),
    Row("hello-other-vocab", "hello", opening(hello(vocab_size=50_000)), PRECONDITION, "hello"),
    Row("hello-unknown-version", "hello", opening(hello(policy_version=5)), PRECONDITION, "hello.policy_version"),
    Row("worker-garbage-after-hello", "hello", raw_worker(hello().SerializeToString(), b"\x0a\xff\xff"),
        INVALID, "request"),
]


# Junk rows: ``act(env, held)`` sends the junk; ``held`` is a running step whose two requests
# are held by workers A and B. ``field`` is what the scheduler's log line names ("" = silent).


@dataclass
class Held:
    step: str
    ka: str  # the key worker A holds
    kb: str  # the key worker B holds
    task: asyncio.Task


def assignment_of(worker: FakeWorker, key: str) -> pb.Assignment:
    return worker.assignments[key]


def fake_assignment(key: str) -> pb.Assignment:
    step, prompt, index = key.split("/")
    return pb.Assignment(request_key=key, step_id=step, prompt_id=prompt, sample_index=int(index),
                         prompt_token_ids=list(OK_PROMPT), sampling=pb.SamplingParams(max_tokens=4), policy_version=0)


async def completion_before_assignment(env: Env, held: Held):
    assert not any(m.WhichOneof("kind") == "assign" for m in env.fresh.received)
    env.fresh.send(env.fresh.completion(assignment_of(env.a, held.ka)))
    return env.fresh


async def forged(env: Env, held: Held):
    env.a.send(env.a.completion(assignment_of(env.b, held.kb), token_ids=[1, 2, 3, 4]))
    return env.a


async def duplicate(env: Env, held: Held):
    env.a.complete(held.ka)  # the real one: delivered (before the snapshot, see prepare)
    return env.a


async def duplicate_again(env: Env, held: Held):
    env.a.send(env.a.completion(fake_assignment(held.ka), token_ids=[9, 9, 9, 9]))
    return env.a


def a_sends(make: Callable[[Env, Held], pb.WorkerMessage]) -> Act:
    async def act(env: Env, held: Held):
        env.a.send(make(env, held))
        return env.a
    return act


def a_completes(**overrides) -> Act:
    return a_sends(lambda env, held: env.a.completion(assignment_of(env.a, held.ka), **overrides))


def wm(**kind) -> Callable[[Env, Held], pb.WorkerMessage]:
    return lambda env, held: pb.WorkerMessage(**kind)


async def requeued_and_rerun(env: Env, held: Held, before: dict, after: dict) -> None:
    """A completion of the wrong policy version is not delivered: the request runs again."""
    step = env.core.steps[held.step]
    assert after["completions"] == before["completions"] and after["delivered"] == before["delivered"]
    assert step.requeued == before["steps"][held.step][2] + 1

    def assigned() -> list[str]:
        return [w.worker_id for w in (env.a, env.b, env.fresh) for m in w.received
                if m.WhichOneof("kind") == "assign" and m.assign.request_key == held.ka]

    # the new assignment goes to another worker's stream: wait for it there (syncing fw-a is not enough)
    await wait_until(lambda: len(assigned()) == 2, timeout=10.0, what="the request assigned again")
    assert step.requests[held.ka].failures[-1][0] == "fw-a", "a failed attempt of fw-a"
    assert assigned().count("fw-a") == 1, "a failed request goes to another worker while one can run it"



JUNK_ROWS = [
    Row("completion-before-assignment", "junk", completion_before_assignment, field="completion.request_key"),
    Row("completion-unknown-step", "junk",
        a_sends(lambda env, held: env.a.completion(fake_assignment("no-such-step/p0/0"))), field="completion.request_key"),
    Row("completion-path-key", "junk",
        a_completes(request_key="../../etc/passwd"), field="completion.request_key"),
    Row("forged-completion", "junk", forged, field="completion.request_key"),
    Row("duplicate-completion", "junk", duplicate_again, field="completion.request_key"),
    Row("completion-wrong-version", "junk", a_completes(policy_version=99)),
    Row("completion-identity-mismatch", "junk",
        a_sends(lambda env, held: env.a.completion(assignment_of(env.a, held.ka), prompt_id=held.kb.split("/")[1])),
        field="completion.completion"),
    Row("completion-token-outside-vocab", "junk", a_completes(token_ids=[5, VOCAB]),
        field="completion.completion.token_ids"),
    Row("completion-negative-token", "junk", a_completes(token_ids=[-1]), field="completion.completion.token_ids"),
    Row("progress-unknown-key", "junk", a_sends(wm(progress=pb.Progress(request_key="nobody/p0/0", generated_tokens=3))),
        field="progress.request_key"),
    Row("progress-other-workers-key", "junk",
        a_sends(lambda env, held: pb.WorkerMessage(progress=pb.Progress(request_key=held.kb, generated_tokens=3))),
        field="progress.request_key"),
    Row("aborted-other-workers-key", "junk",
        a_sends(lambda env, held: pb.WorkerMessage(aborted=pb.Aborted(request_key=held.kb, reason="lies"))),
        field="aborted.request_key"),
    Row("policy-loaded-never-asked", "junk",
        a_sends(wm(policy_loaded=pb.PolicyLoaded(version=77, ok=True, seconds=1.0))), field="policy_loaded.version"),
    Row("policy-load-failed-never-asked", "junk",
        a_sends(wm(policy_loaded=pb.PolicyLoaded(version=78, ok=False, error="boom"))), field="policy_loaded.version"),
    Row("draft-result-unknown-job", "junk", a_sends(wm(draft_result=pb.DraftResult(job_id="d999", tokens=50)))),
    Row("second-hello", "junk", a_sends(lambda env, held: hello(worker_id="fw-a", capacity=64)), field="kind"),
    Row("empty-worker-message", "junk", a_sends(lambda env, held: pb.WorkerMessage()), field="kind"),
    Row("heartbeat-nan-throughput", "junk", a_sends(wm(heartbeat=pb.Heartbeat(tokens_per_second=math.nan))),
        field="heartbeat.tokens_per_second"),
    Row("heartbeat-negative-throughput", "junk", a_sends(wm(heartbeat=pb.Heartbeat(tokens_per_second=-5.0))),
        field="heartbeat.tokens_per_second"),
]
PREPARE = {"duplicate-completion": duplicate}
EXPECTED_CHANGE = {"completion-wrong-version": requeued_and_rerun}


# ------------------------------------------------------------------- redis rows --


async def redis_case(redis_url: str, row_id: str, poison: Callable[[object, str, str], None],
                     corrupt_lengths: bool = False) -> None:
    """Write one good entry, poison the key with redis-py, read through RedisStore, ResilientStore
    and a worker agent's draft lookup."""
    import redis as redis_py

    from bubblespec.store import DraftEntry, DraftSource, ResilientStore, StoreSettings, prompt_key
    from bubblespec.store.redis_store import RedisStore, draft_key, length_key
    from bubblespec.worker.agent import WorkerAgent
    from bubblespec.worker.settings import WorkerSettings

    settings = StoreSettings(url=redis_url, key_prefix=f"hostile-{row_id}-{os.getpid()}:", retry_after_seconds=0.0)
    prompt = (11, 12, 13)
    pk = prompt_key(prompt)
    good = DraftEntry((40, 41, 42), 0, "s1", DraftSource.HISTORY, 1.0)
    store = RedisStore(settings)
    await store.put_draft(pk, good)
    await store.record_length(pk, 3)
    sync = redis_py.Redis.from_url(redis_url)
    try:
        poison(sync, draft_key(settings.key_prefix, pk), length_key(settings.key_prefix, pk))
    finally:
        sync.close()
    resilient = ResilientStore(RedisStore(settings), settings)
    agent = WorkerAgent(WorkerSettings(worker_id="reader"), engine=None, store=resilient)  # type: ignore[arg-type]
    try:
        if row_id == "redis-wrong-type":
            from bubblespec.store import StoreUnavailable

            with pytest.raises(StoreUnavailable, match="WRONGTYPE"):
                await store.get_drafts([pk])
            assert await resilient.get_drafts([pk]) == {pk: []}  # absorbed: the caller sees no drafts
            assert await agent.runner.drafts_for(prompt) == ()
            return
        if corrupt_lengths:
            assert await store.get_lengths([pk]) == {pk: [3]}
            assert await resilient.get_lengths([pk]) == {pk: [3]}
        else:
            assert await store.get_drafts([pk]) == {pk: [good]}
            assert await resilient.get_drafts([pk]) == {pk: [good]}
            assert await agent.runner.drafts_for(prompt) == (("history", good.tokens),)
        assert store.stats.corrupt_entries == 1 and store.stats.errors == 0
        assert resilient.stats.corrupt_entries >= 1 and resilient.available
    finally:
        await store.close()
        await resilient.close()


def redis_row(row_id: str, poison, corrupt_lengths: bool = False) -> Row:
    async def act(env: Env, redis_url: str):
        await redis_case(redis_url, row_id, poison, corrupt_lengths)
    return Row(row_id, "redis", act)


def _encoded_good() -> bytes:
    from bubblespec.store import DraftEntry, DraftSource, encode_entry

    return encode_entry(DraftEntry((40, 41, 42), 0, "s1", DraftSource.HISTORY, 1.0))


REDIS_ROWS = [
    redis_row("redis-garbage-draft", lambda r, dk, lk: r.lpush(dk, os.urandom(3) + b"\x00garbage")),
    redis_row("redis-truncated-draft", lambda r, dk, lk: r.lpush(dk, _encoded_good()[:-2])),
    redis_row("redis-bad-magic-draft", lambda r, dk, lk: r.lpush(dk, b"XXXX" + _encoded_good()[4:])),
    redis_row("redis-garbage-length", lambda r, dk, lk: r.lpush(lk, b"NaN"), corrupt_lengths=True),
    redis_row("redis-wrong-type", lambda r, dk, lk: (r.delete(dk), r.set(dk, b"not a list"))),
]

TABLE = TRAINER_ROWS + HELLO_ROWS + JUNK_ROWS + REDIS_ROWS


# ----------------------------------------------------------------------- tests --


def test_table_is_documented_and_large_enough():
    ids = [r.id for r in TABLE]
    assert len(ids) == len(set(ids)) and len(ids) >= 30
    missing = [i for i in ids if i not in __doc__]
    assert not missing, f"rows missing from the module docstring: {missing}"


def _status(exc: BaseException) -> tuple[object, str]:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    if isinstance(exc, BubbleSpecError):
        return exc.code, exc.message
    return type(exc), str(exc)


async def _refused(row: Row, env: Env, *args) -> None:
    before = core_state(env.scheduler)
    try:
        result = await row.act(env, *args)
    except Exception as exc:  # the answer under test
        code, details = _status(exc)
    else:
        pytest.fail(f"accepted: {result!r:.200}")
    assert code == row.code, details
    if row.field:
        assert details.startswith(row.field + ":"), details
        assert len(details) < 400, "details stay short whatever the input size"
    try:  # a stream's teardown (detach) may run just after its status was sent
        await wait_until(lambda: core_state(env.scheduler) == before, timeout=2.0)
    except AssertionError:
        pass
    try:
        assert core_state(env.scheduler) == before
    finally:  # never let one row's leftovers spoil the next
        if "fw-hostile" in env.core.workers and "fw-hostile" not in env.scheduler.service.links:
            env.scheduler.service.execute(env.core.remove_worker("fw-hostile"))


async def _start_held_step(env: Env, name: str) -> Held:
    step = f"held-{name}"
    task = asyncio.create_task(env.client.generate(step, [OK_PROMPT, (8, 9, 10)], OK_SAMPLING,
                                                   policy_version=env.core.version, drafts=False,
                                                   straggler_watch=False))
    await wait_until(lambda: any(k.startswith(step + "/") for k in env.a.assignments)
                     and any(k.startswith(step + "/") for k in env.b.assignments), what="both workers to hold work")
    ka = next(k for k in env.a.assignments if k.startswith(step + "/"))
    kb = next(k for k in env.b.assignments if k.startswith(step + "/"))
    return Held(step, ka, kb, task)


async def _check_junk(row: Row, env: Env, held: Held, caplog) -> None:
    if row.id in PREPARE:
        await env.sync(await PREPARE[row.id](env, held))
    await env.sync(env.a)
    await env.sync(env.b)
    before = core_state(env.scheduler)
    caplog.clear()
    sender = await row.act(env, held)
    await env.sync(sender)
    after = core_state(env.scheduler)
    if row.id in EXPECTED_CHANGE:
        await EXPECTED_CHANGE[row.id](env, held, before, after)
    else:
        assert after == before
    if row.field:
        assert any(row.field in r.getMessage() for r in caplog.records), caplog.text
    assert all(link in env.scheduler.service.links for link in ("fw-a", "fw-b", "fw-fresh")), "stream kept open"


async def _release(env: Env, held: Held):
    """The rightful workers answer what they hold of the step; the trainer's call returns."""
    for w in (env.a, env.b, env.fresh):  # fresh: a request that failed on A may have gone there
        for key in [k for k in w.assignments if k.startswith(held.step + "/")]:
            w.complete(key)
    return await asyncio.wait_for(held.task, 10)


async def _junk(row: Row, env: Env, caplog) -> None:
    held = await _start_held_step(env, row.id)
    try:
        await _check_junk(row, env, held, caplog)
    except BaseException:
        with contextlib.suppress(Exception):  # leave no running step behind for the next row
            await _release(env, held)
        raise
    result = await _release(env, held)
    got = {c.prompt_id: (c.token_ids, c.worker_id) for c in result.completions}
    assert sorted((c.prompt_id, c.sample_index) for c in result.completions) == [("p0", 0), ("p1", 0)]
    assert got["p0"][0] == fake_tokens(OK_PROMPT, 4) and got["p1"][0] == fake_tokens((8, 9, 10), 4)
    assert got[held.kb.split("/")[1]][1] == "fw-b", "B's request is answered by B, whatever A sent"
    assert result.summary.completions == 2


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=r.marks) for r in TABLE])
async def test_hostile_input(row: Row, env: Env, caplog, request):
    caplog.set_level(logging.DEBUG, logger="bubblespec")
    if row.via in ("sdk", "raw", "hello"):
        await _refused(row, env)
    elif row.via == "junk":
        await _junk(row, env, caplog)
    else:
        redis_server = request.getfixturevalue("redis_server")
        await row.act(env, redis_server.url)


async def test_unasked_policy_loaded_is_not_a_weight_load(env: Env):
    tally = env.scheduler.metrics.tally
    before = (sum(tally.weight_load.counts), tally.load_failures)
    env.a.send(policy_loaded=pb.PolicyLoaded(version=79, ok=True, seconds=3.0))
    env.a.send(policy_loaded=pb.PolicyLoaded(version=80, ok=False, error="boom"))
    await env.sync(env.a)
    assert (sum(tally.weight_load.counts), tally.load_failures) == before

