"""The per-call routes in front of FastAPI: ``HotRoutes`` wraps the scheduler's ASGI app and
calls the endpoints of ``HOT_ROUTES`` itself, with Starlette's own ``Request`` and ``Response``.

Every ``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate`` call otherwise
went through Starlette's middleware stack, FastAPI's router (a regular-expression match against
each route in turn), its dependency solver and its endpoint wrapper: about a quarter of the
scheduler's CPU per call under the HTTP load test (docs/LOAD.md). Those endpoints take the bare
``Request`` and return a ``Response``, so nothing of that is needed for them.

The endpoints are FastAPI's own (found in the app's routes by method and path, so each route is
written once and stays listed there); any other method or path, or a path with a trailing
slash, goes to FastAPI as before. An exception out of an endpoint is answered 500 ``Internal
Server Error`` and raised on to the server (which logs it), as Starlette's
``ServerErrorMiddleware`` does.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from starlette.types import Message, Receive, Scope, Send

__all__ = ["HOT_ROUTES", "HotRoutes"]

HOT_ROUTES = (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/inference/v1/generate"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/chat/completions/render"))
"""(method, path) of the routes served in front of FastAPI: the generation routes, and the
tokenizer and render routes that trainers call once per rollout or turn (SkyRL detokenizes
every output)."""

Endpoint = Callable[[Request], Awaitable[Response]]


class HotRoutes:
    """ASGI app: ``HOT_ROUTES`` served directly, everything else by ``app`` (module docstring)."""

    def __init__(self, app: FastAPI, routes: tuple[tuple[str, str], ...] = HOT_ROUTES):
        self.app = app
        self.endpoints: dict[tuple[str, str], Endpoint] = {}
        for route in app.routes:
            if not isinstance(route, APIRoute):
                continue
            for method in route.methods:
                if (method, route.path) in routes:
                    self.endpoints[(method, route.path)] = _bare(route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        scope["app"] = self.app
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            response = await endpoint(Request(scope, receive, send))
            await response(scope, receive, sending)
        except Exception:
            if not started:
                await PlainTextResponse("Internal Server Error", status_code=500)(scope, receive, send)
            raise


def _bare(route: APIRoute) -> Endpoint:
    """``route``'s endpoint, which must be a coroutine function of one ``Request`` (what the hot
    routes are written as); anything else is a programming error, raised at start."""
    fn = route.endpoint
    params = list(inspect.signature(fn, eval_str=True).parameters.values())
    if not inspect.iscoroutinefunction(fn) or len(params) != 1 or params[0].annotation is not Request:
        raise TypeError(f"{route.path}: a hot route's endpoint must be `async def (request: Request) -> Response`, "
                        f"got {fn.__qualname__}{inspect.signature(fn)}")
    return fn
