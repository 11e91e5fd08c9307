"""The status document behind ``/status`` and the ``Status`` RPC, built without stalling the
event loop that also carries every gRPC call, heartbeat and completion.

``StatusEncoder`` (core) reuses the JSON of timeline segments it encoded before, so a build
encodes only what is new, and hands back the same document for ``max_age_seconds``. What is new
can still be a lot: the first call at thousands of workers, or the first after a long pause in
polling, meets up to ``CoreSettings.timeline_segments`` unencoded segments per worker (about
0.5 s of CPU at 1,024 workers). So the loop only reads the core (``prepare``: the workers'
fields and the new segments, which never change once closed); the encoding and the assembly of
the document (megabytes at that scale) run in a thread (``finish``). One build at a time:
callers that arrive meanwhile get the document it builds.
"""

from __future__ import annotations

import asyncio

from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.status import StatusDocument, StatusEncoder

__all__ = ["StatusView"]


class StatusView:
    """The ``/status`` document and Status RPC, built from ``core.status()`` at most once per
    ``max_age_seconds`` whatever the number of pollers."""

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
            pending = self.encoder.prepare(self.core)  # on the loop: reads the core, copies little
            return await asyncio.to_thread(self.encoder.finish, pending)
