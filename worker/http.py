"""The worker's small HTTP server: /healthz (engine up) and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Response

if TYPE_CHECKING:
    from bubblespec.worker.agent import WorkerAgent

__all__ = ["SignalFreeServer", "start_http"]


class SignalFreeServer(uvicorn.Server):
    """uvicorn's server without its SIGINT/SIGTERM handlers: the process's own handlers stop it
    (``worker/main.py``, the scheduler's ``run``). uvicorn (>= 0.29) otherwise takes both signals
    while it serves: the first SIGTERM then closes the HTTP port at once, while the process still
    drains, and is raised again when uvicorn has stopped. (The scheduler's HTTP server has its
    own twin: the scheduler and the worker import nothing of each other's.)"""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def start_http(agent: WorkerAgent, port: int) -> uvicorn.Server:
    app = FastAPI(title="BubbleSpec worker", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True, "connected": agent.link.connected.is_set(), "policy_version": agent.weights.version}

    @app.get("/metrics")
    def metrics() -> Response:
        from bubblespec.worker.metrics import render

        body, content_type = render(agent)
        return Response(body, media_type=content_type)

    server = SignalFreeServer(uvicorn.Config(app, host="0.0.0.0", port=port, log_level="warning", lifespan="off"))
    asyncio.create_task(server.serve())
    return server
