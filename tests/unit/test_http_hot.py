"""The completions routes served in front of FastAPI (``scheduler/http_hot.py``): the app's own
handlers, the same answers and refusals as through FastAPI, the rest left to the app, a
disconnecting caller's request aborted, a handler's exception a 500 that propagates."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from bubblespec.scheduler.core.state import CoreSettings, SchedulerCore
from bubblespec.scheduler.http import create_app
from bubblespec.scheduler.http_hot import HOT_PATHS, HotRoutes, hot_routes
from bubblespec.scheduler.service import SchedulerService
from bubblespec.scheduler.settings import SchedulerSettings
from starlette.responses import JSONResponse

from tests.unit.test_control_routes import ScriptedWorker
from tests.unit.test_http_requests import _disconnect_after_assign


def apps(token: str = ""):
    service = SchedulerService(SchedulerCore(CoreSettings(), lambda: 0.0))
    scheduler = SimpleNamespace(settings=SchedulerSettings(trainer_token=token), service=service, core=service.core,
                                ready=True)
    app = create_app(scheduler)
    return app, hot_routes(app), scheduler


def client(asgi) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://test")


def test_the_hot_routes_are_the_apps_own_handlers():
    app, hot, _ = apps()
    assert sorted(hot.endpoints) == sorted(HOT_PATHS)
    for path, endpoint in hot.endpoints.items():
        assert [r.endpoint for r in app.routes if getattr(r, "path", None) == path] == [endpoint]


async def test_answers_and_refusals_are_those_of_the_app():
    """Every answer byte for byte, headers included, before a worker joined (503) and after
    (the fields' refusals; a valid call's answer has an id and a time of its own)."""
    calls = [("POST", "/v1/completions", {"prompt": [5, 6], "bogus": 1}, {}),
             ("POST", "/v1/completions", {"prompt": [5, 6], "model": "other"}, {}),
             ("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": -1}, {}),
             ("POST", "/v1/completions", {"prompt": []}, {}),
             ("POST", "/v1/completions", b"{not json", {}),
             ("POST", "/v1/completions", {"prompt": [5, 6]}, {"X-BubbleSpec-Single-Version": "maybe"}),
             ("POST", "/v1/chat/completions", {"messages": "hi"}, {}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, {}),
             ("POST", "/inference/v1/generate", {"token_ids": "x"}, {}),
             ("GET", "/v1/completions", None, {}),  # 405 from the app's router
             ("POST", "/v1/completions/", {"prompt": [5, 6]}, {}),  # the router's redirect
             ("POST", "/tokenize", {"prompt": "x"}, {}),
             ("GET", "/healthz", None, {})]
    seen = set()
    for token in ("", "secret"):
        app, hot, scheduler = apps(token)
        async with client(app) as plain, client(hot) as fast:
            for with_worker in (False, True):
                if with_worker:
                    worker = ScriptedWorker(scheduler.service, "a")
                for method, path, payload, headers in calls:
                    kw = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
                    a = await plain.request(method, path, headers=headers, **kw)
                    b = await fast.request(method, path, headers=headers, **kw)
                    assert (b.status_code, b.content) == (a.status_code, a.content), (token, method, path)
                    assert dict(b.headers) == dict(a.headers), (token, path)
                    seen.add(a.status_code)
            worker.task.cancel()
    assert {200, 307, 400, 401, 404, 405, 503} <= seen, seen


async def test_a_call_and_a_stream_are_answered_through_the_hot_route():
    _, hot, scheduler = apps()
    async with client(hot) as http:
        worker = ScriptedWorker(scheduler.service, "a")
        worker.release.set()
        r = await http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "n": 2},
                            headers={"X-Request-Id": "r1"})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["id"] == "cmpl-r1" and [c["index"] for c in answer["choices"]] == [0, 1]
        r = await http.post("/v1/completions", json={"prompt": [5, 7], "max_tokens": 2, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.text.endswith("data: [DONE]\n\n")
        assert scheduler.core.pool.pending == 0
        worker.task.cancel()


async def test_a_caller_that_disconnects_has_its_request_aborted_through_the_hot_route():
    for stream in (False, True):
        _, hot, scheduler = apps()
        async with client(hot) as http:
            worker = ScriptedWorker(scheduler.service, "a")
            key = await _disconnect_after_assign(http, scheduler, worker, {"prompt": [5, 6], "max_tokens": 2,
                                                                            "stream": stream})
            for _ in range(100):
                if worker.aborts:
                    break
                await asyncio.sleep(0.01)
            assert worker.aborts == [key], stream
            assert scheduler.core.pool.pending == 0 and not scheduler.core.workers["a"].running
            worker.task.cancel()


async def test_a_handler_exception_answers_500_and_propagates():
    async def boom(request):
        raise RuntimeError("boom")

    hot = HotRoutes(JSONResponse({"other": "routes"}), {"/x": boom})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=hot, raise_app_exceptions=False),
                                 base_url="http://test") as http:
        r = await http.post("/x")
        assert (r.status_code, r.text) == (500, "Internal Server Error")
        assert (await http.get("/x")).json() == {"other": "routes"}
    async with client(hot) as http:
        with pytest.raises(RuntimeError, match="boom"):
            await http.post("/x")
