"""One DraftStore contract, run against the memory store and a real redis-server.

Then the Redis-only parts: key layout, corrupt data written behind the store's back, AUTH,
TLS, operation timeouts, and ResilientStore riding out a killed and restarted server.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from bubblespec.store import (
    DraftEntry,
    DraftSource,
    DraftStore,
    MemoryStore,
    RedisStore,
    ResilientStore,
    StoreSettings,
    StoreUnavailable,
    open_store,
    prompt_key,
)
from bubblespec.store.codec import encode_entry
from bubblespec.store.redis_store import draft_key, length_key
from redis.crc import key_slot

from tests.support.clock import FakeClock
from tests.support.redis_server import RedisServer, redis_server_available
from tests.support.tls import TlsFiles, make_tls_files

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.skipif(not redis_server_available(), reason="redis-server is not installed"),
]

PROMPT_A = prompt_key([101, 102, 103])
PROMPT_B = prompt_key([201, 202])


def entry(n: int, source: DraftSource = DraftSource.FUTURE) -> DraftEntry:
    """The n-th test entry; distinct n give distinct entries."""
    return DraftEntry(
        (n, n + 1, n + 2),
        policy_version=n,
        step_id=f"step-{n}",
        source=source,
        created_at=1000.0 + n,
    )


def unique_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"


class Backend:
    """Makes stores of one kind that share a key prefix; ``advance`` moves their time."""

    def __init__(self, name: str, url: str = "") -> None:
        self.name = name
        self.url = url
        self.clock = FakeClock()
        self.key_prefix = unique_prefix()
        self._stores: list[DraftStore] = []

    def settings(self, **overrides: object) -> StoreSettings:
        return StoreSettings(url=self.url, key_prefix=self.key_prefix, **overrides)  # type: ignore

    def make(self, **overrides: object) -> DraftStore:
        settings = self.settings(**overrides)
        store: DraftStore = (
            MemoryStore(settings, clock=self.clock) if not self.url else RedisStore(settings)
        )
        self._stores.append(store)
        return store

    async def advance(self, seconds: float) -> None:
        """Fake time for memory; real time for Redis, whose TTLs run on the server's clock."""
        if self.url:
            await asyncio.sleep(seconds)
        else:
            self.clock.advance(seconds)

    async def close(self) -> None:
        for store in self._stores:
            await store.close()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else ""
    made = Backend(request.param, url)
    yield made
    await made.close()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


# --- the contract, on both backends ---------------------------------------------------------


async def test_drafts_come_back_newest_first_and_intact(backend: Backend) -> None:
    store = backend.make()
    written = [entry(1, DraftSource.HISTORY), entry(2, DraftSource.SIBLING), entry(3)]
    for item in written:
        await store.put_draft(PROMPT_A, item)
    assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: written[::-1]}


async def test_drafts_are_bounded_per_prompt(backend: Backend) -> None:
    store = backend.make(max_entries_per_prompt=3)
    for n in range(6):
        await store.put_draft(PROMPT_A, entry(n))
    await store.put_draft(PROMPT_B, entry(100))
    drafts = await store.get_drafts([PROMPT_A, PROMPT_B])
    assert drafts == {PROMPT_A: [entry(5), entry(4), entry(3)], PROMPT_B: [entry(100)]}


async def test_lengths_are_newest_first_and_bounded(backend: Backend) -> None:
    store = backend.make(max_lengths_per_prompt=4)
    for length in [10, 0, 30, 40, 50, 60]:
        await store.record_length(PROMPT_A, length)
    lengths = await store.get_lengths([PROMPT_A, PROMPT_B])
    assert lengths == {PROMPT_A: [60, 50, 40, 30], PROMPT_B: []}


async def test_drafts_and_lengths_are_separate(backend: Backend) -> None:
    store = backend.make()
    await store.put_draft(PROMPT_A, entry(1))
    await store.record_length(PROMPT_B, 7)
    assert await store.get_drafts([PROMPT_B]) == {PROMPT_B: []}
    assert await store.get_lengths([PROMPT_A]) == {PROMPT_A: []}


async def test_many_prompts_in_one_operation(backend: Backend) -> None:
    store = backend.make()
    keys = [prompt_key([n, n]) for n in range(200)]
    for n, key in enumerate(keys[:100]):
        await store.put_draft(key, entry(n))
        await store.record_length(key, n)
    ops_before = store.stats.ops
    drafts = await store.get_drafts(keys + keys[:5])
    lengths = await store.get_lengths(keys)
    assert store.stats.ops == ops_before + 2
    assert list(drafts) == keys and list(lengths) == keys
    assert all(drafts[key] == [entry(n)] for n, key in enumerate(keys[:100]))
    assert all(lengths[key] == [n] for n, key in enumerate(keys[:100]))
    assert all(drafts[key] == [] and lengths[key] == [] for key in keys[100:])


async def test_empty_request_needs_no_backend(backend: Backend) -> None:
    store = backend.make()
    assert await store.get_drafts([]) == {}
    assert await store.get_lengths([]) == {}


async def test_entries_expire_after_ttl_and_writes_refresh_it(backend: Backend) -> None:
    store = backend.make(ttl_seconds=1)
    await store.put_draft(PROMPT_A, entry(1))
    await store.record_length(PROMPT_A, 5)
    await backend.advance(0.6)
    await store.put_draft(PROMPT_A, entry(2))  # restarts the drafts' TTL, not the lengths'
    await backend.advance(0.6)
    assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(2), entry(1)]}
    assert await store.get_lengths([PROMPT_A]) == {PROMPT_A: []}
    await backend.advance(0.6)
    assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: []}
    await store.put_draft(PROMPT_A, entry(3))  # a fresh list, without the expired entries
    assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(3)]}


async def test_bad_arguments_raise_value_error(backend: Backend) -> None:
    store = backend.make()
    with pytest.raises(ValueError, match="prompt key"):
        await store.put_draft("", entry(1))
    with pytest.raises(ValueError, match="braces"):
        await store.get_drafts(["a{b}"])
    with pytest.raises(ValueError, match="length"):
        await store.record_length(PROMPT_A, -1)
    with pytest.raises(ValueError, match="sequence"):
        await store.get_lengths(PROMPT_A)
    with pytest.raises(ValueError, match="step_id"):
        await store.put_draft(PROMPT_A, DraftEntry((1,), 1, "x" * 300, DraftSource.FUTURE, 0.0))


async def test_stats_ping_and_close(backend: Backend) -> None:
    store = backend.make()
    assert await store.ping()
    await store.put_draft(PROMPT_A, entry(1))
    await store.get_drafts([PROMPT_A])
    stats = store.stats
    assert stats.ops >= 2 and stats.errors == 0 and stats.corrupt_entries == 0
    assert stats.op_seconds_sum > 0
    await store.close()
    await store.close()
    assert not await store.ping()
    with pytest.raises(StoreUnavailable):
        await store.get_drafts([PROMPT_A])
    assert store.stats.errors >= 1


async def test_oversized_drafts_are_dropped_on_write_and_counted(backend: Backend) -> None:
    store = backend.make(max_entry_bytes=1024)
    big = DraftEntry(tuple(range(300)), 1, "step-big", DraftSource.FUTURE, 1.0)  # 1,242 bytes encoded
    assert await store.put_draft(PROMPT_A, entry(1)) is True
    assert await store.put_draft(PROMPT_A, big) is False  # dropped, not raised: drafts only cost speed
    assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(1)]}
    assert store.stats.oversized_entries == 1 and store.stats.errors == 0


async def test_remember_stores_the_draft_and_its_length_in_one_operation(backend: Backend) -> None:
    store = backend.make(max_entry_bytes=1024, max_entries_per_prompt=2, max_lengths_per_prompt=2)
    big = DraftEntry(tuple(range(300)), 1, "step-big", DraftSource.HISTORY, 1.0)  # 1,242 bytes encoded
    await store.put_draft(PROMPT_A, entry(1))
    ops = store.stats.ops
    assert await store.remember(PROMPT_A, entry(2, DraftSource.HISTORY)) is True
    assert store.stats.ops == ops + 1  # memory: its two parts are in-process; Redis: one pipeline
    assert await store.remember(PROMPT_A, big) is False  # the draft dropped and counted, the length kept
    assert await store.remember(PROMPT_A, entry(3, DraftSource.HISTORY)) is True
    assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(3, DraftSource.HISTORY), entry(2, DraftSource.HISTORY)]}
    assert await store.get_lengths([PROMPT_A]) == {PROMPT_A: [3, 300]}  # bounded, newest first
    assert store.stats.oversized_entries == 1 and store.stats.errors == 0
    with pytest.raises(ValueError):
        await store.remember("bad{key}", entry(4))
    assert await store.get_lengths([PROMPT_B]) == {PROMPT_B: []}
    resilient = ResilientStore(store, backend.settings())
    assert await resilient.remember(PROMPT_B, entry(5)) is True
    assert await resilient.get_lengths([PROMPT_B]) == {PROMPT_B: [3]}


async def test_resilient_wrapper_passes_results_through(backend: Backend) -> None:
    store = ResilientStore(backend.make(), backend.settings())
    assert await store.put_draft(PROMPT_A, entry(1)) is True
    await store.record_length(PROMPT_A, 9)
    assert await store.get_drafts([PROMPT_A, PROMPT_B]) == {PROMPT_A: [entry(1)], PROMPT_B: []}
    assert await store.get_lengths([PROMPT_A]) == {PROMPT_A: [9]}
    assert store.available and await store.ping()


async def test_open_store_picks_the_backend(backend: Backend) -> None:
    store = open_store(backend.settings())
    expected = RedisStore if backend.url else MemoryStore
    assert isinstance(store, expected) and isinstance(store, DraftStore)
    wrapped = open_store(backend.settings(), resilient=True)
    assert isinstance(wrapped, ResilientStore) and isinstance(wrapped.inner, expected)
    await store.close()
    await wrapped.close()


# --- Redis only ------------------------------------------------------------------------------


def redis_settings(url: str, **overrides: object) -> StoreSettings:
    return StoreSettings(url=url, key_prefix=unique_prefix(), **overrides)  # type: ignore[arg-type]


async def test_redis_layout_uses_hash_tags_and_ttl(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    settings = redis_settings(redis_server.url, ttl_seconds=600)
    store = RedisStore(settings)
    await store.put_draft(PROMPT_A, entry(1))
    await store.record_length(PROMPT_A, 3)
    drafts = draft_key(settings.key_prefix, PROMPT_A)
    lengths = length_key(settings.key_prefix, PROMPT_A)
    assert drafts == f"{settings.key_prefix}{{{PROMPT_A}}}:d"
    assert key_slot(drafts.encode()) == key_slot(lengths.encode()) == key_slot(PROMPT_A.encode())
    assert 0 < redis_client.ttl(drafts) <= 600 and 0 < redis_client.ttl(lengths) <= 600
    assert redis_client.lrange(lengths, 0, -1) == [b"3"]
    await store.close()


async def test_redis_oversized_and_corrupt_entries_are_skipped_counted_and_never_raise(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    settings = redis_settings(redis_server.url, max_entry_bytes=1024)
    store = RedisStore(settings)
    resilient = ResilientStore(store, settings)
    await store.put_draft(PROMPT_A, entry(1))
    big = DraftEntry(tuple(range(300)), 1, "step-big", DraftSource.FUTURE, 1.0)
    key = draft_key(settings.key_prefix, PROMPT_A)
    redis_client.lpush(key, encode_entry(big))  # valid, but over the cap: written behind the store's back
    redis_client.lpush(key, b"BSD1" + b"\xff" * 4000)  # over the cap and corrupt: counted as oversized
    redis_client.lpush(key, b"BSD1\x01garbage")  # small and corrupt
    assert await resilient.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(1)]}
    assert resilient.available
    assert store.stats.oversized_entries == 2 and store.stats.corrupt_entries == 1 and store.stats.errors == 0
    await store.close()


async def test_redis_corrupt_data_is_skipped_and_counted(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    settings = redis_settings(redis_server.url)
    store = RedisStore(settings)
    await store.put_draft(PROMPT_A, entry(1))
    redis_client.lpush(draft_key(settings.key_prefix, PROMPT_A), b"not an entry", b"BSD1\x01")
    await store.put_draft(PROMPT_A, entry(2))
    await store.record_length(PROMPT_A, 4)
    redis_client.lpush(length_key(settings.key_prefix, PROMPT_A), b"many", b"-3")
    assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(2), entry(1)]}
    assert await store.get_lengths([PROMPT_A]) == {PROMPT_A: [4]}
    assert store.stats.corrupt_entries == 4 and store.stats.errors == 0
    await store.close()


@pytest.fixture(scope="module")
def redis_with_password() -> Iterator[RedisServer]:
    with RedisServer(password="correct horse") as server:
        yield server


@pytest.mark.parametrize("password", ["correct horse", "wrong", ""])
async def test_redis_password(redis_with_password: RedisServer, password: str) -> None:
    store = RedisStore(redis_settings(redis_with_password.url, password=password))
    if password == "correct horse":
        await store.put_draft(PROMPT_A, entry(1))
        assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(1)]}
        assert await store.ping()
    else:
        with pytest.raises(StoreUnavailable):
            await store.put_draft(PROMPT_A, entry(1))
        with pytest.raises(StoreUnavailable):
            await store.get_drafts([PROMPT_A])
        assert not await store.ping()
        assert store.stats.errors == 3
    await store.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    files = make_tls_files(Path(tmp_path_factory.mktemp("tls")))
    if files is None:
        pytest.skip("openssl is not installed")
    return files


@pytest.fixture(scope="module", params=[False, True], ids=["server-auth", "mutual-tls"])
def redis_with_tls(request: pytest.FixtureRequest, tls_files: TlsFiles) -> Iterator[RedisServer]:
    server = RedisServer(tls=tls_files, password="tls-pass", require_client_cert=request.param)
    with server:
        yield server


def tls_settings(
    server: RedisServer, tls_files: TlsFiles, *, ca: bool, cert: bool
) -> StoreSettings:
    files: dict[str, str] = {}
    if ca:
        files["tls_ca_file"] = str(tls_files.ca_cert)
    if cert:
        files["tls_cert_file"] = str(tls_files.client_cert)
        files["tls_key_file"] = str(tls_files.client_key)
    return redis_settings(server.url, password="tls-pass", **files)


async def test_redis_over_tls(redis_with_tls: RedisServer, tls_files: TlsFiles) -> None:
    settings = tls_settings(redis_with_tls, tls_files, ca=True, cert=True)
    store = RedisStore(settings)
    await store.put_draft(PROMPT_A, entry(1))
    assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(1)]}
    await store.close()


async def test_redis_tls_without_client_cert(
    redis_with_tls: RedisServer, tls_files: TlsFiles
) -> None:
    store = RedisStore(tls_settings(redis_with_tls, tls_files, ca=True, cert=False))
    if redis_with_tls.require_client_cert:
        with pytest.raises(StoreUnavailable):
            await store.get_drafts([PROMPT_A])
    else:
        assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: []}
    await store.close()


async def test_redis_tls_refuses_an_unknown_ca(
    redis_with_tls: RedisServer, tls_files: TlsFiles
) -> None:
    store = RedisStore(tls_settings(redis_with_tls, tls_files, ca=False, cert=True))
    with pytest.raises(StoreUnavailable):
        await store.get_drafts([PROMPT_A])
    await store.close()


async def test_redis_operations_are_bounded_by_op_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        store = RedisStore(redis_settings(url, op_timeout_seconds=0.2))
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.get_drafts([PROMPT_A])
        assert time.monotonic() - started < 3.0  # unbounded, it would wait forever
        await store.close()


async def test_a_connection_left_idle_across_a_restart_costs_no_drafting_window() -> None:
    """A pooled connection made before Redis restarted is broken on its next use: the store
    retries that operation once on a fresh connection, so the breaker stays closed."""
    with RedisServer() as server:
        settings = redis_settings(server.url, retry_after_seconds=5.0, op_timeout_seconds=5.0)
        inner = RedisStore(settings)
        store = ResilientStore(inner, settings)
        await store.put_draft(PROMPT_A, entry(1))  # the pool now holds a connection
        server.kill()
        server.start()  # nothing used the store meanwhile: its pooled connection is stale
        await store.put_draft(PROMPT_A, entry(2))
        assert store.available and inner.stats.errors == 0
        assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(2)]}  # a fresh server: only the new one
        await store.close()


async def test_resilient_store_rides_out_a_killed_redis() -> None:
    clock = FakeClock()
    with RedisServer() as server:
        # a killed server refuses connections at once; the timeout only has to spare a slow
        # machine's healthy operations (0.3 s once timed out the first write under CI load)
        settings = redis_settings(server.url, retry_after_seconds=5.0, op_timeout_seconds=5.0)
        inner = RedisStore(settings)
        store = ResilientStore(inner, settings, clock=clock)
        await store.put_draft(PROMPT_A, entry(1))
        assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(1)]}

        server.kill()
        assert await store.get_drafts([PROMPT_A, PROMPT_B]) == {PROMPT_A: [], PROMPT_B: []}
        assert not store.available and inner.stats.errors == 1
        assert await store.put_draft(PROMPT_A, entry(2)) is False  # dropped without calling Redis
        assert await store.get_lengths([PROMPT_A]) == {PROMPT_A: []}
        assert inner.stats.errors == 1 and store.skipped_ops == 2

        clock.advance(5.0)  # the window is over: try again, fail again, wait again
        await store.record_length(PROMPT_A, 3)
        assert inner.stats.errors == 2 and not store.available

        server.start()
        clock.advance(5.0)
        await store.put_draft(PROMPT_A, entry(3))
        assert store.available
        assert await store.get_drafts([PROMPT_A]) == {PROMPT_A: [entry(3)]}
        assert store.stats == inner.stats
        await store.close()
