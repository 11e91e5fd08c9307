"""Independent HTTP calls on the real core and asyncio shell, with scripted workers (no
engines): no step cap, 429 with ``Retry-After`` when the pool is full, callers that disconnect
(their requests are aborted on the workers), and many queued calls across ``/pause`` +
``/resume`` (each answered once, none lost)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from bubblespec.common.types import Prompt, SamplingParams
from bubblespec.scheduler.core.pool import POOL
from bubblespec.scheduler.core.validate import Limits, build_step

from tests.unit.test_control_routes import LIMITS, ScriptedWorker, assert_error, make_app


def body(i: int, **over) -> dict:
    return {"prompt": [5, 6 + i % 7], "max_tokens": 2, **over}


async def test_calls_far_beyond_the_step_cap_are_all_answered():
    http, scheduler = make_app()
    assert scheduler.core.settings.max_active_steps == 16
    async with http:
        workers = [ScriptedWorker(scheduler.service, w) for w in ("a", "b")]
        calls = [asyncio.create_task(http.post("/v1/completions", json=body(i))) for i in range(200)]
        while scheduler.core.pool.pending < 200:
            await asyncio.sleep(0)
        for w in workers:
            w.release.set()
        answers = await asyncio.gather(*calls)
        assert [r.status_code for r in answers] == [200] * 200
        assert all(r.json()["choices"][0]["text"] is not None for r in answers)
        assert scheduler.core.pool.pending == 0 and POOL not in scheduler.core.steps
        for w in workers:
            w.task.cancel()


async def test_a_full_pool_answers_429_with_retry_after_and_takes_nothing():
    http, scheduler = make_app()
    scheduler.core.settings = type(scheduler.core.settings)(max_pending_requests=4)
    async with http:
        workers = [ScriptedWorker(scheduler.service, "a")]
        held = [asyncio.create_task(http.post("/v1/completions", json=body(0, n=2))) for _ in range(2)]
        while scheduler.core.pool.pending < 4:
            await asyncio.sleep(0)
        for stream in (False, True):
            r = await http.post("/v1/completions", json=body(1, stream=stream))
            assert_error(r, 429, None, "max_pending_requests")
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "RateLimitError"
        assert scheduler.core.pool.pending == 4
        workers[0].release.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        workers[0].task.cancel()


async def _disconnect_after_assign(http, scheduler, worker, payload) -> str:
    """Start a call, wait until its request runs on ``worker``, then drop the connection."""
    call = asyncio.create_task(http.post("/v1/completions", json=payload))
    while not scheduler.core.workers["a"].running:
        await asyncio.sleep(0)
    [key] = scheduler.core.workers["a"].running
    call.cancel()
    try:
        await call
    except asyncio.CancelledError:
        pass
    return key


async def test_a_caller_that_disconnects_has_its_request_aborted_on_the_worker():
    for stream in (False, True):
        app, scheduler = make_app()
        # a real client's disconnect, through the ASGI transport: the call's task is cancelled
        async with app as http:
            worker = ScriptedWorker(scheduler.service, "a")
            key = await _disconnect_after_assign(http, scheduler, worker, body(0, stream=stream))
            for _ in range(100):
                if worker.aborts:
                    break
                await asyncio.sleep(0.01)
            assert worker.aborts == [key], stream
            assert scheduler.core.pool.pending == 0 and not scheduler.core.workers["a"].running
            worker.task.cancel()


def _asgi_call(path: str, payload: dict, gone: asyncio.Event):
    """(scope, receive, send, sent) of one POST whose caller sends ``payload``, then waits, and
    disconnects (ASGI's ``http.disconnect``) once ``gone`` is set, as uvicorn reports it."""
    messages = [{"type": "http.request", "body": json.dumps(payload).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "http_version": "1.1", "scheme": "http",
             "server": ("test", 80), "client": ("caller", 1), "root_path": ""}
    return scope, receive, send, sent


async def test_a_caller_whose_connection_drops_gets_nothing_and_its_request_is_aborted():
    """Not a cancelled task (the test above) but the server's ``http.disconnect`` while the call
    waits for its worker: the request is aborted there, the pool empties, no answer is sent but
    499 (as vLLM's ``with_cancellation``), and the next call is served."""
    http, scheduler = make_app()
    app = http._transport.app  # the scheduler's ASGI app (HotRoutes in front of FastAPI)
    worker = ScriptedWorker(scheduler.service, "a")
    gone = asyncio.Event()
    scope, receive, send, sent = _asgi_call("/v1/completions", body(0), gone)
    call = asyncio.create_task(app(scope, receive, send))
    while not scheduler.core.workers["a"].running:
        await asyncio.sleep(0)
    [key] = scheduler.core.workers["a"].running
    gone.set()
    await asyncio.wait({call}, timeout=10)  # (wait_for would cancel it, which the route also answers 499)
    assert call.done() and call.exception() is None
    assert worker.aborts == [key]
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [499]
    assert scheduler.core.pool.pending == 0 and not scheduler.core.workers["a"].running
    worker.release.set()
    async with http:
        r = await http.post("/v1/completions", json=body(1))
        assert r.status_code == 200 and len(r.json()["choices"]) == 1
    worker.task.cancel()


async def test_ten_thousand_queued_calls_across_pause_and_resume_each_answered_once():
    http, scheduler = make_app()
    calls = 10_000
    async with http:
        workers = [ScriptedWorker(scheduler.service, w) for w in ("a", "b")]
        tasks = [asyncio.create_task(http.post("/v1/completions", json=body(i, n=1 + i % 2, max_tokens=2 + i % 3)))
                 for i in range(calls)]
        while scheduler.core.pool.pending < sum(1 + i % 2 for i in range(calls)):
            await asyncio.sleep(0)
        assert (await http.post("/pause?mode=keep")).json() == {"status": "paused"}
        late = [asyncio.create_task(http.post("/v1/completions", json=body(i))) for i in range(50)]
        for _ in range(20):
            await asyncio.sleep(0)
        assert not any(t.done() for t in tasks + late)
        assert (await http.post("/resume")).json() == {"status": "resumed"}
        for w in workers:
            w.release.set()
        answers = await asyncio.gather(*tasks, *late)
        assert Counter(r.status_code for r in answers) == {200: calls + 50}
        for i, r in enumerate(answers[:calls]):
            choices = r.json()["choices"]
            assert [c["index"] for c in choices] == list(range(1 + i % 2))  # each choice once, none missing
        delivered = sum(len(r.json()["choices"]) for r in answers)
        assert delivered == sum(1 + i % 2 for i in range(calls)) + 50
        assert scheduler.core.pool.pending == 0 and not scheduler.service.callers
        for w in workers:
            w.task.cancel()


async def test_malformed_bodies_are_refused_naming_the_field_and_queue_nothing():
    http, scheduler = make_app()
    async with http:
        ScriptedWorker(scheduler.service, "a")
        r = await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = await http.post("/v1/completions", content=json.dumps([1, 2]))
        assert r.status_code == 400
        assert_error(await http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": -1}), 400, "max_tokens")
        assert_error(await http.post("/v1/completions", json={"prompt": list(range(5, 300))}), 400, "prompt")
        assert scheduler.core.pool.pending == 0 and POOL not in scheduler.core.steps


async def test_the_single_version_header_marks_the_calls_requests():
    http, scheduler = make_app()
    async with http:
        worker = ScriptedWorker(scheduler.service, "a")
        r = await http.post("/v1/completions", json=body(0), headers={"X-BubbleSpec-Single-Version": "maybe"})
        assert_error(r, 400, "X-BubbleSpec-Single-Version", "true or false")
        call = asyncio.create_task(http.post("/v1/completions", json=body(0, n=2),
                                             headers={"X-BubbleSpec-Single-Version": "true"}))
        while scheduler.core.pool.pending < 2:
            await asyncio.sleep(0)
        assert len(scheduler.core.pool.single_version) == 2
        worker.release.set()
        assert (await call).status_code == 200 and not scheduler.core.pool.single_version
        worker.task.cancel()


async def test_the_answer_id_comes_from_x_request_id_as_in_vllm():
    http, scheduler = make_app()
    async with http:
        worker = ScriptedWorker(scheduler.service, "a")
        worker.release.set()
        r = await http.post("/v1/completions", json=body(0, request_id="from-body"), headers={"X-Request-Id": "hdr-7"})
        assert r.json()["id"] == "cmpl-hdr-7"
        r = await http.post("/v1/completions", json=body(0, request_id="from-body"))
        assert r.json()["id"] == "cmpl-from-body"
        worker.task.cancel()


async def test_the_session_header_is_read_whatever_its_case_and_checked():
    http, scheduler = make_app()
    async with http:
        worker = ScriptedWorker(scheduler.service, "a")
        r = await http.post("/v1/completions", json=body(0), headers={"x-session-id": "s" * 257})
        assert_error(r, 400, "X-Session-ID", "at most 256")
        assert scheduler.core.pool.pending == 0
        call = asyncio.create_task(http.post("/v1/completions", json=body(0, n=2),
                                             headers=[("X-SESSION-ID", "conv-1"), ("x-session-id", "conv-2")]))
        while scheduler.core.pool.pending < 2:
            await asyncio.sleep(0)
        # the first of a repeated header, as Starlette's Headers.get reads it
        assert set(scheduler.core.pool.affinity.session_of.values()) == {"conv-1"}
        worker.release.set()
        assert (await call).status_code == 200
        worker.task.cancel()


async def test_calls_that_join_in_one_turn_of_the_loop_share_one_dispatch():
    _, scheduler = make_app()
    service, core = scheduler.service, scheduler.core
    worker = ScriptedWorker(service, "a")
    worker.release.set()
    dispatches = []  # the requests queued at each dispatch
    real = core.dispatch

    def dispatch():
        dispatches.append(len(core.pool.step.shared))
        return real()

    core.dispatch = dispatch

    async def call(i: int) -> list[int]:
        spec = build_step(step_id=f"c{i}", policy_version=0, prompts=[Prompt("p0", token_ids=(5, 6 + i))],
                          sampling=SamplingParams(temperature=0.0, max_tokens=2), limits=Limits(), model=LIMITS)
        return [index async for index, _ in service.run_requests(spec)]

    answers = await asyncio.gather(*(call(i) for i in range(20)))  # 20 calls, each submitted in the same turn
    assert answers == [[0]] * 20 and core.pool.pending == 0
    assert dispatches == [20]  # one dispatch for all of them; the worker's completions refill it after
    worker.task.cancel()
