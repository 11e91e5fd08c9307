"""The SDK's ``complete`` (gRPC ``Complete``: independent requests, no step) with both twins,
against the real scheduler over gRPC loopback and a scripted worker (no model): more calls at
once than the step cap, each answered with its own prompt ids once, a full pool refused and
retried, a cancelled call aborted on the worker."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client import AsyncRolloutClient, ClientSettings, InvalidArgument, Retry, RolloutClient, SamplingParams
from bubblespec.client.errors import ResourceExhausted
from bubblespec.client._base import make_complete_request
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from tests.support.fake_worker import FakeWorker, fake_tokens, wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


async def _cluster(**core):
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1,
                                            core=CoreSettings(drafting=False, max_active_steps=2, **core)))
    await scheduler.start()
    worker = await FakeWorker(f"127.0.0.1:{scheduler.grpc_port}", "fw-c", capacity=8).start()
    await wait_until(lambda: "fw-c" in scheduler.core.workers, what="the worker to join")
    return scheduler, worker


async def test_async_twin_runs_many_calls_beyond_the_step_cap_each_answered_once_in_prompt_order():
    scheduler, worker = await _cluster()
    try:
        async with AsyncRolloutClient(f"127.0.0.1:{scheduler.grpc_port}") as client:
            calls = [client.complete([(5, 6 + i), (7, 8 + i)], GREEDY, n=2) for i in range(20)]  # 10x the step cap
            results = await asyncio.gather(*calls)
        for i, got in enumerate(results):
            assert [(c.prompt_id, c.sample_index) for c in got] == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]
            assert [c.token_ids for c in got[::2]] == [fake_tokens((5, 6 + i), 4), fake_tokens((7, 8 + i), 4)]
            assert all(c.step_id == "" and c.policy_version == 0 for c in got)
        assert scheduler.core.step("requests") is None
    finally:
        await worker.stop()
        await scheduler.stop(grace=0)


async def test_sync_twin_and_a_full_pool():
    scheduler, worker = await _cluster(max_pending_requests=1)
    target = f"127.0.0.1:{scheduler.grpc_port}"
    try:
        got = await asyncio.to_thread(lambda: RolloutClient(target).complete([(5, 6)], GREEDY))
        assert [c.token_ids for c in got] == [fake_tokens((5, 6), 4)]
        settings = ClientSettings(target=target, retry=Retry(attempts=1))
        with pytest.raises(ResourceExhausted, match="max_pending_requests"):
            await asyncio.to_thread(lambda: RolloutClient(settings=settings).complete([(5, 6)], GREEDY, n=2))
        with pytest.raises(InvalidArgument, match="single_version"):
            make_complete_request([(5, 6)], GREEDY, single_version="yes")
    finally:
        await worker.stop()
        await scheduler.stop(grace=0)


async def test_a_cancelled_call_is_aborted_on_the_worker():
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1,
                                            core=CoreSettings(drafting=False)))
    await scheduler.start()
    worker = await FakeWorker(f"127.0.0.1:{scheduler.grpc_port}", "fw-h", capacity=8, auto=False).start()
    try:
        await wait_until(lambda: "fw-h" in scheduler.core.workers, what="the worker to join")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.grpc_port}") as channel:
            call = pbg.RolloutStub(channel).Complete(make_complete_request([(5, 6)], GREEDY, n=2), timeout=30)
            await wait_until(lambda: len(worker.assignments) == 2, what="both requests to be assigned")
            call.cancel()
            await wait_until(lambda: scheduler.core.step("requests") is None, what="the pool to let go of them")
            await wait_until(lambda: not worker.assignments, what="the worker to be told to abort both")
    finally:
        await worker.stop()
        await scheduler.stop(grace=0)
