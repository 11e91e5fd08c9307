"""HTTP side of the scheduler (FastAPI): health, readiness, status, metrics, UI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Response
from fastapi.responses import HTMLResponse, JSONResponse

if TYPE_CHECKING:
    from bubblespec.scheduler.server import Scheduler

__all__ = ["create_app"]


def create_app(scheduler: Scheduler) -> FastAPI:
    app = FastAPI(title="BubbleSpec scheduler", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> Response:
        ok = scheduler.ready
        return JSONResponse({"ready": ok, "workers": len(scheduler.core.workers)}, status_code=200 if ok else 503)

    @app.get("/status")
    async def status() -> dict:
        return scheduler.core.status()

    @app.get("/metrics")
    async def metrics() -> Response:
        from bubblespec.scheduler.metrics import render

        body, content_type = render(scheduler)
        return Response(body, media_type=content_type)

    @app.get("/ui")
    def ui() -> HTMLResponse:
        from bubblespec.scheduler.ui import PAGE

        return HTMLResponse(PAGE)

    return app
