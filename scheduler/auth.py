"""Gate of the gRPC port: bearer-token authentication, and refusal of undecodable requests.

Trainers and workers hold separate tokens. Health checks and reflection stay open (probes
carry no token). A call to the trainer API with the worker token, or the reverse, is refused:
roles do not mix. Bytes that do not parse as the method's request message are answered
INVALID_ARGUMENT naming ``request`` (grpc's default would be UNKNOWN and an error traceback).

HTTP: ``/status`` and ``/ui`` take the trainer token (``http_refusal``); ``/healthz``,
``/readyz`` and ``/metrics`` stay open for probes and Prometheus.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

__all__ = ["TokenAuthInterceptor", "http_refusal"]

_TRAINER_PREFIX = "/bubblespec.v1.Rollout/"
_WORKER_PREFIX = "/bubblespec.v1.WorkerLink/"


async def _settle(requests: AsyncIterator[Any]) -> None:
    """Let a streaming client's opening burst (hello, first heartbeat) land before refusing:
    a grpc-python client still writing when the status arrives reports its failed write
    (INTERNAL) instead of the status. Reads until 0.25 s pass quietly, 2 s at most."""
    it = aiter(requests)
    with contextlib.suppress(Exception):
        async with asyncio.timeout(2.0):
            while True:
                await asyncio.wait_for(anext(it), 0.25)


def _deny(code: grpc.StatusCode, message: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: Any) -> None:
        await context.abort(code, message)

    async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # pragma: no cover

    async def client_streaming(requests: AsyncIterator[Any], context: Any) -> None:
        await _settle(requests)
        await context.abort(code, message)

    async def bidi(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        await _settle(requests)
        await context.abort(code, message)
        yield  # pragma: no cover

    if handler is None:  # no such method: refuse before telling what exists
        return grpc.unary_unary_rpc_method_handler(unary)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(bidi)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(client_streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token of every gRPC call: trainer methods need the trainer token, worker
    methods the worker token (constant-time compare); anything else is UNAUTHENTICATED."""

    def __init__(self, trainer_token: str, worker_token: str):
        self.tokens = {_TRAINER_PREFIX: trainer_token, _WORKER_PREFIX: worker_token}

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        ours = method.startswith(tuple(self.tokens))
        expected = next((tok for prefix, tok in self.tokens.items() if method.startswith(prefix)), None)
        handler = await continuation(details)
        if expected:
            sent = dict(details.invocation_metadata or ()).get("authorization", "")
            if not sent.startswith("Bearer "):
                return _deny(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing bearer token", handler)
            if not hmac.compare_digest(sent[7:].encode(), expected.encode()):
                return _deny(grpc.StatusCode.PERMISSION_DENIED, "authorization: token not valid for this API", handler)
        return _refuse_undecodable(handler) if ours else handler


def http_refusal(authorization: str | None, query_token: str | None, expected: str) -> tuple[int, str] | None:
    """HTTP routes that need the trainer token: None when the call may go on, else (HTTP
    status, message). The token comes as ``Authorization: Bearer <token>`` or, for a browser
    opening ``/ui``, as ``?token=<token>``. 401 when none is sent, 403 when it is wrong."""
    if not expected:
        return None
    if authorization is not None and authorization.startswith("Bearer "):
        sent = authorization[7:]
    elif query_token is not None:
        sent = query_token
    else:
        return 401, "authorization: missing bearer token (Authorization: Bearer <trainer token>, or /ui?token=...)"
    if not hmac.compare_digest(sent.encode(), expected.encode()):
        return 403, "authorization: token not valid for this API"
    return None


# ------------------------------------------------------------ undecodable bytes --


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, exc: Exception):
        self.reason = str(exc) or type(exc).__name__


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, and whatever a broken deserializer raises
            return _Undecodable(exc)

    return parse


async def _refuse(context: Any, bad: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid protobuf message ({bad.reason})")


async def _checked_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        yield request


def _refuse_undecodable(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """Parse requests tolerantly; answer INVALID_ARGUMENT when the bytes are not a message."""
    if handler is None or handler.request_deserializer is None:
        return handler
    kind = (("stream_" if handler.request_streaming else "unary_")
            + ("stream" if handler.response_streaming else "unary"))
    behavior = getattr(handler, kind)

    async def check(request: Any, context: Any) -> Any:
        if handler.request_streaming:
            return _checked_stream(request, context)
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        return request

    wrapped: Callable[[Any, Any], Any]
    if inspect.isasyncgenfunction(behavior):
        async def each(request: Any, context: Any) -> AsyncIterator[Any]:
            async for item in behavior(await check(request, context), context):
                yield item
        wrapped = each
    else:
        async def whole(request: Any, context: Any) -> Any:
            return await behavior(await check(request, context), context)
        wrapped = whole

    return handler._replace(request_deserializer=_tolerant(handler.request_deserializer), **{kind: wrapped})
