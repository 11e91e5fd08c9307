"""Security of the scheduler's gRPC port, on real gRPC over loopback with scripted workers.

- Authentication: trainers and workers hold separate bearer tokens. No token is
  UNAUTHENTICATED, a wrong one PERMISSION_DENIED; the worker token on the trainer API and the
  trainer token on the worker API are refused; health checks and reflection stay open.
- TLS and mutual TLS (certificates from ``tests/support/tls.py``): a TLS client works, a
  plaintext one fails; with mTLS a client without a certificate (or with one from another CA)
  fails.
- Limits: message size, prompt length, batch size, n, lookahead, stop strings, each refused
  with a status that names the field, and nothing changes; requests right at a limit pass.
- Secrets: neither token nor the Redis password appears in logs (DEBUG, everything), in
  ``/status``, ``/metrics``, the Status RPC, or the repr of any settings object.

No vLLM: workers are ``tests/support/fake_worker.FakeWorker`` (the real WorkerLink stream) or
the real ``WorkerAgent`` driving a scripted engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client import (
    AsyncRolloutClient, AuthenticationFailed, ClientSettings, DeadlineExceeded, FinishReason, InvalidArgument,
    ResourceExhausted, Retry, SamplingParams, ServiceUnavailable,
)
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.validate import Limits
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.store import StoreSettings
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.engine import EngineInfo, EngineOutput, EngineRequest, EngineSettings
from tests.integration.test_metrics_ui import CHROMIUM, chromium
from tests.support.fake_worker import FakeWorker, fake_tokens, wait_until
from tests.support.redis_server import RedisServer, redis_server_available
from tests.support.tls import TlsFiles, make_tls_files

TRAINER_TOKEN = "trainer-7f3a9c1e5b2d4f6a8c0e"
WORKER_TOKEN = "worker-1b2c3d4e5f6a7b8c9d0e"
REDIS_PASSWORD = "redis-pw-9e8d7c6b5a4f3e2d"
JOURNAL_SECRET = "journal-hmac-3a4b5c6d7e8f9a0b"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
FAST_FAIL = dict(retry=Retry(attempts=1), timeout_seconds=2.0, step_timeout_seconds=2.0)


def settings(**over) -> SchedulerSettings:
    base = dict(host="127.0.0.1", grpc_port=0, http_port=-1, drain_seconds=1.0,
                core=CoreSettings(drafting=False))
    base.update(over)
    return SchedulerSettings(**base)


@contextlib.asynccontextmanager
async def running(s: SchedulerSettings, *workers: dict) -> AsyncIterator[Scheduler]:
    """A started scheduler with fake workers (``dict`` = FakeWorker keyword arguments) joined."""
    scheduler = Scheduler(s)
    await scheduler.start()
    started: list[FakeWorker] = []
    try:
        for i, kw in enumerate(workers):
            w = await FakeWorker(f"127.0.0.1:{scheduler.grpc_port}", kw.pop("worker_id", f"fw-{i}"), **kw).start()
            started.append(w)
            await wait_until(lambda w=w: w.worker_id in scheduler.core.workers, what=f"{w.worker_id} to join")
        yield scheduler
    finally:
        for w in started:
            await w.stop()
        await scheduler.stop(1.0)


def target(scheduler: Scheduler) -> str:
    return f"127.0.0.1:{scheduler.grpc_port}"


def state(scheduler: Scheduler) -> tuple:
    core = scheduler.core
    return (core.version, tuple(core.steps), sum(len(s.completions) for s in core.steps.values()),
            tuple(sorted(core.workers)), len(core.planner.upcoming))


async def http_get(port: int, path: str, token: str = "") -> bytes:
    status, body = await http_call(port, path, {"Authorization": f"Bearer {token}"} if token else {})
    assert status == 200, (path, status, body)
    return body


async def http_call(port: int, path: str, headers: dict | None = None, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """(HTTP status, body), error statuses included."""
    def get() -> tuple[int, bytes]:
        request = urllib.request.Request(f"http://{host}:{port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    return await asyncio.to_thread(get)


async def run_step(client: AsyncRolloutClient, step: str, worker_id: str) -> None:
    """One step through the SDK; its completions are the fake worker's."""
    result = await client.generate(step, [(5, 6, 7), (8, 9)], GREEDY, n=2)
    assert [(c.prompt_id, c.sample_index) for c in result.completions] == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]
    assert all(c.worker_id == worker_id for c in result.completions)
    assert result.completions[0].token_ids == fake_tokens((5, 6, 7), 4)


# ------------------------------------------------------------ authentication --


@pytest.fixture(scope="module")
async def authed():
    s = settings(trainer_token=TRAINER_TOKEN, worker_token=WORKER_TOKEN, http_port=0)
    async with running(s, dict(worker_id="fw-auth", token=WORKER_TOKEN)) as scheduler:
        yield scheduler


async def test_tokens_let_trainer_and_worker_run_a_step(authed):
    async with AsyncRolloutClient(target(authed), token=TRAINER_TOKEN, **FAST_FAIL) as client:
        await run_step(client, "auth-ok", "fw-auth")
        assert (await client.status())["workers"][0]["worker_id"] == "fw-auth"


TRAINER_CALLS = {
    "Generate": lambda stub, md: _drain(stub.Generate(pb.GenerateRequest(step_id="x"), metadata=md, timeout=5)),
    "Announce": lambda stub, md: stub.Announce(pb.AnnounceRequest(), metadata=md, timeout=5),
    "UpdatePolicy": lambda stub, md: stub.UpdatePolicy(pb.UpdatePolicyRequest(version=9, weights_path="/w"),
                                                       metadata=md, timeout=5),
    "Status": lambda stub, md: stub.Status(pb.StatusRequest(), metadata=md, timeout=5),
    "Cancel": lambda stub, md: stub.Cancel(pb.CancelRequest(step_id="auth-ok"), metadata=md, timeout=5),
}
BAD_CREDENTIALS = [
    ("no-token", None, grpc.StatusCode.UNAUTHENTICATED),
    ("not-bearer", f"Basic {TRAINER_TOKEN}", grpc.StatusCode.UNAUTHENTICATED),
    ("empty-bearer", "Bearer ", grpc.StatusCode.PERMISSION_DENIED),
    ("wrong-token", "Bearer not-the-token", grpc.StatusCode.PERMISSION_DENIED),
    ("token-prefix", f"Bearer {TRAINER_TOKEN[:-1]}", grpc.StatusCode.PERMISSION_DENIED),
    ("token-plus-suffix", f"Bearer {TRAINER_TOKEN}x", grpc.StatusCode.PERMISSION_DENIED),
    ("worker-token", f"Bearer {WORKER_TOKEN}", grpc.StatusCode.PERMISSION_DENIED),
]


async def _drain(call):
    return [m async for m in call]


@pytest.mark.parametrize("method", list(TRAINER_CALLS))
@pytest.mark.parametrize("name,header,code", BAD_CREDENTIALS, ids=[c[0] for c in BAD_CREDENTIALS])
async def test_trainer_api_refuses_missing_wrong_and_worker_tokens(authed, method, name, header, code):
    before = state(authed)
    md = (("authorization", header),) if header is not None else ()
    async with grpc.aio.insecure_channel(target(authed)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await TRAINER_CALLS[method](pbg.RolloutStub(channel), md)
    assert err.value.code() == code
    assert err.value.details().startswith("authorization:")
    assert TRAINER_TOKEN not in err.value.details() and WORKER_TOKEN not in err.value.details()
    assert state(authed) == before


@pytest.mark.parametrize("token,exc_code", [("", grpc.StatusCode.UNAUTHENTICATED),
                                            (WORKER_TOKEN, grpc.StatusCode.PERMISSION_DENIED)],
                         ids=["sdk-no-token", "sdk-worker-token"])
async def test_sdk_maps_refusal_to_fatal_authentication_error(authed, token, exc_code):
    async with AsyncRolloutClient(target(authed), token=token, retry=Retry(attempts=5, initial_seconds=5)) as client:
        with pytest.raises(AuthenticationFailed) as err:  # fatal: raised at once, never retried
            await asyncio.wait_for(client.generate("auth-bad", [(5, 6)], GREEDY), 4)
    assert err.value.code == exc_code and err.value.field == "authorization"


@pytest.mark.parametrize("token,code", [("", grpc.StatusCode.UNAUTHENTICATED),
                                        ("not-the-token", grpc.StatusCode.PERMISSION_DENIED),
                                        (TRAINER_TOKEN, grpc.StatusCode.PERMISSION_DENIED)],
                         ids=["no-token", "wrong-token", "trainer-token"])
async def test_worker_api_refuses_missing_wrong_and_trainer_tokens(authed, token, code):
    before = state(authed)
    async with FakeWorker(target(authed), "fw-intruder", token=token) as w:
        error = await w.closed()
    assert error is not None and error.code() == code and error.details().startswith("authorization:")
    assert not w.received and "fw-intruder" not in authed.core.workers
    assert state(authed) == before


async def test_unknown_method_is_refused_before_saying_what_exists(authed):
    async with grpc.aio.insecure_channel(target(authed)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary("/bubblespec.v1.Rollout/Nope")(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_health_reflection_and_http_probes_stay_open(authed):
    async with grpc.aio.insecure_channel(target(authed)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "bubblespec.v1.Rollout", "bubblespec.v1.WorkerLink"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = [r async for r in reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)]
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"bubblespec.v1.Rollout", "bubblespec.v1.WorkerLink"} <= names
    assert json.loads(await http_get(authed.http_port, "/healthz")) == {"ok": True}


# ------------------------------------------------ HTTP status, bind address --


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def test_status_and_ui_take_the_trainer_token_while_probes_and_metrics_stay_open(authed):
    port = authed.http_port
    for path in ("/status", "/ui"):
        for headers in ({}, {"Authorization": TRAINER_TOKEN}, {"Authorization": f"bearer {TRAINER_TOKEN}"}):
            status, body = await http_call(port, path, headers)
            assert status == 401 and b"authorization: missing bearer token" in body, (path, headers)
        for headers in (bearer(WORKER_TOKEN), bearer(TRAINER_TOKEN + "x"), bearer(TRAINER_TOKEN[:-1]), bearer("")):
            status, body = await http_call(port, path, headers)
            assert status == 403 and b"authorization: token not valid" in body, (path, headers)
            assert TRAINER_TOKEN.encode() not in body and WORKER_TOKEN.encode() not in body
        assert (await http_call(port, f"{path}?token={WORKER_TOKEN}"))[0] == 403
    status, body = await http_call(port, "/status", bearer(TRAINER_TOKEN))
    assert status == 200 and "fw-auth" in {w["worker_id"] for w in json.loads(body)["workers"]}
    assert json.loads(await http_get(port, f"/status?token={TRAINER_TOKEN}"))["workers"]
    status, page = await http_call(port, f"/ui?token={TRAINER_TOKEN}")  # how a browser opens it
    assert status == 200 and b"<title>BubbleSpec scheduler</title>" in page
    for path in ("/healthz", "/readyz", "/metrics"):  # probes and Prometheus carry no token
        assert (await http_call(port, path))[0] == 200, path


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
async def test_ui_opened_with_the_token_in_its_address_shows_the_cluster(authed):
    """A browser opens /ui?token=...: the page moves the token out of the address and sends it
    to /status as a bearer header (status 200: the live table fills)."""
    dom = (await chromium("--dump-dom", f"http://127.0.0.1:{authed.http_port}/ui?token={TRAINER_TOKEN}")).decode()
    assert 'data-worker="fw-auth"' in dom and 'id="conn" class="ok"' in dom, dom[-2000:]


def listening(port: int) -> set[str]:
    """Addresses this process listens on at ``port`` (IPv4-mapped and dual-stack sockets as IPv4)."""
    ips = {c.laddr.ip for c in psutil.Process().net_connections("inet")
           if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    return {"0.0.0.0" if ip == "::" else ip.removeprefix("::ffff:") for ip in ips}


def outside_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (how another machine reaches it)."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


async def reachable(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    except OSError:
        return False
    writer.close()
    return True


@pytest.mark.parametrize("tokens,expected", [
    ({}, "127.0.0.1"),
    (dict(trainer_token=TRAINER_TOKEN), "127.0.0.1"),
    (dict(worker_token=WORKER_TOKEN), "127.0.0.1"),
    (dict(trainer_token=TRAINER_TOKEN, worker_token=WORKER_TOKEN), "0.0.0.0"),
], ids=["no-token", "trainer-token-only", "worker-token-only", "both-tokens"])
async def test_default_bind_is_loopback_unless_both_tokens_are_set(tokens, expected, caplog):
    outside = outside_address()
    async with running(settings(host="", http_port=0, **tokens)) as scheduler:
        assert scheduler.host == expected
        for port in (scheduler.grpc_port, scheduler.http_port):
            assert listening(port) == {expected}
            assert await reachable("127.0.0.1", port)
            if outside is not None:
                assert await reachable(outside, port) == (expected == "0.0.0.0"), (outside, port)
    assert "INSECURE" not in caplog.text


@pytest.mark.parametrize("tokens,open_api", [({}, "trainer and worker API"),
                                             (dict(trainer_token=TRAINER_TOKEN), "worker API")])
async def test_explicit_non_loopback_bind_without_both_tokens_warns_loudly(tokens, open_api, caplog):
    caplog.set_level(logging.INFO, logger="bubblespec.scheduler.server")
    async with running(settings(host="0.0.0.0", http_port=0, **tokens)) as scheduler:
        assert listening(scheduler.grpc_port) == listening(scheduler.http_port) == {"0.0.0.0"}
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.getMessage().startswith("INSECURE")]
    assert len(warnings) == 1, caplog.text
    assert f"binding 0.0.0.0 (not loopback) with no token on the {open_api}" in warnings[0]
    assert TRAINER_TOKEN not in caplog.text


class ScriptedEngine:
    """A simulated engine (no model): answers every request with ``fake_tokens``."""

    info = EngineInfo("scripted", 512, 128, False)
    dead = False

    async def start(self) -> None: ...

    async def generate(self, request: EngineRequest):
        tokens = fake_tokens(request.prompt_token_ids, request.sampling.max_tokens)
        yield EngineOutput(request.key, tokens, (-0.5,) * len(tokens), "", FinishReason.LENGTH)

    async def abort(self, key: str) -> None: ...

    async def load_weights(self, path: str) -> None: ...

    async def shutdown(self) -> None: ...


def agent_settings(scheduler: Scheduler, worker_id: str, token: str, **over) -> WorkerSettings:
    return WorkerSettings(scheduler=target(scheduler), worker_id=worker_id, token=token,
                          engine=EngineSettings(max_num_seqs=2), history_drafts=False,
                          reconnect_initial_seconds=0.05, **over)


async def test_worker_agent_sends_its_token_and_stops_on_refusal(authed):
    """The real ``WorkerAgent`` authenticates with ``authorization: Bearer`` and gives up
    (rather than reconnecting for ever) when its token is refused."""
    agent = WorkerAgent(agent_settings(authed, "agent-ok", WORKER_TOKEN), ScriptedEngine())
    task = asyncio.create_task(agent.run())
    try:
        await wait_until(lambda: "agent-ok" in authed.core.workers, what="the agent to join")
    finally:
        await agent.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
    for token, code in (("", grpc.StatusCode.UNAUTHENTICATED), (TRAINER_TOKEN, grpc.StatusCode.PERMISSION_DENIED)):
        refused = WorkerAgent(agent_settings(authed, "agent-bad", token), ScriptedEngine())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(refused.run(), 10)
        assert err.value.code() == code
        assert "agent-bad" not in authed.core.workers


# ----------------------------------------------------------------------- TLS --


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsFiles:
    files = make_tls_files(tmp_path_factory.mktemp("tls"))
    if files is None:
        pytest.skip("openssl is not installed")
    return files


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> TlsFiles:
    files = make_tls_files(tmp_path_factory.mktemp("tls-other"))
    if files is None:
        pytest.skip("openssl is not installed")
    return files


def tls_client(scheduler: Scheduler, files: TlsFiles | None, *, ca: TlsFiles | None = None,
               with_cert: bool = False) -> AsyncRolloutClient:
    """A TLS client trusting ``ca`` (default: ``files``' CA), presenting ``files``' client pair if asked."""
    trust = ca or files
    cert = (dict(client_certificate=files.client_cert.read_bytes(), client_key=files.client_key.read_bytes())
            if files is not None and with_cert else {})
    return AsyncRolloutClient(target(scheduler), settings=ClientSettings(
        tls=True, root_certificates=trust.ca_cert.read_bytes() if trust else None, **cert, **FAST_FAIL))


def worker_credentials(files: TlsFiles, with_cert: bool) -> grpc.ChannelCredentials:
    if with_cert:
        return grpc.ssl_channel_credentials(files.ca_cert.read_bytes(), files.client_key.read_bytes(),
                                            files.client_cert.read_bytes())
    return grpc.ssl_channel_credentials(files.ca_cert.read_bytes())


@pytest.fixture(scope="module")
async def tls_scheduler(tls):
    s = settings(tls_cert_file=str(tls.server_cert), tls_key_file=str(tls.server_key))
    async with running(s, dict(worker_id="fw-tls", credentials=worker_credentials(tls, False))) as scheduler:
        yield scheduler


async def test_tls_client_runs_a_step(tls_scheduler, tls):
    async with tls_client(tls_scheduler, tls) as client:
        await run_step(client, "tls-ok", "fw-tls")


async def test_plaintext_client_and_worker_fail_against_tls(tls_scheduler):
    before = state(tls_scheduler)
    async with AsyncRolloutClient(target(tls_scheduler), **FAST_FAIL) as client:
        with pytest.raises((DeadlineExceeded, ServiceUnavailable)):
            await client.status()
    async with FakeWorker(target(tls_scheduler), "fw-plain") as w:
        error = await w.closed()
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert state(tls_scheduler) == before


async def test_client_trusting_another_ca_fails(tls_scheduler, other_ca):
    async with tls_client(tls_scheduler, None, ca=other_ca) as client:
        with pytest.raises((DeadlineExceeded, ServiceUnavailable)):
            await client.status()


@pytest.fixture(scope="module")
async def mtls_scheduler(tls):
    s = settings(tls_cert_file=str(tls.server_cert), tls_key_file=str(tls.server_key),
                 tls_client_ca_file=str(tls.ca_cert))
    async with running(s, dict(worker_id="fw-mtls", credentials=worker_credentials(tls, True))) as scheduler:
        yield scheduler


async def test_mtls_client_with_certificate_runs_a_step(mtls_scheduler, tls):
    async with tls_client(mtls_scheduler, tls, with_cert=True) as client:
        await run_step(client, "mtls-ok", "fw-mtls")


async def test_mtls_refuses_clients_and_workers_without_certificate(mtls_scheduler, tls):
    before = state(mtls_scheduler)
    async with tls_client(mtls_scheduler, tls) as client:  # TLS, but no client certificate
        with pytest.raises((DeadlineExceeded, ServiceUnavailable)):
            await client.status()
    async with FakeWorker(target(mtls_scheduler), "fw-nocert", credentials=worker_credentials(tls, False)) as w:
        error = await w.closed()
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert state(mtls_scheduler) == before


async def test_mtls_refuses_a_certificate_from_another_ca(mtls_scheduler, tls, other_ca):
    roots = tls.ca_cert.read_bytes()
    async with AsyncRolloutClient(target(mtls_scheduler), settings=ClientSettings(
            tls=True, root_certificates=roots, client_certificate=other_ca.client_cert.read_bytes(),
            client_key=other_ca.client_key.read_bytes(), **FAST_FAIL)) as client:
        with pytest.raises((DeadlineExceeded, ServiceUnavailable)):
            await client.status()


# -------------------------------------------------------------------- limits --

LIMITS = Limits(max_prompts=4, max_samples=2, max_lookahead=3, max_stop_strings=2)
MAX_MESSAGE = 64 * 1024


@pytest.fixture(scope="module")
async def limited():
    async with running(settings(limits=LIMITS, max_message_bytes=MAX_MESSAGE), dict(worker_id="fw-lim")) as scheduler:
        yield scheduler


LIMIT_CASES = [
    # id, generate() keyword arguments, field the status names, text the message carries
    ("prompt-length", dict(prompts=[tuple([5] * 600)]), "prompts[0]", "model length is 512"),
    ("prompt-plus-max-tokens", dict(prompts=[tuple([5] * 500)], sampling=replace(GREEDY, max_tokens=20)),
     "prompts[0].max_tokens", "exceeds the model length 512"),
    ("max-tokens", dict(sampling=replace(GREEDY, max_tokens=512)), "sampling.max_tokens", "between 1 and 511"),
    ("batch-size", dict(prompts=[(5, 6)] * 5), "prompts", "at most 4 prompts per step, got 5"),
    ("n", dict(n=3), "sampling.n", "between 1 and 2, got 3"),
    ("lookahead", dict(lookahead=[(5, 6)] * 4), "lookahead", "at most 3 prompts, got 4"),
    ("stop-strings", dict(sampling=replace(GREEDY, stop=("a", "b", "c"))), "sampling.stop", "at most 2"),
]


@pytest.mark.parametrize("name,kw,field,text", LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
async def test_limits_are_refused_naming_the_field(limited, name, kw, field, text):
    before = state(limited)
    kw = dict(kw)
    async with AsyncRolloutClient(target(limited), **FAST_FAIL) as client:
        with pytest.raises(InvalidArgument) as err:
            await client.generate(f"lim-{name}", kw.pop("prompts", [(5, 6)]), kw.pop("sampling", GREEDY), **kw)
    assert err.value.field == field and err.value.message.startswith(field + ":") and text in err.value.message
    assert state(limited) == before


async def test_announce_lookahead_limit(limited):
    before = state(limited)
    async with AsyncRolloutClient(target(limited), **FAST_FAIL) as client:
        with pytest.raises(InvalidArgument) as err:
            await client.announce([(5, 6)] * 4, GREEDY)
        assert err.value.field == "prompts" and "at most 3" in err.value.message
        assert state(limited) == before
        assert await client.announce([(5, 6)] * 3, GREEDY) == 3


async def test_message_size_limit(limited):
    before = state(limited)
    huge = [(5,) * 10, "x" * (2 * MAX_MESSAGE)]  # a text prompt bigger than the scheduler takes
    async with AsyncRolloutClient(target(limited), **FAST_FAIL) as client:
        with pytest.raises(ResourceExhausted) as err:
            await client.generate("lim-size", huge, GREEDY)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.message and str(MAX_MESSAGE) in err.value.message
    assert state(limited) == before


async def test_requests_right_at_the_limits_pass(limited):
    async with AsyncRolloutClient(target(limited), **FAST_FAIL) as client:
        result = await client.generate("lim-edge", [(5, 6), (6, 7), (7, 8), tuple([5] * 507)],
                                       replace(GREEDY, stop=("a", "b")), n=2, lookahead=[(9,)] * 3)
    assert len(result.completions) == 8 and result.summary.completions == 8


async def test_active_step_and_announced_prompt_caps_are_refused_over_grpc():
    """``CoreSettings.max_active_steps`` / ``max_announced_prompts`` through the SDK: the
    status and field reach the trainer, and nothing changes."""
    core = CoreSettings(drafting=False, max_active_steps=1, max_announced_prompts=2)
    async with running(settings(core=core), {"worker_id": "fw-cap", "auto": False}) as scheduler:
        slow = AsyncRolloutClient(target(scheduler), retry=Retry(attempts=1), timeout_seconds=30.0,
                                  step_timeout_seconds=120.0)
        held = asyncio.create_task(slow.generate("cap-held", [(5, 6)], GREEDY))  # the worker holds it
        try:
            await wait_until(lambda: "cap-held" in scheduler.core.steps, what="the held step to start")
            before = state(scheduler)
            async with AsyncRolloutClient(target(scheduler), **FAST_FAIL) as client:
                with pytest.raises(ResourceExhausted) as err:
                    await client.generate("cap-second", [(5, 7)], GREEDY)
                assert err.value.field == "step_id" and "max_active_steps" in err.value.message
                with pytest.raises(ResourceExhausted) as err:
                    await client.announce([(9, 1), (9, 2), (9, 3)], GREEDY)
                assert err.value.field == "prompts" and "over the limit of 2" in err.value.message
            assert state(scheduler) == before
        finally:
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
            await slow.close()


# ------------------------------------------------------------------- secrets --


SECRETS = (TRAINER_TOKEN, WORKER_TOKEN, REDIS_PASSWORD, JOURNAL_SECRET)


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"a secret leaked into {where}"


@pytest.fixture(scope="module")
def redis_with_password():
    if not redis_server_available():
        pytest.skip("redis-server is not installed")
    with RedisServer(password=REDIS_PASSWORD) as server:
        yield server


async def test_no_secret_in_logs_status_or_metrics(redis_with_password, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, every level
    s = settings(trainer_token=TRAINER_TOKEN, worker_token=WORKER_TOKEN, http_port=0,
                 redis_url=redis_with_password.url, redis_password=REDIS_PASSWORD, journal_secret=JOURNAL_SECRET)
    async with running(s, dict(worker_id="fw-secret", token=WORKER_TOKEN)) as scheduler:
        async with AsyncRolloutClient(target(scheduler), token=TRAINER_TOKEN, **FAST_FAIL) as client:
            await run_step(client, "secret-step", "fw-secret")
            rpc_status = await client.status()
        for wrong in ("", WORKER_TOKEN):  # refusals are logged too: never with the token
            async with AsyncRolloutClient(target(scheduler), token=wrong, **FAST_FAIL) as client:
                with pytest.raises(AuthenticationFailed):
                    await client.status()
        async with FakeWorker(target(scheduler), "fw-intruder", token=TRAINER_TOKEN) as intruder:
            await intruder.closed()
        await scheduler.service.journal.flush()  # the journal wrote to the password-protected Redis
        assert_no_secret(json.dumps(rpc_status), "the Status RPC")
        assert_no_secret((await http_get(scheduler.http_port, "/status", TRAINER_TOKEN)).decode(), "/status")
        assert_no_secret((await http_get(scheduler.http_port, "/metrics")).decode(), "/metrics")
    records = caplog.records
    assert records, "DEBUG logging captured nothing"
    assert_no_secret(caplog.text, "the logs")
    assert_no_secret(" ".join(repr(r.args) for r in records), "log arguments")


def test_settings_reprs_hide_secrets():
    objects = [
        SchedulerSettings(trainer_token=TRAINER_TOKEN, worker_token=WORKER_TOKEN, redis_url="redis://r:6379/0",
                          redis_password=REDIS_PASSWORD, journal_secret=JOURNAL_SECRET,
                          journal_redis_url=f"redis://:{REDIS_PASSWORD}@j:6379/0"),
        ClientSettings(token=TRAINER_TOKEN),
        WorkerSettings(token=WORKER_TOKEN),
        StoreSettings(url="redis://r:6379/0", password=REDIS_PASSWORD),
        StoreSettings(url=f"redis://user:{REDIS_PASSWORD}@r:6379/0"),
    ]
    for obj in objects:
        assert_no_secret(repr(obj), f"repr({type(obj).__name__})")
        assert_no_secret(str(obj), f"str({type(obj).__name__})")


def test_scheduler_settings_repr_redacts_a_password_in_the_redis_url():
    assert_no_secret(repr(SchedulerSettings(redis_url=f"redis://:{REDIS_PASSWORD}@r:6379/0")), "repr(SchedulerSettings)")
