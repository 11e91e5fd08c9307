"""gRPC channel options that every process dialing the scheduler uses (the SDK's clients and
the workers): keepalive pings and a short reconnection backoff."""

from __future__ import annotations

__all__ = ["keepalive_options"]


def keepalive_options(every: float, timeout: float, reconnect_max: float) -> list[tuple[str, int]]:
    """gRPC channel options: HTTP/2 pings every ``every`` s (also with no call running and with
    no data flowing, as on a long stream that waits for its next completion), a connection whose
    ping is unanswered for ``timeout`` s closed; reconnection attempts at most ``reconnect_max`` s apart.
    The scheduler accepts pings this often (``SchedulerSettings.min_client_ping_seconds``)."""
    backoff = [("grpc.initial_reconnect_backoff_ms", min(1000, int(reconnect_max * 1000))),
               ("grpc.max_reconnect_backoff_ms", int(reconnect_max * 1000))]
    if every <= 0:
        return backoff
    # gRPC >= 1.55 bounds a ping's answer by ping_timeout_ms (default 60 s) as well as keepalive_timeout_ms
    return [*backoff, ("grpc.keepalive_time_ms", int(every * 1000)), ("grpc.keepalive_timeout_ms", int(timeout * 1000)),
            ("grpc.http2.ping_timeout_ms", int(timeout * 1000)), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]
