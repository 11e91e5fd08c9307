"""The worker's small HTTP server: /healthz (engine up) and /metrics."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Response

if TYPE_CHECKING:
    from bubblespec.worker.agent import WorkerAgent

__all__ = ["start_http"]


async def start_http(agent: WorkerAgent, port: int) -> uvicorn.Server:
    app = FastAPI(title="BubbleSpec worker", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True, "connected": agent.connected.is_set(), "policy_version": agent.version}

    @app.get("/metrics")
    def metrics() -> Response:
        from bubblespec.worker.metrics import render

        body, content_type = render(agent)
        return Response(body, media_type=content_type)

    server = uvicorn.Server(uvicorn.Config(app, host="0.0.0.0", port=port, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]
    asyncio.create_task(server.serve())
    return server
