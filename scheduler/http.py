"""HTTP side of the scheduler (FastAPI): health, readiness, status, metrics, UI, and the
OpenAI-compatible routes of ``openai_api``, the vLLM-compatible RL control routes of ``rl_api``
and vLLM's token-in/token-out and tokenizer routes of ``tokens_api``.

``/status`` and ``/ui`` need the trainer token when the scheduler has one (``auth.http_refusal``);
``/healthz``, ``/readyz`` and ``/metrics`` are open. ``/status`` sends the document that
``StatusView`` keeps (rebuilt at most every ``status_max_age_seconds``), as JSON bytes:
FastAPI's own encoding of a large dict took seconds of event-loop time at 1,024 workers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse

if TYPE_CHECKING:
    from bubblespec.scheduler.app import SchedulerApp

__all__ = ["SignalFreeServer", "create_app"]


class SignalFreeServer(uvicorn.Server):
    """uvicorn's server without its SIGINT/SIGTERM handlers: the scheduler's own (``server.run``)
    drain the steps first, then stop it (``Scheduler.stop``). uvicorn (>= 0.29) otherwise takes
    both signals while it serves: the first SIGTERM then closed the HTTP port (readiness, the
    OpenAI routes) at once, during the drain, and was raised again once uvicorn had stopped.
    (The worker's HTTP server has its own twin: the scheduler and the worker import nothing of
    each other's.)"""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def create_app(scheduler: SchedulerApp) -> FastAPI:
    from bubblespec.scheduler.openai_api import create_router
    from bubblespec.scheduler.openai_chat import ChatCompletions

    app = FastAPI(title="BubbleSpec scheduler", docs_url=None, redoc_url=None)
    # /health, /v1/models, /v1/completions, /v1/chat/completions (docs/INTEGRATIONS.md)
    app.include_router(create_router(scheduler, chat=ChatCompletions))
    from bubblespec.scheduler.rl_api import create_router as create_rl_router

    app.include_router(create_rl_router(scheduler))  # /pause, /resume, /update_weights, ... (docs/INTEGRATIONS.md)
    from bubblespec.scheduler.tokens_api import create_router as create_tokens_router

    app.include_router(create_tokens_router(scheduler))  # /inference/v1/generate, /tokenize, /detokenize
    from bubblespec.scheduler.prime_rl_routes import create_router as create_prime_rl_router

    app.include_router(create_prime_rl_router(scheduler))  # prime-rl's /liveness, /init_broadcaster (refused)
    from bubblespec.scheduler.weight_transfer import create_router as create_transfer_router

    # /init_weight_transfer_engine, /start_weight_update, /finish_weight_update, /reset_prefix_cache,
    # /collective_rpc (SkyRL's weight sync), /abort_weight_update
    app.include_router(create_transfer_router(scheduler))
    from bubblespec.scheduler.lora_api import create_router as create_lora_router

    app.include_router(create_lora_router(scheduler))  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    from bubblespec.scheduler.sleep_api import create_router as create_sleep_router

    app.include_router(create_sleep_router(scheduler))  # /sleep, /wake_up, /is_sleeping
    from bubblespec.scheduler.render_api import create_router as create_render_router

    app.include_router(create_render_router(scheduler))  # /v1/chat/completions/render

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> Response:
        ok = scheduler.ready
        return JSONResponse({"ready": ok, "workers": scheduler.service.core.worker_count}, status_code=200 if ok else 503)

    def refused(request: Request) -> Response | None:
        from bubblespec.scheduler.auth import http_refusal

        refusal = http_refusal(request.headers.get("authorization"), request.query_params.get("token"),
                               scheduler.settings.trainer_token)
        if refusal is None:
            return None
        code, message = refusal
        return JSONResponse({"error": message}, status_code=code, headers={"WWW-Authenticate": "Bearer"})

    @app.get("/status")
    async def status(request: Request) -> Response:
        if (refusal := refused(request)) is not None:
            return refusal
        return Response((await scheduler.status.document()).body, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        from bubblespec.scheduler.metrics import render

        body, content_type = render(scheduler)
        return Response(body, media_type=content_type)

    @app.get("/ui")
    def ui(request: Request) -> Response:
        from bubblespec.scheduler.ui import PAGE

        if (refusal := refused(request)) is not None:
            return refusal
        return HTMLResponse(PAGE)

    return app
