"""Every worker gone (``core/liveness.py``): a real scheduler, real gRPC and HTTP on loopback,
scripted workers (``tests/support/fake_worker.py``), ``no_worker_timeout_seconds`` of 1 s.

Checked: calls that wait when the last worker leaves are answered once, with HTTP 503 and gRPC
UNAVAILABLE naming the cause, once the timeout passed; new calls are refused so meanwhile; a
worker that connects resumes service, and the SDK's retry of the failed step (its default
``Retry``) runs it to the end with every completion once.

Before: those calls waited forever (the HTTP call until its client gave up)."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from bubblespec.client import AsyncRolloutClient, Retry, SamplingParams
from bubblespec.client.errors import ServiceUnavailable
from tests.integration.test_weight_transfer import CALM, started
from tests.support.fake_worker import FakeWorker, wait_until

TIMEOUT = 1.0
BODY = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}


def unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["message"].startswith("workers: no worker has been connected for"), err
    assert "no_worker_timeout_seconds" in err["message"], err


async def test_calls_fail_503_and_unavailable_once_no_worker_is_left_and_a_returning_worker_resumes_service():
    s = await started(core=dataclasses.replace(CALM, no_worker_timeout_seconds=TIMEOUT))
    target = f"127.0.0.1:{s.grpc_port}"
    first = await FakeWorker(target, "first", auto=False).start()  # holds what it is given
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.http_port}", timeout=30)
    once = AsyncRolloutClient(target, retry=Retry(attempts=1), timeout_seconds=10)
    sdk = AsyncRolloutClient(target)  # default retry: rides out the outage
    back: FakeWorker | None = None
    try:
        await wait_until(lambda: "first" in s.core.workers, what="first worker connected")
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        call = asyncio.create_task(http.post("/v1/completions", json={**BODY, "model": model}))
        step = asyncio.create_task(once.generate("s1", [(5, 6)], SamplingParams(temperature=0, max_tokens=3)))
        retried = asyncio.create_task(sdk.generate("s2", [(8, 9), (10, 11)], SamplingParams(temperature=0,
                                                                                          max_tokens=3)))
        await wait_until(lambda: len(first.assignments) == 4, what="the calls running on the first worker")
        await first.stop()  # every engine gone
        await wait_until(lambda: not s.core.workers, what="the first worker gone")
        await asyncio.sleep(TIMEOUT / 4)
        assert not call.done() and not step.done()  # within the timeout they wait for a worker
        unavailable(await call)
        with pytest.raises(ServiceUnavailable, match="no worker has been connected for"):
            await step
        unavailable(await http.post("/v1/completions", json={**BODY, "model": model}))  # new calls: refused
        with pytest.raises(ServiceUnavailable, match="no worker has been connected for"):
            await once.generate("s3", [(5, 6)], SamplingParams(temperature=0, max_tokens=3))
        assert not retried.done()  # the SDK retries UNAVAILABLE

        back = await FakeWorker(target, "back").start()  # answers at once
        await wait_until(lambda: "back" in s.core.workers, what="a worker back")
        r = await http.post("/v1/completions", json={**BODY, "model": model})
        assert r.status_code == 200, r.text
        result = await asyncio.wait_for(retried, 30)
        assert len({(c.prompt_id, c.sample_index) for c in result.completions}) == len(result.completions) == 2
        assert {c.worker_id for c in result.completions} == {"back"}
    finally:
        await http.aclose()
        await once.close()
        await sdk.close()
        if back is not None:
            await back.stop()
        await s.stop(1.0)
