"""DraftStore on Redis (``redis.asyncio``); the only module of the package that imports redis.

Layout, with ``P`` the key prefix and ``K`` the prompt key::

    P{K}:d   list of encoded DraftEntry (codec.py), newest first, LTRIM-bounded, EXPIRE ttl
    P{K}:l   list of response lengths as decimal strings, newest first, bounded, EXPIRE ttl

The braces are a Redis Cluster hash tag: both keys of a prompt hash to the same slot.
Writes are one non-transactional pipeline (LPUSH, LTRIM, EXPIRE); reads of many prompts are
one pipeline of LRANGE. Every operation is bounded by ``op_timeout_seconds`` and is not
retried here: any redis error, OSError or timeout becomes ``StoreUnavailable`` and the
caller (``ResilientStore``) decides when to try again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from .base import StatsRecorder, StoreStats
from .codec import decode_entry, encode_entry
from .settings import StoreSettings
from .types import (
    CorruptEntry,
    DraftEntry,
    OversizedEntry,
    StoreUnavailable,
    check_length,
    check_prompt_key,
    unique_prompt_keys,
)

__all__ = ["RedisStore", "draft_key", "length_key", "redis_client"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def draft_key(key_prefix: str, prompt_key: str) -> str:
    """Redis key of the prompt's draft list."""
    return f"{key_prefix}{{{prompt_key}}}:d"


def length_key(key_prefix: str, prompt_key: str) -> str:
    """Redis key of the prompt's length list."""
    return f"{key_prefix}{{{prompt_key}}}:l"


class RedisStore:
    """DraftStore on a Redis server; see ``DraftStore`` for the contract."""

    def __init__(self, settings: StoreSettings) -> None:
        settings.validate()
        if settings.backend != "redis":
            raise ValueError("url must be a redis:// or rediss:// URL for RedisStore")
        self._settings = settings
        self._client = redis_client(settings)
        self._stats = StatsRecorder()
        self._closed = False
        logger.info("draft store: redis at %s", settings.redacted_url)

    @property
    def stats(self) -> StoreStats:
        return self._stats.snapshot()

    async def put_draft(self, prompt_key: str, entry: DraftEntry) -> bool:
        key = draft_key(self._settings.key_prefix, check_prompt_key(prompt_key))
        bound = self._settings.max_entries_per_prompt
        encoded = encode_entry(entry)
        if not self._fits(encoded, prompt_key):
            return False
        await self._run("put_draft", lambda: self._push_all([(key, encoded, bound)]))
        return True

    def _fits(self, encoded: bytes, prompt_key: str) -> bool:
        """Whether an encoded draft is within ``max_entry_bytes``; one that is not is counted
        and logged, and not written."""
        if len(encoded) <= self._settings.max_entry_bytes:
            return True
        self._stats.record_oversized()
        logger.warning("draft store: not writing a %d-byte draft of prompt %s (max_entry_bytes %d)",
                       len(encoded), prompt_key, self._settings.max_entry_bytes)
        return False

    async def remember(self, prompt_key: str, entry: DraftEntry) -> bool:
        """One pipeline: the draft's three commands (none for an oversized entry) and the length's."""
        check_prompt_key(prompt_key)
        prefix, s = self._settings.key_prefix, self._settings
        encoded = encode_entry(entry)
        stored = self._fits(encoded, prompt_key)
        pushes: list[tuple[str, bytes | int, int]] = [(draft_key(prefix, prompt_key), encoded, s.max_entries_per_prompt)] \
            if stored else []
        pushes.append((length_key(prefix, prompt_key), check_length(len(entry.tokens)), s.max_lengths_per_prompt))
        await self._run("remember", lambda: self._push_all(pushes))
        return stored

    async def get_drafts(self, prompt_keys: Sequence[str]) -> dict[str, list[DraftEntry]]:
        keys = unique_prompt_keys(prompt_keys)
        if not keys:
            return {}
        redis_keys = [draft_key(self._settings.key_prefix, key) for key in keys]
        bound = self._settings.max_entries_per_prompt
        raw = await self._read_lists("get_drafts", redis_keys, bound)
        return {key: self._decode_entries(key, items) for key, items in zip(keys, raw, strict=True)}

    async def record_length(self, prompt_key: str, length: int) -> None:
        key = length_key(self._settings.key_prefix, check_prompt_key(prompt_key))
        bound = self._settings.max_lengths_per_prompt
        value = check_length(length)
        await self._run("record_length", lambda: self._push_all([(key, value, bound)]))

    async def get_lengths(self, prompt_keys: Sequence[str]) -> dict[str, list[int]]:
        keys = unique_prompt_keys(prompt_keys)
        if not keys:
            return {}
        redis_keys = [length_key(self._settings.key_prefix, key) for key in keys]
        bound = self._settings.max_lengths_per_prompt
        raw = await self._read_lists("get_lengths", redis_keys, bound)
        return {key: self._decode_lengths(key, items) for key, items in zip(keys, raw, strict=True)}

    async def ping(self) -> bool:
        try:
            return bool(await self._run("ping", self._client.ping))
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._client.aclose()
        except (RedisError, OSError) as exc:
            logger.debug("draft store: error while closing redis client: %s", exc)

    async def _push_all(self, pushes: list[tuple[str, bytes | int, int]]) -> None:
        """Each (key, value, bound): the value as the list's newest, the list cut to its bound
        and its TTL restarted; all in one pipeline (one round trip)."""
        async with self._client.pipeline(transaction=False) as pipe:
            for key, value, bound in pushes:
                pipe.lpush(key, value)
                pipe.ltrim(key, 0, bound - 1)
                pipe.expire(key, self._settings.ttl_seconds)
            await pipe.execute()

    async def _read_lists(self, what: str, keys: list[str], bound: int) -> list[list[bytes]]:
        async def op() -> list[list[bytes]]:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.lrange(key, 0, bound - 1)
                return await pipe.execute()

        return await self._run(what, op)

    async def _run(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run one bounded backend operation, count it, and map failures to StoreUnavailable."""
        started = time.perf_counter()
        failed = True
        try:
            if self._closed:
                raise StoreUnavailable("redis store is closed")
            async with asyncio.timeout(self._settings.op_timeout_seconds):
                result = await op()
            failed = False
            return result
        except (RedisError, OSError) as exc:  # builtin TimeoutError is an OSError
            reason = str(exc) or type(exc).__name__
            raise StoreUnavailable(f"redis {what} failed: {reason}") from exc
        finally:
            self._stats.record_op(time.perf_counter() - started, failed=failed)

    def _decode_entries(self, prompt_key: str, items: list[bytes]) -> list[DraftEntry]:
        entries: list[DraftEntry] = []
        for data in items:
            try:
                entries.append(decode_entry(data, self._settings.max_entry_bytes))
            except OversizedEntry as exc:
                self._stats.record_oversized()
                logger.warning("draft store: skipped oversized draft entry of prompt %s: %s", prompt_key, exc)
            except CorruptEntry as exc:
                self._skip_corrupt("draft entry", prompt_key, exc)
        return entries

    def _decode_lengths(self, prompt_key: str, items: list[bytes]) -> list[int]:
        lengths: list[int] = []
        for data in items:
            try:
                lengths.append(check_length(int(data)))
            except ValueError as exc:
                self._skip_corrupt("length", prompt_key, exc)
        return lengths

    def _skip_corrupt(self, what: str, prompt_key: str, exc: Exception) -> None:
        self._stats.record_corrupt()
        logger.warning("draft store: skipped corrupt %s of prompt %s: %s", what, prompt_key, exc)


def redis_client(settings: StoreSettings) -> Redis:
    """A ``redis.asyncio`` client with the store's timeouts, password and TLS settings.

    The pool blocks (up to the operation timeout) instead of failing when every connection is
    busy, so a burst of concurrent lookups waits rather than tripping the circuit breaker.
    """
    from redis.asyncio import BlockingConnectionPool

    pool = BlockingConnectionPool.from_url(settings.url, max_connections=64,
                                           timeout=settings.op_timeout_seconds, **_client_options(settings))
    return Redis(connection_pool=pool)


def _client_options(settings: StoreSettings) -> dict[str, Any]:
    """Keyword arguments of ``Redis.from_url``: timeouts, password, TLS files, and one retry, on
    a fresh connection, of an operation whose connection broke (never of a timeout: a hung
    server costs one timeout per operation, no more). A pooled connection that sat idle
    across a Redis restart breaks on first use; without the retry that cost the circuit
    breaker's whole window of drafts. The retry can repeat a write that reached Redis before
    the connection broke: a draft or length stored twice, which costs a list slot, nothing more."""
    options: dict[str, Any] = {
        "socket_timeout": settings.op_timeout_seconds,
        "socket_connect_timeout": settings.op_timeout_seconds,
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        "decode_responses": False,
    }
    if settings.password:
        options["password"] = settings.password
    if settings.uses_tls:
        tls_files = {
            "ssl_ca_certs": settings.tls_ca_file,
            "ssl_certfile": settings.tls_cert_file,
            "ssl_keyfile": settings.tls_key_file,
        }
        options.update({name: path for name, path in tls_files.items() if path})
    return options
