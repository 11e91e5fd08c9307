"""The worker's small HTTP server: /healthz (engine up) and /metrics."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Response

__all__ = ["start_http"]


async def start_http(agent, port: int):
    import uvicorn

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
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    asyncio.create_task(server.serve())
    return server
