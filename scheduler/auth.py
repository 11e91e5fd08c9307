"""Bearer-token authentication: trainers and workers hold separate tokens.

Health checks and reflection stay open (probes carry no token). A call to the trainer API
with the worker token, or the reverse, is refused: roles do not mix.
"""

from __future__ import annotations

import hmac

import grpc

__all__ = ["TokenAuthInterceptor"]

_TRAINER_PREFIX = "/bubblespec.v1.Rollout/"
_WORKER_PREFIX = "/bubblespec.v1.WorkerLink/"


def _deny(code: grpc.StatusCode, message: str, handler: grpc.RpcMethodHandler):
    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.unary_unary_rpc_method_handler(unary)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, trainer_token: str, worker_token: str):
        self.tokens = {_TRAINER_PREFIX: trainer_token, _WORKER_PREFIX: worker_token}

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        method = details.method
        expected = next((tok for prefix, tok in self.tokens.items() if method.startswith(prefix)), None)
        if not expected:  # health, reflection, or authentication off for this role
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        handler = await continuation(details)
        if not sent.startswith("Bearer "):
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing bearer token", handler)
        if not hmac.compare_digest(sent[7:].encode(), expected.encode()):
            return _deny(grpc.StatusCode.PERMISSION_DENIED, "authorization: token not valid for this API", handler)
        return handler
