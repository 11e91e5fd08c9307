"""Scheduler settings: one frozen dataclass, every field documented.

Read from flags and ``BUBBLESPEC_*`` environment variables at the entry point (``cli``),
never at import time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from bubblespec.common.types import SchedulingPolicy
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.validate import Limits

__all__ = ["SchedulerSettings"]


@dataclass(frozen=True)
class SchedulerSettings:
    """Everything ``bubblespec up`` / ``python -m bubblespec.scheduler`` is configured with
    (flags and ``BUBBLESPEC_*`` environment variables map to these fields); frozen."""

    host: str = ""
    """Address both servers bind to. '' = safe default: all interfaces (0.0.0.0) when both
    trainer_token and worker_token are set, else loopback (127.0.0.1), so that a scheduler
    started without tokens is not open to the network. An explicit non-loopback address
    without both tokens is honoured with a warning in the log (``bind_host``)."""
    grpc_port: int = 50051
    """Trainer and worker gRPC API (0 = pick a free port)."""
    http_port: int = 8080
    """/healthz, /readyz, /metrics, /status, /ui (0 = pick a free port; -1 = off)."""
    http_keep_alive_seconds: float = 5.0
    """The HTTP server closes a connection idle this long (uvicorn's ``timeout_keep_alive``; 5 s
    as ``vllm serve``'s ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``). Raise it where clients keep a pool of
    connections idle between calls longer than that (a trainer between rollout batches), so that
    they are not reopened for every call."""
    tokenizer: str = ""
    """Model directory or tokenizer.json used to tokenize text prompts ('' = token ids only)."""
    redis_url: str = ""
    """Draft store URL ('' = none). The scheduler keeps length history and resumable steps there."""
    redis_password: str = field(default="", repr=False)
    """Redis password."""
    redis_tls_ca_file: str = ""
    """PEM CA for a rediss:// URL."""
    journal_redis_url: str = ""
    """Redis of the step journal (what a restarted scheduler resumes from; '' = ``redis_url``).
    Use a Redis, or a Redis instance, with ``maxmemory-policy noeviction``: the draft store's
    Redis usually evicts (drafts are a cache) and would drop journal records with the drafts;
    a separate database of the same instance shares its eviction. ``redis_password`` and
    ``redis_tls_ca_file`` apply to it too (a password inside this URL wins)."""
    journal_secret: str = field(default="", repr=False)
    """Key of the HMAC-SHA256 that authenticates every journal record (at least 16 bytes; keep
    it the same across restarts). '' = no journal: a restarted scheduler resumes no step and
    restores no policy (logged as a warning when a Redis is configured)."""
    journal_finished_ttl_seconds: int = 600
    """How long a step's journal record is kept once its summary was sent: a trainer that
    retries ``Generate`` within this after a scheduler restart gets the step replayed; later
    the step id is unknown again and the step runs afresh."""
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
    """Largest gRPC message accepted or sent. Every message to a worker fits in it: a worker
    whose model length would allow a larger assignment under ``limits`` is refused at hello
    (``validate.worker_message_bound``). Workers must accept messages this large
    (``WorkerSettings.max_message_bytes`` >= this; equal by default)."""
    min_client_ping_seconds: float = 2.0
    """Shortest gap between HTTP/2 keepalive pings a trainer or worker may send, with or without
    a call running (the SDK and workers ping every 5 s); a faster pinger is told GOAWAY."""
    keepalive_seconds: float = 20.0
    """The scheduler pings a connection idle this long, and closes it when the ping is not answered
    within ``keepalive_timeout_seconds``: a vanished trainer's step is then orphaned at once."""
    keepalive_timeout_seconds: float = 10.0
    """How long the scheduler waits for the answer to its keepalive ping."""
    tick_seconds: float = 0.25
    """Period of the straggler and liveness checks."""
    drain_seconds: float = 30.0
    """On SIGTERM: how long running calls may finish."""
    orphan_grace_seconds: float = 30.0
    """A running step whose trainer disconnected is cancelled after this long without a
    trainer re-attaching (the SDK re-attaches within seconds on retryable errors)."""
    default_policy: SchedulingPolicy = SchedulingPolicy.QUEUE
    """Scheduling policy of steps that name none: static | queue | longest-first (the string is
    accepted and converted)."""
    default_logprobs_mode: str = "processed"
    """Logprobs of steps that name none (``SamplingParams.logprobs_mode``): processed | raw.
    The workers' engines must return them (``EngineSettings.logprobs_mode``), or such steps
    are refused."""
    status_max_age_seconds: float = 0.5
    """/status and the Status RPC reuse a built status document for this long: any number of
    pollers cost one build per period (a build takes milliseconds of event-loop time per
    hundred workers)."""
    limits: Limits = Limits()
    """Request-size limits."""
    core: CoreSettings = CoreSettings()
    """Scheduling-core tunables."""
    served_model_name: str = ""
    """Model id of the OpenAI-compatible routes (``/v1/models``; a ``/v1/completions`` request
    naming another model gets 404). '' = the basename of ``tokenizer``, or "bubblespec"; requests
    may then also name ``tokenizer`` as given (vLLM's default name, ``serves_model``)."""
    weight_transfer_backend: str | None = None
    """vLLM's weight-transfer backend for the trainer-pushed weight routes
    (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights {update_info}``,
    ``/finish_weight_update``), fanned out to every worker (docs/INTEGRATIONS.md, "Weight transfer
    (NCCL)"); ``/server_info`` reports it as ``weight_transfer_config`` ``{"backend": ...}``.
    None = off: those routes answer 400. The workers' engines need the same backend
    (``EngineSettings.weight_transfer_backend``) and GPUs for ``nccl``."""
    weight_transfer_timeout_seconds: float = 600.0
    """How long one weight-transfer call (or ``/reset_prefix_cache``) waits for every worker's
    answer; a worker still silent then is named in the error and counts as failed."""
    weight_update_deadline_seconds: float = 600.0
    """A weight update started (``/start_weight_update``, or ``/collective_rpc``'s
    ``skyrl_start_weight_update``) and not finished within this many seconds is rolled back:
    the version stays, the waiters get the reason, the workers serve nothing until an update
    succeeds (``core/transfer.py``; ``POST /abort_weight_update`` does it at once)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.http_keep_alive_seconds) and self.http_keep_alive_seconds > 0):
            raise ValueError(f"http_keep_alive_seconds: must be a finite number > 0, got {self.http_keep_alive_seconds!r:.40}")
        if not self.weight_update_deadline_seconds > 0:
            raise ValueError(f"weight_update_deadline_seconds: must be > 0, got {self.weight_update_deadline_seconds!r}")
        try:
            policy = SchedulingPolicy(self.default_policy)
        except ValueError:
            names = " | ".join(p.value for p in SchedulingPolicy)
            raise ValueError(f"default_policy: {self.default_policy!r:.40} is not a policy ({names})") from None
        object.__setattr__(self, "default_policy", policy)

    def model_name(self) -> str:
        """The served model name (``served_model_name`` or its default)."""
        return _model_name(self.served_model_name, self.tokenizer)

    def serves_model(self, name: object) -> bool:
        """Whether a request's ``model`` names the served model: ``model_name()``, or, with no
        ``served_model_name``, the ``tokenizer`` string as given, which is vLLM's default served
        name (``vllm serve DIR`` serves "DIR"; TRL's async GRPO rollouts send the path they loaded)."""
        if not isinstance(name, str):
            return False
        return name == self.model_name() or (not self.served_model_name and bool(self.tokenizer)
                                              and name.rstrip("/") == self.tokenizer.rstrip("/"))

    def open_apis(self) -> list[str]:
        """The gRPC APIs that take calls without a token."""
        return [api for api, token in (("trainer", self.trainer_token), ("worker", self.worker_token)) if not token]

    def bind_host(self) -> str:
        """The address to bind: ``host``, or the safe default when it is ''."""
        if self.host:
            return self.host
        return "127.0.0.1" if self.open_apis() else "0.0.0.0"

    def __repr__(self) -> str:
        """Secrets hidden: tokens and passwords are not shown, nor a password inside the URL."""
        from dataclasses import fields

        from bubblespec.store import StoreSettings

        shown = []
        for f in fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if f.name in ("redis_url", "journal_redis_url") and value:
                value = StoreSettings(url=value).redacted_url
            shown.append(f"{f.name}={value!r}")
        return f"SchedulerSettings({', '.join(shown)})"


@functools.lru_cache(maxsize=16)
def _model_name(served_model_name: str, tokenizer: str) -> str:
    """``SchedulerSettings.model_name``, once per pair (every call's answer names it)."""
    from pathlib import Path

    path = Path(tokenizer.rstrip("/")) if tokenizer else None
    default = "" if path is None else (path.parent.name if path.suffix == ".json" else path.name)
    return served_model_name or default or "bubblespec"
