"""Scheduler settings: one frozen dataclass, every field documented.

Read from flags and ``BUBBLESPEC_*`` environment variables at the entry point (``cli``),
never at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bubblespec.scheduler.core.state import CoreSettings
from bubblespec.scheduler.core.validate import Limits

__all__ = ["SchedulerSettings"]


@dataclass(frozen=True)
class SchedulerSettings:
    host: str = "0.0.0.0"
    """Address both servers bind to."""
    grpc_port: int = 50051
    """Trainer and worker gRPC API (0 = pick a free port)."""
    http_port: int = 8080
    """/healthz, /readyz, /metrics, /status, /ui (0 = pick a free port; -1 = off)."""
    tokenizer: str = ""
    """Model directory or tokenizer.json used to tokenize text prompts ('' = token ids only)."""
    redis_url: str = ""
    """Draft store URL ('' = none). The scheduler keeps length history and resumable steps there."""
    redis_password: str = field(default="", repr=False)
    """Redis password."""
    redis_tls_ca_file: str = ""
    """PEM CA for a rediss:// URL."""
    trainer_token: str = field(default="", repr=False)
    """Bearer token trainers must send ('' = no authentication)."""
    worker_token: str = field(default="", repr=False)
    """Bearer token workers must send ('' = no authentication)."""
    tls_cert_file: str = ""
    """PEM certificate for the gRPC port ('' = plaintext)."""
    tls_key_file: str = ""
    """PEM key for the gRPC port."""
    tls_client_ca_file: str = ""
    """PEM CA that client certificates must chain to (mutual TLS)."""
    max_message_bytes: int = 64 * 2**20
    """Largest gRPC message accepted or sent."""
    tick_seconds: float = 0.25
    """Period of the straggler and liveness checks."""
    drain_seconds: float = 30.0
    """On SIGTERM: how long running calls may finish."""
    orphan_grace_seconds: float = 30.0
    """A running step whose trainer disconnected is cancelled after this long without a
    trainer re-attaching (the SDK re-attaches within seconds on retryable errors)."""
    default_policy: str = "queue"
    """Scheduling policy of steps that name none: static | queue | longest-first."""
    limits: Limits = Limits()
    """Request-size limits."""
    core: CoreSettings = CoreSettings()
    """Scheduling-core tunables."""

    def __repr__(self) -> str:
        """Secrets hidden: tokens and passwords are not shown, nor a password inside the URL."""
        from dataclasses import fields

        from bubblespec.store import StoreSettings

        shown = []
        for f in fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if f.name == "redis_url" and value:
                value = StoreSettings(url=value).redacted_url
            shown.append(f"{f.name}={value!r}")
        return f"SchedulerSettings({', '.join(shown)})"
