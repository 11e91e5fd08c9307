"""The policy-update barrier's bookkeeping (pure): who loaded the version, who failed and why,
and the outcome once every live worker answered. ``SchedulerCore`` drives it."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from bubblespec.scheduler.core.types import ErrorCode, PolicyFailed, PolicyReady

__all__ = ["PolicyBarrier"]

MAX_REASON_CHARS = 300
"""A worker's reason is cut to this length in the ``UpdatePolicy`` error (each worker is named)."""


@dataclass
class PolicyBarrier:
    """A policy update in progress: what is loaded, and how each worker answered so far."""

    version: int
    weights_path: str
    loaded: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # worker id -> its reason

    def answer(self, worker_id: str, ok: bool, error: str) -> None:
        if ok:
            self.loaded.add(worker_id)
        else:
            self.failed[worker_id] = (error or "no reason given")[:MAX_REASON_CHARS]

    def outcome(self, live: Container[str], current: int) -> PolicyReady | PolicyFailed:
        """``PolicyReady`` if every worker still live loaded the version (and one did), else
        ``PolicyFailed`` naming each live worker that did not, with its reason; ``current``
        is the version the cluster stays at."""
        failed = {wid: why for wid, why in self.failed.items() if wid in live}
        loaded = [wid for wid in self.loaded if wid in live]
        if loaded and not failed:
            return PolicyReady(self.version, len(loaded))
        if not failed:
            return PolicyFailed(self.version, ErrorCode.UNAVAILABLE, "workers", f"no live worker is left to load version "
                                f"{self.version}; the cluster stays at version {current}")
        reasons = "; ".join(f"worker {wid}: {why}" for wid, why in sorted(failed.items()))
        return PolicyFailed(self.version, ErrorCode.FAILED_PRECONDITION, "weights_path",
                            f"version {self.version} did not load on {len(failed)} of {len(failed) + len(loaded)} "
                            f"live worker(s); the cluster stays at version {current}: {reasons}")
