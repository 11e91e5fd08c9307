"""``HotRoutes``: the generation routes served in front of FastAPI with FastAPI's own endpoints,
everything else (other methods, other paths, a trailing slash) by FastAPI as before, and an
endpoint's exception answered 500 and raised on, as Starlette's ``ServerErrorMiddleware`` does.
The real routes through the real server are covered by every HTTP integration test."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from bubblespec.scheduler.hot_routes import HOT_ROUTES, HotRoutes


def _app(calls: list) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        calls.append(("completions", request.headers.get("x-probe"), await request.json()))
        if (await request.json()).get("fail"):
            raise RuntimeError("boom")
        return JSONResponse({"ok": True}, headers={"x-answer": "1"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        calls.append(("chat", None, await request.json()))

        async def chunks():
            yield "data: 1\n\n"
            raise RuntimeError("mid-stream")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list"}

    return app


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://t")


async def test_the_hot_routes_run_fastapis_own_endpoints_and_the_rest_goes_to_fastapi(monkeypatch):
    calls: list = []
    app = _app(calls)
    hot = HotRoutes(app)
    assert set(hot.endpoints) == {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}
    through_fastapi: list = []
    original = FastAPI.__call__

    async def counting(self, scope, receive, send):
        through_fastapi.append((scope["method"], scope["path"]))
        await original(self, scope, receive, send)

    monkeypatch.setattr(FastAPI, "__call__", counting)
    async with _client(hot) as http:
        r = await http.post("/v1/completions", json={"a": 1}, headers={"x-probe": "p"})
        assert (r.status_code, r.json(), r.headers["x-answer"]) == (200, {"ok": True}, "1")
        assert calls == [("completions", "p", {"a": 1})] and through_fastapi == []
        assert (await http.get("/v1/models")).json() == {"object": "list"}
        assert (await http.get("/v1/completions")).status_code == 405  # another method: FastAPI's answer
        assert (await http.post("/v1/nothing", json={})).status_code == 404
        assert through_fastapi == [("GET", "/v1/models"), ("GET", "/v1/completions"), ("POST", "/v1/nothing")]


async def test_an_endpoints_exception_is_a_500_before_the_answer_and_raised_on():
    calls: list = []
    hot = HotRoutes(_app(calls))
    async with _client(hot) as http:
        r = await http.post("/v1/completions", json={"fail": True})
        assert (r.status_code, r.text) == (500, "Internal Server Error")
    sent: list = []
    bodies = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive():  # the body, then nothing until the stream ends (no disconnect)
        if bodies:
            return bodies.pop()
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
    with pytest.raises(RuntimeError, match="mid-stream"):  # the 200 went out: no second answer, the server logs it
        await hot(scope, receive, send)
    assert [m["type"] for m in sent][:2] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200 and not any(m.get("status") == 500 for m in sent)


def test_a_hot_route_must_take_the_bare_request():
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        return body

    with pytest.raises(TypeError, match="/v1/completions"):
        HotRoutes(app)


def test_the_scheduler_serves_each_hot_route():
    from types import SimpleNamespace

    from bubblespec.scheduler.core.settings import CoreSettings
    from bubblespec.scheduler.core.state import SchedulerCore
    from bubblespec.scheduler.http import create_app
    from bubblespec.scheduler.service import SchedulerService
    from bubblespec.scheduler.settings import SchedulerSettings

    service = SchedulerService(SchedulerCore(CoreSettings(), lambda: 0.0))
    scheduler = SimpleNamespace(settings=SchedulerSettings(), service=service, core=service.core, ready=True)
    hot = HotRoutes(create_app(scheduler))
    assert set(hot.endpoints) == set(HOT_ROUTES)
