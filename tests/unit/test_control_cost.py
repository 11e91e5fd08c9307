"""Fewer messages and less work per completion on the control plane, same results: real
scheduler on loopback gRPC with its step journal on a real redis-server, a scripted worker on the
real WorkerLink stream, and the worker link's outgoing stream.

- The agent sends the completions that end within ``completion_batch_seconds`` of the last
  completion message it sent in one ``completions`` batch, in order; a full batch goes at once,
  and so does a batch once no request is left running on the worker (nothing more can join it;
  the step's end waits for it).
- A completion delivered with a journal is not encoded again: the journal record and the
  trainer's stream carry the worker's own message (its worker id stamped).
- Assignments reuse the encoding of their sampling parameters; each still carries its own.
- A started scheduler raises the young-generation GC threshold (never lowers one set higher).
"""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client._base import StepCollector
from bubblespec.common import codec as cv
from bubblespec.common.types import Completion, FinishReason, Provenance, SamplingParams
from bubblespec.scheduler import wire as wire_module
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.types import Assign, RequestSpec
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.worker import link as link_module
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.settings import WorkerSettings
from tests.factories import generate_request
from tests.support.fake_worker import FakeWorker, wait_until
from tests.support.redis_server import RedisServer, redis_server_available

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPTS = [(5, 6, 7), (8, 9), (10, 11, 12), (13, 14)]


def _worker_completion(key: str) -> pb.WorkerMessage:
    c = pb.Completion(step_id="s", prompt_id=key, token_ids=[7, 8], logprobs=[-0.1, -0.2])
    return pb.WorkerMessage(completion=pb.WorkerCompletion(request_key=key, completion=c))


def _shape(msg: pb.WorkerMessage) -> list[str]:
    if msg.WhichOneof("kind") == "completions":
        return [c.request_key for c in msg.completions.completions]
    return [msg.completion.request_key]


def _running(agent: WorkerAgent, key: str) -> asyncio.Task:
    """A request that runs on ``agent`` until cancelled (``agent.runner._untrack(key)`` ends it)."""
    task = asyncio.create_task(asyncio.Event().wait())
    agent.runner.tasks[key] = task
    return task


async def test_the_agent_sends_completions_that_end_within_the_gap_in_one_message_in_order():
    agent = WorkerAgent(WorkerSettings(worker_id="w", completion_batch_seconds=3.0), engine=None)  # type: ignore[arg-type]
    running = _running(agent, "still-running")  # the gap holds completions only while others may end
    stream = agent.link.outgoing()
    agent.link.outbox.put_nowait(_worker_completion("k0"))
    assert _shape(await anext(stream)) == ["k0"]  # the first after a quiet spell: alone, not held for the gap
    agent.link.outbox.put_nowait(_worker_completion("k1"))
    second = asyncio.create_task(anext(stream))
    for _ in range(5):  # k1 is held for the rest of the gap; completions ending meanwhile join it
        await asyncio.sleep(0)
    assert not second.done()
    agent.link.outbox.put_nowait(_worker_completion("k2"))
    for _ in range(3):
        await asyncio.sleep(0)
    agent.link.outbox.put_nowait(_worker_completion("k3"))
    agent.link.outbox.put_nowait(None)
    assert _shape(await second) == ["k1", "k2", "k3"]
    assert [m async for m in stream] == []  # the stream ends after the batch
    running.cancel()


async def test_the_last_running_request_ending_sends_the_waiting_batch_at_once():
    agent = WorkerAgent(WorkerSettings(worker_id="w", completion_batch_seconds=600.0), engine=None)  # type: ignore[arg-type]
    running = _running(agent, "last")
    draft_job = _running(agent, "draft:j1")  # a draft job sends no completion: it holds nothing back
    stream = agent.link.outgoing()
    agent.link.outbox.put_nowait(_worker_completion("k0"))
    assert _shape(await anext(stream)) == ["k0"]
    agent.link.outbox.put_nowait(_worker_completion("k1"))
    batch = asyncio.create_task(anext(stream))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not batch.done()  # held for the 600 s gap while "last" may still end and join
    agent.link.outbox.put_nowait(_worker_completion("k2"))
    agent.runner._untrack("last")  # the last request's completion is queued: nothing more can come
    assert _shape(await asyncio.wait_for(batch, 60)) == ["k1", "k2"]  # the bound only ends a hang
    agent.link.outbox.put_nowait(_worker_completion("k3"))  # no request running: not held at all
    assert _shape(await asyncio.wait_for(anext(stream), 60)) == ["k3"]
    await stream.aclose()
    running.cancel()
    draft_job.cancel()


async def test_a_full_batch_already_waiting_does_not_wait_for_the_gap(monkeypatch):
    monkeypatch.setattr(link_module, "BATCH_MAX", 3)
    agent = WorkerAgent(WorkerSettings(worker_id="w", completion_batch_seconds=600.0), engine=None)  # type: ignore[arg-type]
    running = _running(agent, "still-running")
    stream = agent.link.outgoing()
    agent.link.outbox.put_nowait(_worker_completion("k0"))
    assert _shape(await anext(stream)) == ["k0"]
    for i in range(1, 5):
        agent.link.outbox.put_nowait(_worker_completion(f"k{i}"))
    full = await asyncio.wait_for(anext(stream), 60)  # not held for the 600 s gap: the bound only ends a hang
    assert _shape(full) == ["k1", "k2", "k3"]
    await stream.aclose()  # k4 would wait for the gap
    running.cancel()


async def test_without_a_gap_only_the_completions_queued_together_share_a_message():
    agent = WorkerAgent(WorkerSettings(worker_id="w", completion_batch_seconds=0.0), engine=None)  # type: ignore[arg-type]
    stream = agent.link.outgoing()
    agent.link.outbox.put_nowait(_worker_completion("k0"))
    agent.link.outbox.put_nowait(_worker_completion("k1"))
    assert _shape(await anext(stream)) == ["k0", "k1"]
    agent.link.outbox.put_nowait(_worker_completion("k2"))
    assert _shape(await anext(stream)) == ["k2"]
    agent.link.outbox.put_nowait(None)
    assert [m async for m in stream] == []


@pytest.mark.skipif(not redis_server_available(), reason="redis-server is not installed")
async def test_a_delivered_completion_is_encoded_once_for_the_journal_and_the_trainer(monkeypatch):
    calls: list[str] = []
    encode = cv.completion_to_pb

    def counting(c: Completion) -> pb.Completion:
        calls.append(f"{c.step_id}/{c.prompt_id}/{c.sample_index}")
        return encode(c)

    monkeypatch.setattr(cv, "completion_to_pb", counting)
    with RedisServer() as server:
        scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1, redis_url=server.url,
                                                journal_secret="s" * 32, core=CoreSettings(drafting=False)))
        await scheduler.start()
        worker = await FakeWorker(f"127.0.0.1:{scheduler.grpc_port}", "fw-e", capacity=16).start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.grpc_port}")
        try:
            await wait_until(lambda: "fw-e" in scheduler.core.workers, what="the worker to join")
            request = generate_request("s", PROMPTS, GREEDY, n=2)
            request.batch_completions = True
            msgs = [m async for m in pbg.RolloutStub(channel).Generate(request, timeout=30)]
            await scheduler.service.journal.flush()
            _, journaled = await scheduler.service.journal.load_step("s")
        finally:
            await worker.stop()
            await channel.close()
            await scheduler.stop(grace=0)
    collector = StepCollector(generate_request("s", PROMPTS, GREEDY, n=2))
    got = {f"s/{c.prompt_id}/{c.sample_index}": c for m in msgs for c in collector.add_all(m)}
    assert collector.done and len(got) == 8
    assert calls == []  # never re-encoded: the worker's own message went to the journal and the trainer
    assert journaled == got  # the journal holds what the trainer got, worker id stamped included
    assert {c.worker_id for c in got.values()} == {"fw-e"}


def _completion(prompt_id: str) -> Completion:
    return Completion("s", prompt_id, 0, (4, 5), (-0.1, -0.2), "", FinishReason.STOP, 0, "w", 2,
                      Provenance(forward_passes=2))


def test_a_kept_encoding_is_taken_once_and_the_oldest_is_dropped_first(monkeypatch):
    monkeypatch.setattr(wire_module, "COMPLETION_MEMO_MAX", 2)
    monkeypatch.setattr(wire_module, "_completion_memo", {})
    a, b, c = _completion("a"), _completion("b"), _completion("c")
    kept = {x.prompt_id: wire_module.completion_pb(x, keep=True) for x in (a, b, c)}  # a is dropped for c
    assert wire_module.completion_pb(b) is kept["b"] and wire_module.completion_pb(c) is kept["c"]
    again = wire_module.completion_pb(a)
    assert again is not kept["a"] and again == kept["a"] == cv.completion_to_pb(a)  # encoded anew, same bytes
    assert wire_module.completion_pb(b) is not kept["b"]  # taken once: a second stream encodes its own
    twin = _completion("b")  # equal, but another object: never served another's encoding
    wire_module.completion_pb(b, keep=True)
    assert wire_module.completion_pb(twin) == cv.completion_to_pb(twin)
    assert not wire_module._completion_memo or id(twin) not in wire_module._completion_memo


def test_each_assignment_carries_its_own_sampling_however_many_samplings_there_are(monkeypatch):
    monkeypatch.setattr(wire_module, "_SAMPLING_MEMO_MAX", 2)
    monkeypatch.setattr(wire_module, "_sampling_memo", {})
    samplings = [SamplingParams(temperature=1.0, max_tokens=4 + i, seed=i) for i in range(5)]
    for _ in range(2):  # the second round finds some in the memo, the rest were dropped
        for i, sampling in enumerate(samplings):
            spec = RequestSpec(f"s/p{i}/0", "s", f"p{i}", 0, (5, 6), sampling, 0, False, 1)
            msg = wire_module.scheduler_message(Assign("w", spec))
            assert msg.assign.sampling == cv.sampling_to_pb(sampling)
            assert cv.sampling_from_pb(msg.assign.sampling) == sampling
    assert len(wire_module._sampling_memo) <= 2


async def test_a_started_scheduler_collects_young_garbage_less_often_and_keeps_a_higher_setting():
    from bubblespec.scheduler import server as server_module

    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # Python's default
        scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1))
        await scheduler.start()
        await scheduler.stop(grace=0)
        assert gc.get_threshold() == (server_module.GC_YOUNG_THRESHOLD, 10, 10)  # the older generations unchanged
        gc.set_threshold(10 * server_module.GC_YOUNG_THRESHOLD, 5, 5)
        scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1))
        await scheduler.start()
        await scheduler.stop(grace=0)
        assert gc.get_threshold() == (10 * server_module.GC_YOUNG_THRESHOLD, 5, 5)  # never lowered
    finally:
        gc.set_threshold(*saved)
