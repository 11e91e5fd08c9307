"""Poison requests: a request that fails on every worker ends its step with an error; a
request too big for any worker is refused up front. Real scheduler and real gRPC on loopback
throughout; real vLLM CPU workers (the session ``cluster``) for the refusal, scripted workers
(``tests/support/fake_worker.py``) and worker agents on simulated engines for the failures.

Before: a 5 MiB stop string passed validation; its 5.2 MB assignment exceeded the workers'
4 MiB gRPC receive limit, so each worker's stream broke, the worker reconnected, and the
request was re-queued with no attempt limit, going round every worker and wiping their
in-flight work each time; the trainer's call never ended.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bubblespec.client import AsyncRolloutClient, FatalError, InvalidArgument, Prompt, SamplingParams
from bubblespec.client.errors import PreconditionFailed
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.validate import Limits
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.worker.agent import WorkerAgent, stop_agents
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.engine import EngineSettings
from bubblespec.bench.load_engine import LoadEngineSettings, LoadTestEngine
from tests.support.fake_worker import FakeWorker, fake_tokens, wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
CALM = CoreSettings(drafting=False, worker_timeout_seconds=3600, stall_seconds=3600)


async def started(limits: Limits | None = None, **settings) -> Scheduler:
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1, drain_seconds=1.0,
                                            limits=limits or Limits(), core=CALM, **settings))
    await scheduler.start()
    return scheduler


def target(scheduler: Scheduler) -> str:
    return f"127.0.0.1:{scheduler.grpc_port}"


def connected(scheduler: Scheduler) -> set[str]:
    return set(scheduler.core.workers) & set(scheduler.service.links)


async def test_a_request_failing_on_every_worker_fails_its_step_and_nothing_else():
    scheduler = await started()

    def fail(a):
        return "engine error: illegal memory access" if a.prompt_id == "poison" else None

    workers = [FakeWorker(target(scheduler), f"fw-{i}", fail=fail) for i in range(3)]
    prompts = [Prompt("ok0", token_ids=(5, 6)), Prompt("poison", token_ids=(7, 8)), Prompt("ok1", token_ids=(9, 10))]
    try:
        for w in workers:
            await w.start()
        await wait_until(lambda: connected(scheduler) == {"fw-0", "fw-1", "fw-2"}, what="three workers")
        async with AsyncRolloutClient(target(scheduler), timeout_seconds=10) as client:  # default retries
            with pytest.raises(PreconditionFailed) as err:
                await asyncio.wait_for(client.generate("poisoned", prompts, GREEDY), 30)
            e = err.value
            assert isinstance(e, FatalError) and e.code == grpc.StatusCode.FAILED_PRECONDITION
            assert e.field == "prompts[1]" and e.message.startswith("prompts[1]: prompt 'poison' sample 0 failed 3 attempts")
            assert "engine error: illegal memory access" in e.message
            assert sorted(k for w in workers for k in w.failed) == ["poisoned/poison/0"] * 3
            assert all(w.failed for w in workers), "one attempt on each worker"
            step = scheduler.core.steps["poisoned"]
            assert not step.active and step.failure is not None and step.summary is None
            assert connected(scheduler) == {"fw-0", "fw-1", "fw-2"}, "the workers stay connected"
            assert scheduler.metrics.tally.steps_failed == 1  # bubblespec_steps_failed_total

            with pytest.raises(PreconditionFailed) as again:  # resume: the same failure, not a re-run
                await client.generate("poisoned", prompts, GREEDY)
            assert again.value.message == e.message
            assert sum(len(w.failed) for w in workers) == 3

            result = await asyncio.wait_for(client.generate("after", [(5, 6), (7, 9)], GREEDY, n=2), 30)
            assert [c.token_ids for c in result.completions] == [fake_tokens((5, 6), 4)] * 2 + [fake_tokens((7, 9), 4)] * 2
            assert result.summary.completions == 4
    finally:
        for w in workers:
            await w.stop()
        await scheduler.stop(1.0)


async def test_an_assignment_too_big_for_the_workers_fails_the_step_not_the_cluster():
    """The old failure itself, on a scheduler whose limits were loosened past what its workers
    accept (``WorkerSettings.max_message_bytes`` 64 KiB): each worker's stream breaks on the
    assignment and it reconnects; after three broken attempts the step fails."""
    scheduler = await started(Limits(max_stop_string_bytes=2**20))
    agents, tasks, engines = [], [], []
    try:
        for i in range(2):
            engine = LoadTestEngine(LoadEngineSettings(vocab_size=128, max_model_len=512, step_seconds=0.001,
                                                       median_tokens=4, seed=i))
            await engine.start()
            ws = WorkerSettings(scheduler=target(scheduler), worker_id=f"w{i}", max_message_bytes=64 * 1024,
                                heartbeat_seconds=0.2, reconnect_initial_seconds=0.05, reconnect_max_seconds=0.2,
                                engine=EngineSettings(model="simulated", max_model_len=512, max_num_seqs=4))
            engines.append(engine)
            agents.append(WorkerAgent(ws, engine))
            tasks.append(asyncio.create_task(agents[-1].run()))
        await wait_until(lambda: connected(scheduler) == {"w0", "w1"}, what="two workers")
        async with AsyncRolloutClient(target(scheduler), timeout_seconds=10) as client:
            huge = SamplingParams(temperature=0.0, max_tokens=4, stop=("x" * 200_000,))
            with pytest.raises(PreconditionFailed) as err:
                await asyncio.wait_for(client.generate("too-big", [(5, 6, 7)], huge), 60)
            assert err.value.field == "prompts[0]" and "3 attempts" in err.value.message
            assert "w0" in err.value.message and "w1" in err.value.message
            await wait_until(lambda: connected(scheduler) == {"w0", "w1"}, what="the workers to reconnect")
            result = await asyncio.wait_for(client.generate("fine", [(5, 6, 7), (8, 9)], GREEDY), 60)
            assert result.summary.completions == 2
    finally:
        await stop_agents(agents, tasks)
        for engine in engines:
            await engine.shutdown()
        await scheduler.stop(1.0)


def poison_only(a) -> str | None:
    return "engine error: illegal memory access" if a.prompt_id == "poison" else None


async def test_a_failed_step_stays_failed_after_a_scheduler_restart(redis_server):
    """The failure is journaled (with its MAC): a scheduler restarted on the same Redis answers a
    resume with the same failure and runs nothing again."""
    journaled = {"redis_url": redis_server.url, "journal_secret": "poison-test-journal-secret-0123"}
    prompts = [Prompt("ok0", token_ids=(5, 6)), Prompt("poison", token_ids=(7, 8))]
    first = await started(**journaled)
    workers = [FakeWorker(target(first), f"fw-{i}", fail=poison_only) for i in range(3)]
    try:
        for w in workers:
            await w.start()
        await wait_until(lambda: len(connected(first)) == 3, what="three workers")
        async with AsyncRolloutClient(target(first), timeout_seconds=10) as client:
            with pytest.raises(PreconditionFailed) as err:
                await asyncio.wait_for(client.generate("poisoned-journaled", prompts, GREEDY), 30)
        await first.service.journal.flush()
    finally:
        for w in workers:
            await w.stop()
        await first.stop(1.0)
    second = await started(**journaled)
    witness = FakeWorker(target(second), "fw-witness", fail=poison_only)
    try:
        await witness.start()
        await wait_until(lambda: connected(second) == {"fw-witness"}, what="a worker")
        async with AsyncRolloutClient(target(second), timeout_seconds=10) as client:
            with pytest.raises(PreconditionFailed) as again:
                await asyncio.wait_for(client.generate("poisoned-journaled", prompts, GREEDY), 30)
        assert again.value.message == err.value.message and again.value.field == "prompts[1]"
        assert not any(m.WhichOneof("kind") == "assign" for m in witness.received), "nothing ran again"
    finally:
        await witness.stop()
        await second.stop(1.0)


def _state(scheduler: Scheduler) -> dict:
    core = scheduler.core
    return {"version": core.version, "links": sorted(scheduler.service.links),
            "workers": {wid: (w.version, tuple(sorted(w.running)), tuple(w.private)) for wid, w in core.workers.items()},
            "steps": {sid: (s.active, len(s.completions), tuple(s.shared)) for sid, s in core.steps.items()},
            "delivered": scheduler.metrics.tally.completions}


async def test_a_5_mib_stop_string_is_refused_before_any_vllm_worker_sees_it(cluster, client):
    scheduler = cluster.scheduler
    before = _state(scheduler)
    version = scheduler.core.version
    poison = SamplingParams(temperature=0.0, max_tokens=8, stop=("x" * (5 * 2**20),))
    with pytest.raises(InvalidArgument) as err:
        await client.generate("poison-stop", [(5, 6, 7)], poison, policy_version=version)
    assert err.value.field == "sampling.stop[0]"
    assert err.value.message.startswith("sampling.stop[0]: is 5242880 bytes; at most 1024")
    assert _state(scheduler) == before
    assert "poison-stop" not in scheduler.core.steps
    result = await client.generate("after-poison-stop", [(5, 6, 7)], SamplingParams(temperature=0.0, max_tokens=8),
                                   policy_version=version)
    assert len(result.completions) == 1 and result.completions[0].token_ids
