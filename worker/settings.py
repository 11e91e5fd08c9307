"""A worker's settings: one frozen dataclass for the worker process (``WorkerAgent`` and the
layers it composes: ``link``, ``runner``, ``weights``), every field with a default."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from bubblespec.worker.engine import EngineSettings

__all__ = ["WorkerSettings"]


@dataclass(frozen=True)
class WorkerSettings:
    scheduler: str = "localhost:50051"
    """Scheduler address, host:port."""
    worker_id: str = ""
    """Stable id ('' = hostname-pid)."""
    token: str = field(default="", repr=False)
    """Worker bearer token."""
    tls: bool = False
    """Dial the scheduler over TLS."""
    tls_ca_file: str = ""
    """PEM roots for the scheduler's certificate."""
    tls_cert_file: str = ""
    """PEM client certificate (mutual TLS)."""
    tls_key_file: str = ""
    """PEM client key (mutual TLS)."""
    heartbeat_seconds: float = 1.0
    """Heartbeat period."""
    progress_seconds: float = 0.5
    """Shortest gap between two progress reports of one request. Reports wait up to this long to
    go out together: one message carries the progress of every request that reported meanwhile."""
    completion_batch_seconds: float = 0.05
    """Shortest gap between two completion messages: a completion that ends within this long of
    the last one sent waits for the rest of the gap, and every completion queued meanwhile goes
    with it in one ``completions`` batch (fewer, larger messages for the scheduler to read); one
    that ends after a quieter spell goes at once, and so does a batch once no request is left
    running on the worker (the step's end waits for it). 0 = only those queued at the same moment."""
    reconnect_initial_seconds: float = 0.2
    """First reconnect delay; doubles up to reconnect_max_seconds."""
    reconnect_max_seconds: float = 2.0
    """Longest reconnect delay: a restarted scheduler gets its workers back within about this long
    of coming up (trainers retry meanwhile: the SDK's default retry budget is 120 s)."""
    keepalive_seconds: float = 5.0
    """Ping the scheduler after this long without traffic from it (0 = off)."""
    keepalive_timeout_seconds: float = 5.0
    """A ping unanswered this long breaks the stream and the worker re-dials: a frozen scheduler
    (SIGSTOP, a hung host, a cut network) is noticed in keepalive + timeout seconds."""
    max_drafts_per_request: int = 4
    """Stored drafts handed to the proposer per request (newest first)."""
    history_drafts: bool = True
    """Store finished responses as history drafts for later steps."""
    policy_version: int = 0
    """Version of the weights the engine starts with."""
    max_message_bytes: int = 64 * 2**20
    """Largest gRPC message sent or accepted on the scheduler stream. Must be at least the
    scheduler's ``max_message_bytes`` (equal by default): a larger assignment would break the
    stream (gRPC's own default receive limit is 4 MiB)."""
    engine: EngineSettings = EngineSettings()
    """The engine this worker drives."""

    def resolved_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"
