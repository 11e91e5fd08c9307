"""The SDK's one exception tree, and the single table from gRPC status codes to it.

    BubbleSpecError
    ├── RetryableError          the SDK retries these (same step id = idempotent)
    │   ├── ServiceUnavailable      UNAVAILABLE, ABORTED
    │   ├── DeadlineExceeded        DEADLINE_EXCEEDED
    │   └── ResourceExhausted       RESOURCE_EXHAUSTED
    └── FatalError              retrying cannot help
        ├── InvalidArgument         INVALID_ARGUMENT, OUT_OF_RANGE
        ├── PreconditionFailed      FAILED_PRECONDITION; also a failed step: one of its requests
        │                           failed on every attempt (``field`` names the prompt,
        │                           "prompts[3]"; the same step id returns the same failure)
        ├── AlreadyExists           ALREADY_EXISTS
        ├── NotFound                NOT_FOUND
        ├── AuthenticationFailed    UNAUTHENTICATED, PERMISSION_DENIED
        ├── StepCancelled           CANCELLED
        └── ServerError             INTERNAL, UNKNOWN, and anything else
"""

from __future__ import annotations

import grpc

__all__ = [
    "AlreadyExists", "AuthenticationFailed", "BubbleSpecError", "DeadlineExceeded", "FatalError",
    "InvalidArgument", "NotFound", "PreconditionFailed", "ResourceExhausted", "RetryableError",
    "ServerError", "ServiceUnavailable", "StepCancelled", "error_from_status",
]


class BubbleSpecError(Exception):
    """Root of every SDK error. ``code`` is the gRPC status; ``field`` the field the server named."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        head = message.split(":", 1)[0] if ":" in message else ""
        self.field = head if head and " " not in head else None


class RetryableError(BubbleSpecError):
    """A failure the SDK retries (with backoff) before raising it: the call may succeed later."""


class FatalError(BubbleSpecError):
    """A failure retrying cannot fix (bad input, auth, a cancelled step): raised at once."""


class ServiceUnavailable(RetryableError):
    pass


class DeadlineExceeded(RetryableError):
    pass


class ResourceExhausted(RetryableError):
    pass


class InvalidArgument(FatalError):
    pass


class PreconditionFailed(FatalError):
    pass


class AlreadyExists(FatalError):
    pass


class NotFound(FatalError):
    pass


class AuthenticationFailed(FatalError):
    pass


class StepCancelled(FatalError):
    pass


class ServerError(FatalError):
    pass


_TABLE: dict[grpc.StatusCode, type[BubbleSpecError]] = {
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailable,
    grpc.StatusCode.ABORTED: ServiceUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: PreconditionFailed,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationFailed,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationFailed,
    grpc.StatusCode.CANCELLED: StepCancelled,
}


def error_from_status(code: grpc.StatusCode, details: str | None) -> BubbleSpecError:
    cls = _TABLE.get(code, ServerError)
    return cls(details or code.name, code)
