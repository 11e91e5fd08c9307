"""``Pending``: items queued by synchronous code for one asyncio reader that takes them all at once."""

from __future__ import annotations

import asyncio

__all__ = ["Pending"]


class Pending:
    """Queued items, in order: a list and an event. Cheaper per item than an ``asyncio.Queue``,
    whose item-by-item bookkeeping a reader that takes everything at once never uses (the step
    journal's writer; a step subscriber's stream)."""

    def __init__(self) -> None:
        self._items: list = []
        self._ready = asyncio.Event()

    def put_nowait(self, item: object) -> None:
        self._items.append(item)
        self._ready.set()

    async def wait(self) -> None:
        """Return once at least one item is queued."""
        await self._ready.wait()

    def take(self) -> list:
        """Every item queued so far, in order; the queue is empty after."""
        items, self._items = self._items, []
        self._ready.clear()
        return items
