"""ResilientStore: a DraftStore wrapper that never raises store failures to its callers.

Drafts are an optimisation: losing them makes decoding slower, never different. So on
``StoreError`` the wrapper returns empty results or drops the write (``put_draft`` then returns
False, so a caller never reports a draft the store does not hold), and a small circuit
breaker leaves the backend alone for ``retry_after_seconds`` before the next attempt, so a
dead Redis costs one timeout per window instead of one per call.

Caller bugs still raise ValueError: a bad prompt key or length always, an entry that cannot
be encoded whenever the backend is called.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from .base import DraftStore, StoreStats
from .settings import StoreSettings
from .types import (
    DraftEntry,
    StoreError,
    check_length,
    check_prompt_key,
    unique_prompt_keys,
)

__all__ = ["ResilientStore"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ResilientStore:
    """Wraps ``inner``; failures become empty results, counted by the inner store's stats."""

    def __init__(
        self,
        inner: DraftStore,
        settings: StoreSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._inner = inner
        self._retry_after = (settings or StoreSettings()).validate().retry_after_seconds
        self._clock = clock
        self._failed_at: float | None = None
        self._skipped_ops = 0

    @property
    def inner(self) -> DraftStore:
        """The wrapped store."""
        return self._inner

    @property
    def available(self) -> bool:
        """False from a failed operation until the next successful one."""
        return self._failed_at is None

    @property
    def skipped_ops(self) -> int:
        """Operations answered without calling the backend because the breaker was open."""
        return self._skipped_ops

    @property
    def stats(self) -> StoreStats:
        """The inner store's counters (its ``errors`` include the failures absorbed here)."""
        return self._inner.stats

    async def put_draft(self, prompt_key: str, entry: DraftEntry) -> bool:
        """False where the entry is not stored: the backend failed, the breaker is open, or
        the inner store dropped it (oversized). Never True for a write that did not happen."""
        check_prompt_key(prompt_key)
        return await self._guard(lambda: self._inner.put_draft(prompt_key, entry), False)

    async def remember(self, prompt_key: str, entry: DraftEntry) -> bool:
        """False where the draft is not stored (as ``put_draft``); a failure may have recorded
        the length or not (the backend's operations are not one transaction)."""
        check_prompt_key(prompt_key)
        return await self._guard(lambda: self._inner.remember(prompt_key, entry), False)

    async def get_drafts(self, prompt_keys: Sequence[str]) -> dict[str, list[DraftEntry]]:
        keys = unique_prompt_keys(prompt_keys)
        fallback: dict[str, list[DraftEntry]] = {key: [] for key in keys}
        return await self._guard(lambda: self._inner.get_drafts(keys), fallback)

    async def record_length(self, prompt_key: str, length: int) -> None:
        check_prompt_key(prompt_key)
        check_length(length)
        await self._guard(lambda: self._inner.record_length(prompt_key, length), None)

    async def get_lengths(self, prompt_keys: Sequence[str]) -> dict[str, list[int]]:
        keys = unique_prompt_keys(prompt_keys)
        fallback: dict[str, list[int]] = {key: [] for key in keys}
        return await self._guard(lambda: self._inner.get_lengths(keys), fallback)

    async def ping(self) -> bool:
        """Ask the backend now, even while the breaker is open; the answer updates it."""
        if await self._inner.ping():
            self._mark_success()
            return True
        self._mark_failure("ping failed")
        return False

    async def close(self) -> None:
        try:
            await self._inner.close()
        except StoreError as exc:
            logger.debug("draft store: error while closing: %s", exc)

    async def _guard(self, call: Callable[[], Awaitable[T]], fallback: T) -> T:
        """Run ``call`` unless the breaker is open; on StoreError return ``fallback``."""
        if not self._should_try():
            self._skipped_ops += 1
            return fallback
        try:
            result = await call()
        except StoreError as exc:
            self._mark_failure(str(exc))
            return fallback
        self._mark_success()
        return result

    def _should_try(self) -> bool:
        if self._failed_at is None:
            return True
        return self._clock() - self._failed_at >= self._retry_after

    def _mark_failure(self, reason: str) -> None:
        if self._failed_at is None:
            logger.warning(
                "draft store unavailable, serving without drafts for %.1fs at a time: %s",
                self._retry_after,
                reason,
            )
        self._failed_at = self._clock()

    def _mark_success(self) -> None:
        if self._failed_at is not None:
            logger.info("draft store available again")
        self._failed_at = None
