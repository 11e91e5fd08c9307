"""The scheduler's HTTP/2 ping policy lets trainers and workers keep their connections checked.

gRPC servers by default answer a client that pings more than once per 5 minutes without data
with GOAWAY ``too_many_pings``; a trainer waiting on a long step (no completion for a while) would
see its stream cut. The scheduler accepts pings every ``min_client_ping_seconds`` (2 s); the SDK
and workers ping every 5 s by default. No vLLM here: a scripted worker holds the step quiet.
"""

from __future__ import annotations

import asyncio

from bubblespec.client import AsyncRolloutClient, ClientSettings, Retry, SamplingParams
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from tests.support.fake_worker import FakeWorker, fake_tokens, wait_until


async def test_quiet_stream_with_keepalive_pings_is_not_cut():
    sched = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1))
    await sched.start()
    target = f"127.0.0.1:{sched.grpc_port}"
    # no retries: a GOAWAY would surface as ServiceUnavailable; pings at the fastest rate allowed
    settings = ClientSettings(target=target, retry=Retry(attempts=1), keepalive_seconds=2.5)
    try:
        async with FakeWorker(target, "fw-quiet", auto=False) as fw, AsyncRolloutClient(settings=settings) as sdk:
            await wait_until(lambda: "fw-quiet" in sched.core.workers, what="the worker to join")
            task = asyncio.create_task(sdk.generate("quiet", [(5, 6, 7)], SamplingParams(temperature=0, max_tokens=4)))
            await wait_until(lambda: fw.assignments or task.done(), what="the assignment")
            await asyncio.sleep(16)  # the stimulus: a stream without data for 6 ping periods (gRPC's default cuts at 4-5)
            fw.complete_all()
            result = await asyncio.wait_for(task, 10)
    finally:
        await sched.stop(grace=0)
    assert [c.token_ids for c in result.completions] == [fake_tokens((5, 6, 7), 4)]
