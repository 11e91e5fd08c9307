"""The status document behind ``/status`` and the ``Status`` RPC, built without stalling the
event loop that also carries every gRPC call, heartbeat and completion.

``StatusEncoder`` (core) reuses the JSON of timeline segments it encoded before, so a build
encodes only what is new, and hands back the same document for ``max_age_seconds``. What is new
can still be a lot: the first call at thousands of workers, or the first after a long pause in
polling, meets up to ``CoreSettings.timeline_segments`` unencoded segments per worker (about
0.5 s of CPU at 1,024 workers). That part runs in a thread, on copies of the segment lists (the
segments themselves never change); the loop only assembles the document. One build at a time:
callers that arrive meanwhile get the document it builds.
"""

from __future__ import annotations

import asyncio

from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.status import StatusDocument, StatusEncoder

__all__ = ["StatusView"]


class StatusView:
    def __init__(self, core: SchedulerCore, max_age_seconds: float = 0.5) -> None:
        self.core = core
        self.encoder = StatusEncoder(max_age_seconds)
        self._lock = asyncio.Lock()

    async def document(self, current: bool = False) -> StatusDocument:
        """The latest document, or (``current``) one built now: the Status RPC wants the
        state as it is (a trainer reads the policy version it just set); /status pollers
        share one build per ``max_age_seconds``."""
        async with self._lock:
            if not current and (fresh := self.encoder.fresh(self.core)) is not None:
                return fresh
            stale = self.encoder.stale(self.core)
            if stale:
                await asyncio.to_thread(self.encoder.catch_up, stale)
            return self.encoder.encode(self.core, reuse=False)
