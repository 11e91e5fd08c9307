"""The scheduler's busiest HTTP routes, served in front of the FastAPI app as plain ASGI.

``POST /v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate`` carry the
load of an RL run (thousands of calls at once). Through FastAPI each call also paid for its
middleware stack (an exception wrapper and an exit stack per request), the router's match over
every route, and FastAPI's dependency solving for a handler that takes nothing but the request:
about a third of the scheduler's CPU per call in ``bubblespec loadtest --http`` (docs/LOAD.md).
``hot_routes`` wraps the app: a request for one of those paths and methods goes straight to
the very handler the app registered for it (found in ``app.routes``, so the routes modules stay
the one definition of what they do), with a Starlette ``Request``; anything else goes to the
app unchanged (other routes, other methods and their 405, a ``root_path``). An exception from
a handler answers 500 ``Internal Server Error`` and propagates, as Starlette's
``ServerErrorMiddleware`` does. A handler that takes more than the request (a FastAPI
dependency, a ``Header`` parameter) is left to FastAPI.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

__all__ = ["HOT_PATHS", "HotRoutes", "hot_routes"]

HOT_PATHS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
"""The POST routes served without FastAPI's per-request machinery."""

Endpoint = Callable[[Request], Awaitable[Response]]


def hot_routes(app: Any, paths: tuple[str, ...] = HOT_PATHS) -> HotRoutes:
    """``app`` (FastAPI) behind ``HotRoutes`` for those of ``paths`` it serves with POST by a
    handler of one parameter, the request."""
    endpoints: dict[str, Endpoint] = {}
    for route in app.routes:
        if (isinstance(route, APIRoute) and route.path in paths and "POST" in route.methods
                and len(inspect.signature(route.endpoint).parameters) == 1):
            endpoints.setdefault(route.path, route.endpoint)  # the first match, as the router's
    return HotRoutes(app, endpoints)


class HotRoutes:
    """ASGI: ``endpoints`` (path -> the app's handler) for POST, ``app`` for the rest."""

    def __init__(self, app: Any, endpoints: dict[str, Endpoint]) -> None:
        self.app = app
        self.endpoints = endpoints

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self.endpoints.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self.app  # what Starlette sets for request.app
                try:
                    response = await endpoint(Request(scope, receive, send))
                except Exception:
                    await PlainTextResponse("Internal Server Error", status_code=500)(scope, receive, send)
                    raise
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
