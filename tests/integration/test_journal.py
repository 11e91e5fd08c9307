"""The step journal trusts Redis for nothing: real scheduler restarts on loopback gRPC, scripted
workers on the real WorkerLink stream, a real redis-server written to behind the scheduler's back.

- Journal records carry an HMAC-SHA256 keyed by ``journal_secret`` over key, field and value:
  a record without one, with a wrong one, signed with another secret, or moved to another
  request or step is dropped, counted (``bubblespec_journal_rejected_total``) and not replayed;
  the restarted scheduler runs those requests again.
- Authentic records are checked like live completions: a token outside the vocabulary, another
  policy version or a sample index outside the step is dropped the same way.
- The policy record is authenticated: a forged path is never sent to workers.
- A step's record is trimmed to ``journal_finished_ttl_seconds`` once its summary is sent.
- No secret: no journal (warned); a short secret is refused naming the field; a journal Redis
  that evicts keys is warned about.

No vLLM: workers are ``tests/support/fake_worker.FakeWorker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import pytest
import redis

from bubblespec.client import AsyncRolloutClient, FinishReason, Provenance, Retry, SamplingParams
from bubblespec.common.types import Completion
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.journal import StepJournal
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.store import StoreSettings
from tests.support.fake_worker import FakeWorker, fake_tokens, wait_until
from tests.support.redis_server import RedisServer, redis_server_available

pytestmark = pytest.mark.skipif(not redis_server_available(), reason="redis-server is not installed")

SECRET = "journal-secret-5c1e0a9b7d3f"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPTS = [(5, 6, 7), (8, 9)]
FAST_FAIL = dict(retry=Retry(attempts=1), timeout_seconds=5.0, step_timeout_seconds=5.0)
PREFIX = "bubblespec:{sched}:"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def settings(url: str, **over) -> SchedulerSettings:
    base = dict(host="127.0.0.1", grpc_port=0, http_port=0, drain_seconds=1.0, redis_url=url,
                journal_secret=SECRET, core=CoreSettings(drafting=False))
    base.update(over)
    return SchedulerSettings(**base)


@contextlib.asynccontextmanager
async def running(s: SchedulerSettings, auto: bool = True) -> AsyncIterator[tuple[Scheduler, list]]:
    """A started scheduler with one fake worker ``fw-j`` (answering at once with ``auto``), and
    the completions the scheduler delivers (replays excluded)."""
    scheduler = Scheduler(s)
    delivered: list = []
    scheduler.service.listeners.append(lambda a: delivered.append(a.completion) if type(a).__name__ == "Deliver"
                                       else None)
    await scheduler.start()
    worker = await FakeWorker(f"127.0.0.1:{scheduler.grpc_port}", "fw-j", policy_version=scheduler.core.version,
                              auto=auto).start()
    scheduler.fake_worker = worker  # type: ignore[attr-defined]
    try:
        await wait_until(lambda: "fw-j" in scheduler.core.workers, what="the fake worker to join")
        yield scheduler, delivered
    finally:
        await worker.stop()
        await scheduler.stop(1.0)


async def generate(scheduler: Scheduler, step: str):
    async with AsyncRolloutClient(f"127.0.0.1:{scheduler.grpc_port}", **FAST_FAIL) as client:
        return await client.generate(step, PROMPTS, GREEDY, n=2)


async def metric(port: int, name: str) -> float:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return resp.read().decode()

    text = await asyncio.to_thread(get)
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def signer(url: str, secret: str = SECRET) -> StepJournal:
    """A journal holding ``secret``: what writes authentic records (here: authentic but wrong)."""
    return StepJournal(StoreSettings(url=url), secret.encode())


def bad_completion(step: str, prompt: str, sample: int, **over) -> Completion:
    c = Completion(step, prompt, sample, (1, 2), (-0.5, -0.5), "", FinishReason.STOP, 0, "forger", 3,
                   Provenance(forward_passes=2))
    return replace(c, **over)


def expected() -> list[tuple[str, int, tuple[int, ...]]]:
    return [(f"p{i}", s, fake_tokens(p, 4)) for i, p in enumerate(PROMPTS) for s in range(2)]


def result_rows(result) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(c.prompt_id, c.sample_index, c.token_ids) for c in result.completions]


# ------------------------------------------------------------------ replay --


async def test_authentic_records_replay_after_a_restart(redis_server: RedisServer) -> None:
    async with running(settings(redis_server.url)) as (first, _):
        assert result_rows(await generate(first, "ok-1")) == expected()
        await first.service.journal.flush()
    async with running(settings(redis_server.url)) as (second, delivered):
        result = await generate(second, "ok-1")  # a trainer retrying after the restart
        assert result_rows(result) == expected()
        assert delivered == [], "every completion came from the journal"
        assert second.service.journal.rejected == 0


async def test_forged_and_moved_records_are_not_replayed(redis_server: RedisServer, r: redis.Redis) -> None:
    url = redis_server.url
    async with running(settings(url)) as (first, _):
        await generate(first, "donor")
        await generate(first, "forge-1")
        await first.service.journal.flush()
    key = PREFIX + "step:forge-1"
    raw = r.hgetall(key)
    genuine = raw[b"forge-1/p0/0"][32:]  # the protobuf behind the MAC
    r.hset(key, "forge-1/p0/0", genuine)  # valid protobuf, MAC stripped
    r.hset(key, "forge-1/p0/1", raw[b"forge-1/p0/1"][:-1] + bytes([raw[b"forge-1/p0/1"][-1] ^ 1]))  # one bit flipped
    r.hset(key, "forge-1/p1/0", raw[b"forge-1/p1/1"])  # moved to another request of the step
    r.hset(key, "forge-1/p1/1", r.hget(PREFIX + "step:donor", "donor/p1/1"))  # moved from another step
    async with running(settings(url)) as (second, delivered):
        result = await generate(second, "forge-1")
        assert result_rows(result) == expected()
        assert sorted((c.prompt_id, c.sample_index) for c in delivered) == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]
        assert second.service.journal.rejected == 4
        assert await metric(second.http_port, "bubblespec_journal_rejected_total") == 4


async def test_authentic_but_invalid_records_are_checked_like_live_completions(redis_server: RedisServer) -> None:
    url = redis_server.url
    async with running(settings(url)) as (first, _):
        await generate(first, "check-1")
        await first.service.journal.flush()
    forger = signer(url)
    forger.start()
    forger.save_completion("check-1/p0/0", bad_completion("check-1", "p0", 0, token_ids=(1, 128)))  # vocab is 128
    forger.save_completion("check-1/p0/1", bad_completion("check-1", "p0", 1, policy_version=9))
    forger.save_completion("check-1/p1/0", bad_completion("check-1", "p1", 1))  # body names another request
    forger.save_completion("check-1/p1/5", bad_completion("check-1", "p1", 5))  # sample index beyond n=2
    await forger.close()
    async with running(settings(url)) as (second, delivered):
        result = await generate(second, "check-1")
        assert result_rows(result) == expected(), "no forged token reached the trainer"
        assert sorted((c.prompt_id, c.sample_index) for c in delivered) == [("p0", 0), ("p0", 1), ("p1", 0)]
        assert second.service.journal.rejected == 4


async def test_a_record_signed_with_another_secret_is_not_replayed(redis_server: RedisServer) -> None:
    url = redis_server.url
    async with running(settings(url, journal_secret="another-secret-0123456789")) as (first, _):
        await generate(first, "other-key")
        await first.service.journal.flush()
    async with running(settings(url)) as (second, delivered):
        assert result_rows(await generate(second, "other-key")) == expected()
        assert len(delivered) == 4, "nothing replayed: the step ran afresh"
        assert second.service.journal.rejected == 1  # the fingerprint (the rest is ignored with it)


# ------------------------------------------------------------------ policy --


async def test_a_forged_policy_record_is_ignored(redis_server: RedisServer, r: redis.Redis) -> None:
    r.set(PREFIX + "policy", b'{"version": 7, "weights_path": "/attacker/weights"}')
    scheduler = Scheduler(settings(redis_server.url))
    await scheduler.start()
    try:
        assert (scheduler.core.version, scheduler.core.weights_path) == (0, "")
        assert scheduler.service.journal.rejected == 1
    finally:
        await scheduler.stop(0)
    forger = signer(redis_server.url, "another-secret-0123456789")
    forger.start()
    forger.save_policy(7, "/attacker/weights")
    await forger.close()
    scheduler = Scheduler(settings(redis_server.url))
    await scheduler.start()
    try:
        assert (scheduler.core.version, scheduler.core.weights_path) == (0, "")
    finally:
        await scheduler.stop(0)
    genuine = signer(redis_server.url)  # control: an authentic record is restored
    genuine.start()
    genuine.save_policy(3, "/weights/v3")
    await genuine.close()
    scheduler = Scheduler(settings(redis_server.url))
    await scheduler.start()
    try:
        assert (scheduler.core.version, scheduler.core.weights_path) == (3, "/weights/v3")
    finally:
        await scheduler.stop(0)
        r.delete(PREFIX + "policy")


# ------------------------------------------------------------------ trimming --


async def test_a_delivered_step_is_trimmed_but_a_retry_right_after_still_replays(
        redis_server: RedisServer, r: redis.Redis) -> None:
    s = settings(redis_server.url, journal_finished_ttl_seconds=30)
    async with running(s, auto=False) as (first, _):
        gen = asyncio.create_task(generate(first, "trim-1"))
        worker = first.fake_worker
        await wait_until(lambda: len(worker.assignments) == 4, what="the step's assignments")
        worker.complete()
        await wait_until(lambda: len(first.core.steps["trim-1"].completions) == 1, what="a first completion")
        await first.service.journal.flush()
        assert r.ttl(PREFIX + "step:trim-1") > 3600, "a running step's record lives for hours"
        for _ in range(3):
            worker.complete()
        await gen
        await first.service.journal.flush()
        assert 0 < r.ttl(PREFIX + "step:trim-1") <= 30
    async with running(s) as (second, delivered):
        assert result_rows(await generate(second, "trim-1")) == expected()
        assert delivered == []


# ------------------------------------------------------------------ settings --


async def test_no_secret_means_no_journal_and_a_warning(redis_server: RedisServer, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="bubblespec.scheduler.server")
    scheduler = Scheduler(settings(redis_server.url, journal_secret=""))
    assert scheduler.service.journal is None
    assert "journal_secret" in caplog.text and SECRET not in caplog.text


def test_a_short_secret_is_refused_naming_the_field(redis_server: RedisServer) -> None:
    with pytest.raises(ValueError, match="journal_secret"):
        Scheduler(settings(redis_server.url, journal_secret="short"))


async def test_the_journal_can_live_in_its_own_redis(redis_server: RedisServer, r: redis.Redis, caplog) -> None:
    caplog.set_level(logging.WARNING)
    with RedisServer() as journal_redis:
        s = settings(redis_server.url, journal_redis_url=journal_redis.url)
        async with running(s) as (first, _):
            await generate(first, "own-redis")
            await first.service.journal.flush()
        own = redis.Redis.from_url(journal_redis.url)
        assert own.exists(PREFIX + "step:own-redis") == 1 and r.exists(PREFIX + "step:own-redis") == 0
        own.close()
    assert "shares the draft store" not in caplog.text and "evicts keys" not in caplog.text


async def test_a_journal_redis_that_evicts_is_warned_about(redis_server: RedisServer, r: redis.Redis, caplog) -> None:
    caplog.set_level(logging.WARNING)
    r.config_set("maxmemory-policy", "allkeys-lru")
    try:
        scheduler = Scheduler(settings(redis_server.url))
        await scheduler.start()
        await scheduler.stop(0)
    finally:
        r.config_set("maxmemory-policy", "noeviction")
    assert "maxmemory-policy allkeys-lru" in caplog.text
    assert "shares the draft store" in caplog.text
