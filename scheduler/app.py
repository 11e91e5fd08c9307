"""What the HTTP routers need of the scheduler process, as a protocol (``Scheduler`` in
``server.py`` is the one implementation): the routers take it as an argument and never import
``server.py``, which imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from bubblespec.scheduler.service import SchedulerService
    from bubblespec.scheduler.settings import SchedulerSettings
    from bubblespec.scheduler.status_view import StatusView

__all__ = ["SchedulerApp"]


class SchedulerApp(Protocol):
    """The scheduler as its HTTP routes see it."""

    settings: SchedulerSettings
    """Its settings (tokens, limits, model name, ...)."""
    service: SchedulerService
    """The asyncio shell around the core."""
    status: StatusView
    """The ``/status`` document (shared with the Status RPC)."""

    @property
    def ready(self) -> bool:
        """Serving, not draining, with at least one worker."""
        ...
