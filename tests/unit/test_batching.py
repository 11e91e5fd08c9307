"""Batched completions on the control plane: real scheduler on loopback gRPC, a scripted worker
on the real WorkerLink stream, the SDK's collector, the worker link's outgoing stream, and the
step journal on a real redis-server.

- A worker may send several completions in one ``WorkerMessage.completions`` batch; each is
  handled as a single ``completion`` message would be (a bad entry costs only itself).
- A trainer that sets ``GenerateRequest.batch_completions`` gets the completions waiting at
  once in ``CompletionBatch`` responses; one that does not (an older SDK) gets one per response.
- The SDK's collector reads both, each completion once.
- The agent sends completions queued together as one message, in order, never over its byte cap.
- The journal writes a batch of a step's completions as one HSET (and one EXPIRE) per step key.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import redis

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client._base import StepCollector
from bubblespec.common import codec as cv
from bubblespec.common.types import Completion, FinishReason, Provenance, SamplingParams
from bubblespec.scheduler import wire as wire_module
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.journal import StepJournal
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.store import StoreSettings
from bubblespec.worker import link as link_module
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.settings import WorkerSettings
from tests.factories import generate_request
from tests.support.fake_worker import FakeWorker, wait_until
from tests.support.redis_server import RedisServer, redis_server_available

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPTS = [(5, 6, 7), (8, 9), (10, 11, 12), (13, 14)]


async def _held_step(batch: bool, prompts=PROMPTS, n: int = 2):
    """A scheduler, a worker holding every request of a step, and the step's Generate call."""
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1,
                                            core=CoreSettings(drafting=False)))
    await scheduler.start()
    worker = await FakeWorker(f"127.0.0.1:{scheduler.grpc_port}", "fw-b", capacity=16, auto=False).start()
    await wait_until(lambda: "fw-b" in scheduler.core.workers, what="the worker to join")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.grpc_port}")
    request = generate_request("s", prompts, GREEDY, n=n)
    request.batch_completions = batch
    call = pbg.RolloutStub(channel).Generate(request, timeout=30)
    total = len(prompts) * n
    await wait_until(lambda: len(worker.assignments) == total, what="every request to be assigned")
    return scheduler, worker, channel, call


async def _close(scheduler, worker, channel) -> None:
    await worker.stop()
    await channel.close()
    await scheduler.stop(grace=0)


def _batch_of(worker: FakeWorker, keys: list[str], **overrides) -> pb.WorkerMessage:
    """One ``completions`` message answering ``keys`` (held assignments), in that order."""
    entries = []
    for key in keys:
        a = worker.assignments.pop(key)
        entries.append(worker.completion(a, **overrides.get(key, {})).completion)
    return pb.WorkerMessage(completions=pb.WorkerCompletionBatch(completions=entries))


async def test_a_worker_batch_is_handled_entry_by_entry_and_a_bad_entry_costs_only_itself(caplog):
    scheduler, worker, channel, call = await _held_step(batch=False)
    try:
        keys = sorted(worker.assignments)
        bad = keys[3]
        worker.send(_batch_of(worker, keys[:6], **{bad: {"token_ids": [10_000] * 4}}))  # outside the vocabulary
        await wait_until(lambda: len(scheduler.core.steps["s"].completions) == 5, what="five completions")
        assert bad not in scheduler.core.steps["s"].completions
        assert "completions[3]" in caplog.text  # named, and the entries after it were still taken
        # the bad one is still the worker's; a later single completion (the old form) ends the step
        worker.assignments[bad] = next(m.assign for m in worker.received if m.assign.request_key == bad)
        worker.complete_all()
        msgs = [m async for m in call]
    finally:
        await _close(scheduler, worker, channel)
    kinds = [m.WhichOneof("event") for m in msgs]
    assert kinds == ["completion"] * 8 + ["summary"]  # no batch_completions: one per response, as before
    assert sorted(f"s/{m.completion.prompt_id}/{m.completion.sample_index}" for m in msgs[:-1]) == sorted(keys)


async def test_a_trainer_that_asks_for_batches_gets_each_completion_once_in_batches(monkeypatch):
    scheduler, worker, channel, call = await _held_step(batch=True)
    try:
        keys = sorted(worker.assignments)
        one = worker.completion(worker.assignments[keys[0]]).completion.ByteSize()
        monkeypatch.setattr(wire_module, "BATCH_BYTES", 3 * one + 1)  # at most 3 of these per response
        stream = aiter(call)
        worker.send(_batch_of(worker, keys))  # all 8 reach the trainer's queue in one go
        msgs = [await anext(stream) for _ in range(3)]
        msgs += [m async for m in stream]
    finally:
        await _close(scheduler, worker, channel)
    assert [m.WhichOneof("event") for m in msgs] == ["completions"] * 3 + ["summary"]
    sizes = [len(m.completions.completions) for m in msgs[:-1]]
    assert sizes == [3, 3, 2]
    got = [f"s/{c.prompt_id}/{c.sample_index}" for m in msgs[:-1] for c in m.completions.completions]
    assert got == keys  # in the order they were delivered, none twice
    collector = StepCollector(generate_request("s", PROMPTS, GREEDY, n=2))
    new = [c for m in msgs for c in collector.add_all(m)]
    assert len(new) == 8 and collector.done


async def test_the_worker_streams_messages_are_counted_a_batch_once():
    """``bubblespec_worker_stream_messages_total``: every message each way, a batch once."""
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1,
                                            core=CoreSettings(drafting=False)))
    await scheduler.start()
    worker = await FakeWorker(f"127.0.0.1:{scheduler.grpc_port}", "fw-m", capacity=16, auto=False,
                              heartbeat_seconds=0, assign_batches=True).start()  # no heartbeats: a known count
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.grpc_port}")
    try:
        await wait_until(lambda: "fw-m" in scheduler.core.workers, what="the worker to join")
        call = pbg.RolloutStub(channel).Generate(generate_request("s", PROMPTS, GREEDY, n=2), timeout=30)
        await wait_until(lambda: len(worker.assignments) == 8, what="every request to be assigned")
        worker.send(_batch_of(worker, sorted(worker.assignments)))  # 8 completions, one message
        msgs = [m async for m in call]
        text = scheduler.metrics.render()[0].decode()
    finally:
        await _close(scheduler, worker, channel)
    assert msgs[-1].WhichOneof("event") == "summary"
    sent = len(worker.received)  # what the scheduler handed to the stream, all of it read by the worker
    assert any(m.WhichOneof("kind") == "assigns" for m in worker.received) and 1 <= sent < 8  # batched
    assert 'bubblespec_worker_stream_messages_total{direction="received"} 2.0' in text  # the hello, the batch
    assert f'bubblespec_worker_stream_messages_total{{direction="sent"}} {sent:.1f}' in text


def _completion(prompt_id: str, index: int) -> pb.Completion:
    c = Completion("s", prompt_id, index, (4, 5), (-0.1, -0.2), "", FinishReason.STOP, 0, "w", 2,
                   Provenance(forward_passes=2))
    return cv.completion_to_pb(c)


def test_the_collector_reads_batches_and_singles_each_completion_once():
    collector = StepCollector(generate_request("s", PROMPTS[:2], GREEDY, n=2))
    batch = pb.GenerateResponse(completions=pb.CompletionBatch(completions=[_completion("p0", 0), _completion("p0", 1)]))
    assert [(c.prompt_id, c.sample_index) for c in collector.add_all(batch)] == [("p0", 0), ("p0", 1)]
    assert collector.add_all(batch) == []  # a resend after a retry: nothing new
    again = pb.GenerateResponse(completions=pb.CompletionBatch(completions=[_completion("p0", 1), _completion("p1", 0)]))
    assert [(c.prompt_id, c.sample_index) for c in collector.add_all(again)] == [("p1", 0)]
    single = pb.GenerateResponse(completion=_completion("p1", 1))
    assert [(c.prompt_id, c.sample_index) for c in collector.add_all(single)] == [("p1", 1)]
    assert len(collector.completions) == 4 and not collector.done  # no summary yet


def _worker_completion(key: str, tokens: int = 2) -> pb.WorkerMessage:
    c = pb.Completion(step_id="s", prompt_id=key, token_ids=[7] * tokens, logprobs=[-0.1] * tokens)
    return pb.WorkerMessage(completion=pb.WorkerCompletion(request_key=key, completion=c))


async def test_the_agent_sends_completions_queued_together_as_one_message_in_order(monkeypatch):
    agent = WorkerAgent(WorkerSettings(worker_id="w"), engine=None)  # type: ignore[arg-type]
    monkeypatch.setattr(link_module, "BATCH_BYTES", 3 * _worker_completion("k0").completion.ByteSize() + 1)
    beat = pb.WorkerMessage(heartbeat=pb.Heartbeat(running=1))
    for msg in [_worker_completion("k0"), _worker_completion("k1"), beat, _worker_completion("k2"),
                _worker_completion("big", tokens=100), *(_worker_completion(f"m{i}") for i in range(4)), None]:
        agent.link.outbox.put_nowait(msg)
    sent = [msg async for msg in agent.link.outgoing()]
    shape = [[c.request_key for c in m.completions.completions] if m.WhichOneof("kind") == "completions"
             else m.WhichOneof("kind") + (":" + m.completion.request_key if m.HasField("completion") else "")
             for m in sent]
    assert shape == [["k0", "k1"], "heartbeat", "completion:k2", "completion:big", ["m0", "m1", "m2"], "completion:m3"]


@pytest.mark.skipif(not redis_server_available(), reason="redis-server is not installed")
async def test_the_journal_writes_a_steps_completions_as_one_hset_per_batch():
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        journal = StepJournal(StoreSettings(url=server.url), b"s" * 16)
        journal.start()
        try:
            r.config_resetstat()
            journal.save_step("s", "fp")
            for i in range(50):
                c = cv.completion_from_pb(_completion(f"p{i}", 0))
                journal.save_completion(f"s/p{i}/0", c)
            journal.finish_step("s")
            journal.save_completion("s/late/0", cv.completion_from_pb(_completion("late", 0)))  # after the finish
            await journal.flush()
            calls = {k: v["calls"] for k, v in r.info("commandstats").items()}
            fingerprint, done = await journal.load_step("s")
        finally:
            await journal.close()
            r.close()
    assert fingerprint == "fp" and sorted(done) == sorted([f"s/p{i}/0" for i in range(50)] + ["s/late/0"])
    assert calls["cmdstat_hset"] == 2  # the 51 records and the fingerprint: one before the finish, one after
    assert calls["cmdstat_expire"] == 3


async def test_the_agent_sends_the_progress_reported_within_one_period_in_one_message():
    agent = WorkerAgent(WorkerSettings(worker_id="w", progress_seconds=0.05), engine=None)  # type: ignore[arg-type]
    agent.link.report_progress("a", 3)
    agent.link.report_progress("b", 5)
    agent.link.report_progress("a", 4)  # a later report of the same request replaces the earlier one
    await wait_until(lambda: not agent.link.outbox.empty(), what="the progress message")
    msg = agent.link.outbox.get_nowait()
    assert [(p.request_key, p.generated_tokens) for p in msg.progress_batch.progress] == [("a", 4), ("b", 5)]
    agent.link.report_progress("c", 1)  # alone in its period: the single form
    await wait_until(lambda: not agent.link.outbox.empty(), what="the second progress message")
    single = agent.link.outbox.get_nowait()
    assert single.WhichOneof("kind") == "progress" and single.progress.request_key == "c"


async def test_settings_replaced_on_a_running_agent_reach_the_layers_that_read_them():
    """``test_moves_engines`` shortens running workers' progress period this way."""
    agent = WorkerAgent(WorkerSettings(worker_id="w", progress_seconds=600.0), engine=None)  # type: ignore[arg-type]
    agent.settings = dataclasses.replace(agent.settings, progress_seconds=0.05)
    agent.link.report_progress("a", 3)
    await wait_until(lambda: not agent.link.outbox.empty(), timeout=5, what="the progress message, 0.05 s on")
    assert agent.runner.settings.progress_seconds == 0.05  # what paces the runner's reports


async def test_a_progress_batch_updates_each_request_the_worker_holds_and_ignores_the_rest():
    scheduler, worker, channel, call = await _held_step(batch=True)
    try:
        keys = sorted(worker.assignments)
        reports = [pb.Progress(request_key=keys[0], generated_tokens=2),
                   pb.Progress(request_key="s/nobody/0", generated_tokens=9),
                   pb.Progress(request_key=keys[1], generated_tokens=3)]
        worker.send(progress_batch=pb.ProgressBatch(progress=reports))
        requests = scheduler.core.steps["s"].requests
        await wait_until(lambda: requests[keys[1]].progress == 3, what="the progress of the third entry")
        assert requests[keys[0]].progress == 2 and all(requests[k].progress == 0 for k in keys[2:])
        worker.complete_all()
        assert [m.WhichOneof("event") async for m in call][-1] == "summary"
    finally:
        await _close(scheduler, worker, channel)


@pytest.mark.skipif(not redis_server_available(), reason="redis-server is not installed")
async def test_a_flush_writes_at_once_whatever_the_journals_batching_window():
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        journal = StepJournal(StoreSettings(url=server.url), b"s" * 16, batch_seconds=3600.0)
        journal.start()
        try:
            journal.save_step("s", "fp")
            await journal.flush()  # would time out (5 s) if it waited for the window
            assert r.hexists(journal._step_key("s"), "fingerprint")
            journal.save_completion("s/p0/0", cv.completion_from_pb(_completion("p0", 0)))
            await journal.flush()  # a second window, cut short the same way
            assert r.hexists(journal._step_key("s"), "s/p0/0")
        finally:
            await journal.close()
            r.close()
