"""In-process DraftStore: dicts of bounded deques, TTL checked on read with an injected clock.

Entries are kept encoded, as in Redis, so both backends accept and return the same values.
Used when ``StoreSettings.url`` is empty (single-process runs, tests, the embedded demo).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

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

__all__ = ["MemoryStore"]

T = TypeVar("T")


@dataclass
class _Slot(Generic[T]):
    """The newest-first items of one prompt and when they expire."""

    items: deque[T]
    expires_at: float = 0.0


class MemoryStore:
    """DraftStore kept in this process; see ``DraftStore`` for the contract."""

    def __init__(
        self,
        settings: StoreSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = (settings or StoreSettings()).validate()
        self._clock = clock
        self._drafts: dict[str, _Slot[bytes]] = {}
        self._lengths: dict[str, _Slot[int]] = {}
        self._stats = StatsRecorder()
        self._closed = False
        self._next_sweep_at = clock() + self._settings.ttl_seconds

    @property
    def stats(self) -> StoreStats:
        return self._stats.snapshot()

    async def put_draft(self, prompt_key: str, entry: DraftEntry) -> bool:
        check_prompt_key(prompt_key)
        encoded = encode_entry(entry)
        with self._op():
            return self._add_draft(prompt_key, encoded)

    async def remember(self, prompt_key: str, entry: DraftEntry) -> bool:
        check_prompt_key(prompt_key)
        encoded = encode_entry(entry)
        length = check_length(len(entry.tokens))
        with self._op():
            stored = self._add_draft(prompt_key, encoded)
            self._push(self._lengths, prompt_key, length, self._settings.max_lengths_per_prompt)
        return stored

    def _add_draft(self, prompt_key: str, encoded: bytes) -> bool:
        """Push an encoded draft (inside an operation); one over ``max_entry_bytes`` is counted
        and dropped, as Redis drops it."""
        if len(encoded) > self._settings.max_entry_bytes:
            self._stats.record_oversized()
            return False
        self._push(self._drafts, prompt_key, encoded, self._settings.max_entries_per_prompt)
        return True

    async def get_drafts(self, prompt_keys: Sequence[str]) -> dict[str, list[DraftEntry]]:
        keys = unique_prompt_keys(prompt_keys)
        if not keys:
            return {}
        with self._op():
            return {key: self._decode_all(self._read(self._drafts, key)) for key in keys}

    async def record_length(self, prompt_key: str, length: int) -> None:
        check_prompt_key(prompt_key)
        check_length(length)
        with self._op():
            self._push(self._lengths, prompt_key, length, self._settings.max_lengths_per_prompt)

    async def get_lengths(self, prompt_keys: Sequence[str]) -> dict[str, list[int]]:
        keys = unique_prompt_keys(prompt_keys)
        if not keys:
            return {}
        with self._op():
            return {key: self._read(self._lengths, key) for key in keys}

    async def ping(self) -> bool:
        return not self._closed

    async def close(self) -> None:
        self._closed = True
        self._drafts.clear()
        self._lengths.clear()

    @contextmanager
    def _op(self) -> Iterator[None]:
        started = time.perf_counter()
        failed = self._closed
        try:
            if self._closed:
                raise StoreUnavailable("memory store is closed")
            yield
        finally:
            self._stats.record_op(time.perf_counter() - started, failed=failed)

    def _push(self, table: dict[str, _Slot[T]], key: str, item: T, bound: int) -> None:
        now = self._clock()
        self._sweep(now)
        slot = table.get(key)
        if slot is None or slot.expires_at <= now:
            slot = table[key] = _Slot(deque(maxlen=bound))
        slot.items.appendleft(item)
        slot.expires_at = now + self._settings.ttl_seconds

    def _read(self, table: dict[str, _Slot[T]], key: str) -> list[T]:
        slot = table.get(key)
        if slot is None:
            return []
        if slot.expires_at <= self._clock():
            del table[key]
            return []
        return list(slot.items)

    def _decode_all(self, encoded: list[bytes]) -> list[DraftEntry]:
        entries = []
        for data in encoded:
            try:
                entries.append(decode_entry(data, self._settings.max_entry_bytes))
            except OversizedEntry:
                self._stats.record_oversized()
            except CorruptEntry:
                self._stats.record_corrupt()
        return entries

    def _sweep(self, now: float) -> None:
        """Drop expired prompts now and then, so unread prompts do not pile up."""
        if now < self._next_sweep_at:
            return
        for table in (self._drafts, self._lengths):
            expired = [key for key, slot in table.items() if slot.expires_at <= now]
            for key in expired:
                del table[key]
        self._next_sweep_at = now + self._settings.ttl_seconds
