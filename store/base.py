"""The DraftStore protocol every backend implements, and its statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .types import DraftEntry

__all__ = ["DraftStore", "StatsRecorder", "StoreStats"]


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters of one store since it was opened; an exporter turns them into metrics."""

    ops: int = 0
    """Operations attempted against the backend."""
    errors: int = 0
    """Operations that failed (backend unreachable, refused or timed out)."""
    corrupt_entries: int = 0
    """Stored entries or lengths that could not be decoded and were skipped."""
    op_seconds_sum: float = 0.0
    """Total wall time spent in operations, in seconds."""
    oversized_entries: int = 0
    """Draft entries over ``max_entry_bytes``: not written, or skipped unread when read back."""


class StatsRecorder:
    """Mutable counters behind ``StoreStats``; one per store, owned by composition."""

    def __init__(self) -> None:
        self._ops = 0
        self._errors = 0
        self._corrupt = 0
        self._oversized = 0
        self._seconds = 0.0

    def record_op(self, seconds: float, *, failed: bool = False) -> None:
        """Count one operation that took ``seconds``."""
        self._ops += 1
        self._seconds += seconds
        if failed:
            self._errors += 1

    def record_corrupt(self, count: int = 1) -> None:
        """Count ``count`` skipped undecodable entries."""
        self._corrupt += count

    def record_oversized(self, count: int = 1) -> None:
        """Count ``count`` draft entries dropped for being over the size cap."""
        self._oversized += count

    def snapshot(self) -> StoreStats:
        """Return the counters as a frozen value."""
        return StoreStats(self._ops, self._errors, self._corrupt, self._seconds, self._oversized)


@runtime_checkable
class DraftStore(Protocol):
    """Per-prompt draft entries and response lengths, newest first, bounded, with a TTL.

    Prompts are named by ``prompt_key(token_ids)``. Backends raise ``StoreUnavailable``
    when they cannot reach their storage; wrap them in ``ResilientStore`` to turn that into
    empty results. Corrupt stored data is skipped and counted, never raised.
    """

    @property
    def stats(self) -> StoreStats:
        """Counters since the store was opened."""
        ...

    async def put_draft(self, prompt_key: str, entry: DraftEntry) -> bool:
        """Add ``entry`` as the newest draft of the prompt, drop the oldest beyond the bound
        ``max_entries_per_prompt`` and restart the prompt's TTL. Returns whether the entry is
        now stored: False for an entry over ``max_entry_bytes`` (not written, counted in
        ``oversized_entries``). A caller that reports a draft as made (a draft job's result)
        counts only what this returned True for."""
        ...

    async def remember(self, prompt_key: str, entry: DraftEntry) -> bool:
        """A finished response: ``put_draft(prompt_key, entry)`` and ``record_length(prompt_key,
        len(entry.tokens))`` in one round trip (a worker does both for every response it ends).
        Returns what ``put_draft`` does; the length is recorded whatever it returns."""
        ...

    async def get_drafts(self, prompt_keys: Sequence[str]) -> dict[str, list[DraftEntry]]:
        """Return the drafts of every given prompt, newest first, in one round trip.

        Every requested key is in the result; prompts without drafts map to ``[]``.
        """
        ...

    async def record_length(self, prompt_key: str, length: int) -> None:
        """Add a response length (tokens, >= 0) as the prompt's newest, bounded by
        ``max_lengths_per_prompt``, and restart the TTL of the prompt's lengths."""
        ...

    async def get_lengths(self, prompt_keys: Sequence[str]) -> dict[str, list[int]]:
        """Return recorded lengths of every given prompt, newest first, in one round trip."""
        ...

    async def ping(self) -> bool:
        """Return whether the backend answers now; never raises."""
        ...

    async def close(self) -> None:
        """Release connections; later operations raise ``StoreUnavailable``. Idempotent."""
        ...
