"""Batched assignments on the scheduler -> worker stream: the wire conversion, the service's
worker outbox, a real scheduler on loopback gRPC with scripted workers (one that says it reads
batches, one that does not), and the real worker agent on a simulated engine.

- Consecutive assignments a worker's outbox holds at once go out as one ``assigns`` message,
  in order; any other message (an Abort) ends a run of them, so nothing overtakes an Assign.
- Only a worker whose hello set ``accepts_assign_batches`` gets batches; an older one gets one
  ``assign`` message per assignment.
- The worker agent says it reads batches and runs each entry as a single assignment: a bad
  entry is refused (``Aborted``, the reason naming ``assigns[i]``) and the others run.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.bench.load_engine import LoadEngineSettings, LoadTestEngine
from bubblespec.common.types import SamplingParams
from bubblespec.scheduler import wire
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.types import Abort, Assign, ControlCall, LoadPolicy, ModelLimits, RequestSpec, WorkerHello
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.service import END, SchedulerService
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.engine import EngineSettings
from tests.factories import generate_request
from tests.support.fake_worker import FakeWorker, wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPTS = [(5, 6, 7), (8, 9), (10, 11, 12), (13, 14)]


def _assign(worker: str, i: int, prompt=(5, 6, 7)) -> Assign:
    spec = RequestSpec(f"s/p{i}/0", "s", f"p{i}", 0, tuple(prompt), SamplingParams(temperature=0.7, top_p=0.9,
                       max_tokens=8, seed=i), 3, i % 2 == 0, 4)
    return Assign(worker, spec)


def _shape(msgs: list[pb.SchedulerMessage]) -> list:
    out = []
    for m in msgs:
        kind = m.WhichOneof("kind")
        if kind == "assigns":
            out.append([a.request_key for a in m.assigns.assignments])
        elif kind == "assign":
            out.append("assign:" + m.assign.request_key)
        elif kind == "abort":
            out.append("abort:" + m.abort.request_key)
        else:
            out.append(kind)
    return out


def test_a_batch_entry_is_exactly_the_single_assignment():
    actions = [_assign("w", i) for i in range(3)]
    msgs = list(wire.scheduler_messages(actions, batch=True))
    assert [m.WhichOneof("kind") for m in msgs] == ["assigns"]
    singles = [wire.scheduler_message(a).assign for a in actions]
    assert list(msgs[0].assigns.assignments) == singles
    decoded = pb.SchedulerMessage.FromString(msgs[0].SerializeToString())  # the round trip over the wire
    assert list(decoded.assigns.assignments) == singles
    assert decoded.assigns.assignments[2].sampling.top_p == singles[2].sampling.top_p


def test_runs_of_assignments_are_batched_in_order_and_nothing_overtakes_them():
    items = [_assign("w", 0), _assign("w", 1), Abort("w", "s/p0/0"), _assign("w", 2), LoadPolicy("w", 4, "/x"),
             _assign("w", 3), ControlCall("w", "c", "reset_prefix_cache", "{}"), _assign("w", 4), _assign("w", 5)]
    assert _shape(list(wire.scheduler_messages(items, batch=True))) == [
        ["s/p0/0", "s/p1/0"], "abort:s/p0/0", "assign:s/p2/0", "load_policy", "assign:s/p3/0", "control",
        ["s/p4/0", "s/p5/0"]]
    assert _shape(list(wire.scheduler_messages(items, batch=False))) == [
        "assign:s/p0/0", "assign:s/p1/0", "abort:s/p0/0", "assign:s/p2/0", "load_policy", "assign:s/p3/0", "control",
        "assign:s/p4/0", "assign:s/p5/0"]


def test_the_outbox_holds_core_types_only_and_a_control_call_goes_out_by_its_op():
    msg = wire.scheduler_message(ControlCall("w", "c7", "finish_weight_update", '{"weight_version": "s7"}', 7))
    assert msg.control == pb.ControlCall(call_id="c7", op=pb.CONTROL_OP_FINISH_WEIGHT_UPDATE,
                                         json='{"weight_version": "s7"}', policy_version=7)
    with pytest.raises(TypeError, match="not a worker message"):  # protobuf built elsewhere is not carried
        wire.scheduler_message(pb.SchedulerMessage(control=pb.ControlCall(call_id="c")))  # type: ignore[arg-type]


def test_a_batch_stays_under_its_count_and_byte_caps(monkeypatch):
    monkeypatch.setattr(wire, "ASSIGN_BATCH_MAX", 3)
    items = [_assign("w", i) for i in range(7)]
    assert [len(m.assigns.assignments) for m in wire.scheduler_messages(items, batch=True)] == [3, 3, 0]  # 7th alone
    one = wire.scheduler_message(items[0]).assign.ByteSize() + 6
    big = _assign("w", 9, prompt=tuple(range(3, 400)))
    msgs = list(wire.scheduler_messages([*items[:2], big, *items[2:4]], batch=True, max_bytes=2 * one + 16))
    assert _shape(msgs) == [["s/p0/0", "s/p1/0"], "assign:s/p9/0", ["s/p2/0", "s/p3/0"]]  # the large one goes alone
    assert all(m.ByteSize() <= 2 * one + 16 for m in msgs if m.WhichOneof("kind") == "assigns")


def test_the_service_queues_a_workers_actions_in_order_and_the_drain_groups_them():
    service = SchedulerService(SchedulerCore(CoreSettings(), lambda: 0.0))
    new = service.attach_worker(WorkerHello("new", 4, 0, ModelLimits(512, 128)), accepts_assign_batches=True)
    old = service.attach_worker(WorkerHello("old", 4, 0, ModelLimits(512, 128)))
    for link in (new, old):  # what joining queued (nothing to run yet)
        while not link.outbox.empty():
            link.outbox.get_nowait()
    service.execute([_assign("new", 0), _assign("old", 1), _assign("new", 2), Abort("new", "s/p0/0"),
                     _assign("new", 3), _assign("old", 4)])
    new.close()
    items, ended = new.drain(new.outbox.get_nowait())
    assert ended and new.outbox.empty()
    assert _shape(list(wire.scheduler_messages(items, new.accepts_assign_batches))) == [
        ["s/p0/0", "s/p2/0"], "abort:s/p0/0", "assign:s/p3/0"]
    items, ended = old.drain(old.outbox.get_nowait())
    assert not ended and old.accepts_assign_batches is False
    assert _shape(list(wire.scheduler_messages(items, old.accepts_assign_batches))) == ["assign:s/p1/0", "assign:s/p4/0"]
    assert old.outbox.empty()
    old.outbox.put_nowait(END)


async def _held(worker_kw: dict):
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1,
                                            core=CoreSettings(drafting=False)))
    await scheduler.start()
    worker = await FakeWorker(f"127.0.0.1:{scheduler.grpc_port}", "fw", capacity=16, auto=False, **worker_kw).start()
    await wait_until(lambda: "fw" in scheduler.core.workers, what="the worker to join")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.grpc_port}")
    call = pbg.RolloutStub(channel).Generate(generate_request("s", PROMPTS, GREEDY, n=2), timeout=30)
    await wait_until(lambda: len(worker.assignments) == 8, what="every request to be assigned")
    return scheduler, worker, channel, call


async def _held_then_cancelled(worker_kw: dict) -> list[pb.SchedulerMessage]:
    scheduler, worker, channel, call = await _held(worker_kw)
    try:
        await pbg.RolloutStub(channel).Cancel(pb.CancelRequest(step_id="s"), timeout=10)
        await wait_until(lambda: sum(m.WhichOneof("kind") == "abort" for m in worker.received) == 8,
                         what="the cancelled step's aborts")
        call.cancel()
        return [m for m in worker.received if m.WhichOneof("kind") in ("assign", "assigns", "abort")]
    finally:
        await worker.stop()
        await channel.close()
        await scheduler.stop(grace=0)


async def test_a_worker_that_reads_batches_gets_the_steps_assignments_in_one_message():
    msgs = await _held_then_cancelled({"assign_batches": True})
    kinds = [m.WhichOneof("kind") for m in msgs]
    assert kinds == ["assigns"] + ["abort"] * 8  # the whole first wave in one message, the aborts after it
    assert len(msgs[0].assigns.assignments) == 8
    assert sorted(m.abort.request_key for m in msgs[1:]) == sorted(a.request_key for a in msgs[0].assigns.assignments)


async def test_a_worker_that_did_not_say_it_reads_batches_gets_one_message_per_assignment():
    msgs = await _held_then_cancelled({})
    assert [m.WhichOneof("kind") for m in msgs] == ["assign"] * 8 + ["abort"] * 8


def _engine() -> LoadTestEngine:
    return LoadTestEngine(LoadEngineSettings(step_seconds=0.001, batch_slope_seconds=0.0, max_model_len=64,
                                             max_num_seqs=8, median_tokens=4, vocab_size=128))


def _entry(i: int, prompt=(5, 6, 7)) -> pb.Assignment:
    return pb.Assignment(request_key=f"s/p{i}/0", step_id="s", prompt_id=f"p{i}", sample_index=0,
                         prompt_token_ids=list(prompt), sampling=pb.SamplingParams(temperature=0.0, max_tokens=4),
                         group_size=1)


async def test_the_agent_refuses_a_bad_batch_entry_by_its_index_and_runs_the_others():
    engine = _engine()
    await engine.start()
    agent = WorkerAgent(WorkerSettings(worker_id="w", history_drafts=False), engine)
    assert agent.hello().accepts_assign_batches
    try:
        batch = pb.AssignBatch(assignments=[_entry(0), _entry(1), _entry(2, prompt=()), _entry(3)])
        await agent.handle(pb.SchedulerMessage(assigns=batch))
        got: dict[str, pb.WorkerMessage] = {}
        while len(got) < 4:
            msg = await asyncio.wait_for(agent.link.outbox.get(), 10)
            kind = msg.WhichOneof("kind")
            if kind == "completion":
                got[msg.completion.request_key] = msg
            elif kind == "aborted":
                got[msg.aborted.request_key] = msg
    finally:
        await agent.stop()
        await engine.shutdown()
    assert got["s/p2/0"].WhichOneof("kind") == "aborted"
    assert got["s/p2/0"].aborted.reason == "assigns[2]: prompt_token_ids is empty"
    assert all(got[f"s/p{i}/0"].WhichOneof("kind") == "completion" for i in (0, 1, 3))
    assert not agent.runner.tasks


async def test_the_worker_agent_gets_batches_from_the_real_scheduler_and_completes_every_request():
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1,
                                            core=CoreSettings(drafting=False)))
    await scheduler.start()
    engine = _engine()
    await engine.start()
    kinds: list[str] = []

    class Recording(WorkerAgent):
        async def handle(self, msg) -> None:
            kinds.append(msg.WhichOneof("kind"))
            await super().handle(msg)

    agent = Recording(WorkerSettings(scheduler=f"127.0.0.1:{scheduler.grpc_port}", worker_id="real", history_drafts=False,
                                     engine=EngineSettings(model="simulated", max_model_len=64, max_num_seqs=8)), engine)
    task = asyncio.create_task(agent.run())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.grpc_port}")
    try:
        await wait_until(lambda: "real" in scheduler.core.workers, what="the agent to join")
        assert scheduler.service.links["real"].accepts_assign_batches
        call = pbg.RolloutStub(channel).Generate(generate_request("s", PROMPTS, GREEDY, n=4), timeout=30)
        msgs = [m async for m in call]
    finally:
        await agent.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.shutdown()
        await channel.close()
        await scheduler.stop(grace=0)
    assert [m.WhichOneof("event") for m in msgs] == ["completion"] * 16 + ["summary"]
    assert len({(m.completion.prompt_id, m.completion.sample_index) for m in msgs[:-1]}) == 16
    assert kinds[0] == "assigns"  # the first wave (8 slots) in one message
