"""Assembles the scheduler process: gRPC (API, health, reflection), HTTP, ticks, shutdown.

``Scheduler(settings)`` can be started and stopped inside any running event loop (tests,
``bubblespec up``); ``run(settings)`` is the blocking entry point with SIGTERM handling:
health NOT_SERVING, drain running steps, ``stop(grace)``.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.common.types import SchedulingPolicy
from bubblespec.scheduler.auth import TokenAuthInterceptor
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.metrics import SchedulerMetrics
from bubblespec.scheduler.service import SchedulerService
from bubblespec.scheduler.servicers import RolloutServicer, WorkerLinkServicer
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.scheduler.status_view import StatusView

if TYPE_CHECKING:
    from bubblespec.scheduler.http import SignalFreeServer
    from bubblespec.scheduler.journal import StepJournal

__all__ = ["Scheduler", "load_tokenizer", "run"]

logger = logging.getLogger(__name__)
SERVICES = ("bubblespec.v1.Rollout", "bubblespec.v1.WorkerLink")


def load_tokenizer(path: str) -> Callable[[str], tuple[int, ...]]:
    """A ``tokenize(text) -> ids`` function from a model directory or tokenizer.json."""
    from tokenizers import Tokenizer

    p = Path(path)
    tok = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
    return lambda text: tuple(tok.encode(text).ids)


class Scheduler:
    """The scheduler process in one object: ``SchedulerService`` (the asyncio shell around
    ``SchedulerCore``) behind the gRPC servicers and the HTTP app, plus the journal, metrics and
    the tick that drives straggler and liveness checks. ``start()`` / ``stop(grace)`` inside any
    running event loop."""

    def __init__(self, settings: SchedulerSettings = SchedulerSettings()):
        self.settings = settings
        self.core = SchedulerCore(settings.core, clock=time.monotonic)
        tokenize = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
        journal = _journal(settings)
        self.service = SchedulerService(self.core, tokenize, journal, settings.orphan_grace_seconds)
        self.metrics = SchedulerMetrics(self.service)
        self.status = StatusView(self.core, settings.status_max_age_seconds)  # /status and the Status RPC
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.grpc_port = 0
        self.host = settings.bind_host()  # the address bound (set again, with its warning, by start)
        self.http_port = 0
        self._server: grpc.aio.Server | None = None
        self._http: SignalFreeServer | None = None  # once serving
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        s = self.settings
        _tune_gc()
        if self.service.journal is not None:
            self.service.journal.start()
            await self.service.journal.check_eviction()
            policy = await self.service.journal.load_policy()
            if policy is not None:  # a restart: the cluster keeps its policy version
                self.core.restore_policy(*policy)
                logger.info("restored policy version %d from the journal", policy[0])
        opts = [("grpc.max_send_message_length", s.max_message_bytes),
                ("grpc.max_receive_message_length", s.max_message_bytes), *_keepalive_options(s)]
        server = grpc.aio.server(options=opts, interceptors=[
            self.metrics.grpc_interceptor(), TokenAuthInterceptor(s.trainer_token, s.worker_token)])
        pbg.add_RolloutServicer_to_server(
            RolloutServicer(self.service, s.limits, SchedulingPolicy(s.default_policy), self.status,
                            s.default_logprobs_mode), server)
        pbg.add_WorkerLinkServicer_to_server(WorkerLinkServicer(self.service, s.limits, s.max_message_bytes), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (*[pb.DESCRIPTOR.services_by_name[n.split(".")[-1]].full_name for n in SERVICES],
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        self.host = bind_host(s)
        address = f"{_bracketed(self.host)}:{s.grpc_port}"
        self.grpc_port = (server.add_secure_port(address, _credentials(s)) if s.tls_cert_file
                          else server.add_insecure_port(address))
        await server.start()
        self._server = server
        for name in ("", *SERVICES):
            await _set_health(self.health, name, health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self.service.tick_forever(s.tick_seconds)))
        if s.http_port >= 0:
            await self._start_http()
        logger.info("scheduler serving gRPC on %s:%d, HTTP on %d", self.host, self.grpc_port, self.http_port)

    async def _start_http(self) -> None:
        import uvicorn

        from bubblespec.scheduler.hot_routes import HotRoutes
        from bubblespec.scheduler.http import SignalFreeServer, create_app
        from bubblespec.scheduler.joined_writes import JoinedWritesProtocol

        config = uvicorn.Config(HotRoutes(create_app(self)), host=self.host, port=self.settings.http_port,
                                http=JoinedWritesProtocol, log_level="warning", lifespan="off",
                                # uvicorn types it int and schedules it with loop.call_later, which takes a float
                                timeout_keep_alive=self.settings.http_keep_alive_seconds)  # type: ignore[arg-type]
        self._http = SignalFreeServer(config)
        self._tasks.append(asyncio.create_task(self._http.serve()))
        while not self._http.started:
            await asyncio.sleep(0.02)
        self.http_port = self._http.servers[0].sockets[0].getsockname()[1]

    @property
    def ready(self) -> bool:
        return self._server is not None and not self.service.draining and bool(self.core.worker_count)

    async def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, drain running steps, then stop the servers (idempotent)."""
        if self._server is None:
            return
        grace = self.settings.drain_seconds if grace is None else grace
        for name in ("", *SERVICES):
            await _set_health(self.health, name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.service.drain(grace)
        server, self._server = self._server, None
        await server.stop(min(grace, 5.0))
        if self._http is not None:
            self._http.should_exit = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.service.journal is not None:
            await self.service.journal.close()


def _keepalive_options(s: SchedulerSettings) -> list[tuple[str, int]]:
    """Accept the clients' keepalive pings (gRPC's default policy GOAWAYs a client that pings more
    than once per 5 min without data: a trainer waiting on a long step would be cut), and ping
    idle connections ourselves."""
    return [("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", int(s.min_client_ping_seconds * 1000)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.keepalive_time_ms", int(s.keepalive_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(s.keepalive_timeout_seconds * 1000)),
            ("grpc.http2.ping_timeout_ms", int(s.keepalive_timeout_seconds * 1000)),
            ("grpc.http2.max_pings_without_data", 0)]


def _journal(s: SchedulerSettings) -> StepJournal | None:
    """The step journal the settings ask for, or None (no Redis, or no secret to sign it with)."""
    url = s.journal_redis_url or s.redis_url
    if not url:
        return None
    if not s.journal_secret:
        logger.warning("step journal OFF: no journal_secret (--journal-secret, BUBBLESPEC_JOURNAL_SECRET); "
                       "a restarted scheduler will resume no step and restore no policy")
        return None
    if not s.journal_redis_url:
        logger.warning("step journal shares the draft store's Redis: if it evicts keys, journal records go "
                       "with the drafts; set journal_redis_url to a noeviction Redis")
    from bubblespec.scheduler.journal import StepJournal
    from bubblespec.store import StoreSettings

    store = StoreSettings(url=url, password=s.redis_password, tls_ca_file=s.redis_tls_ca_file)
    return StepJournal(store, s.journal_secret.encode(), finished_ttl_seconds=s.journal_finished_ttl_seconds)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it reaches the network


def bind_host(s: SchedulerSettings) -> str:
    """The address to bind (``SchedulerSettings.bind_host``), saying loudly when it opens an
    API without a token to the network."""
    host, open_apis = s.bind_host(), s.open_apis()
    if open_apis and not is_loopback(host):
        logger.warning(
            "INSECURE: binding %s (not loopback) with no token on the %s API: anyone who can reach this "
            "address can %s. Set --trainer-token and --worker-token (BUBBLESPEC_TRAINER_TOKEN, "
            "BUBBLESPEC_WORKER_TOKEN), or leave --host unset to bind 127.0.0.1 only (docs/SECURITY.md)",
            host, " and ".join(open_apis),
            " and ".join({"trainer": "run rollouts, update the policy and read /status",
                          "worker": "join as a worker and answer requests"}[api] for api in open_apis))
    elif open_apis and not s.host:
        logger.info("no %s token: serving on loopback (%s) only; set both tokens, or --host, to serve other "
                    "machines", " or ".join(open_apis), host)
    return host


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def _set_health(servicer: Any, name: str, status: Any) -> None:
    result = servicer.set(name, status)
    if asyncio.iscoroutine(result):
        await result


def _credentials(s: SchedulerSettings) -> grpc.ServerCredentials:
    key = Path(s.tls_key_file).read_bytes()
    cert = Path(s.tls_cert_file).read_bytes()
    ca = Path(s.tls_client_ca_file).read_bytes() if s.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


async def serve(settings: SchedulerSettings) -> None:
    scheduler = Scheduler(settings)
    await scheduler.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: draining for up to %.0fs", settings.drain_seconds)
    await scheduler.stop()


def run(settings: SchedulerSettings) -> None:
    asyncio.run(serve(settings))


GC_YOUNG_THRESHOLD = 50_000
"""Allocations between two young-generation collections in a process that serves a scheduler
(Python's default is 700). The scheduler keeps the completions of its last steps alive (many
long-lived objects) and allocates several objects per completion: with the default, collections
that end up scanning the kept steps cost about a fifth of its Python time per completion."""


def _tune_gc() -> None:
    """Raise the young-generation threshold to ``GC_YOUNG_THRESHOLD`` (never lower one already
    set higher); the older generations keep their thresholds, so cycles are still collected."""
    young, *older = gc.get_threshold()
    if young < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, *older)
