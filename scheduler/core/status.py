"""JSON-able snapshot of the core for ``/status``, the ``Status`` RPC and the UI.

``snapshot(core)`` builds the whole document as Python objects. ``StatusEncoder`` gives the
same document as JSON bytes for the service, cheaply enough to run on its event loop at
thousands of workers: the bulk of the document is the workers' timelines (up to
``CoreSettings.timeline_segments`` segments each), and a segment never changes once closed
(the timeline appends new ones and drops its oldest), so each segment is encoded once and
its text reused; a built document is reused for ``max_age_seconds`` of the core's clock.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, cast

from bubblespec.scheduler.core.types import WorkerStatus

if TYPE_CHECKING:
    from bubblespec.scheduler.core.records import CoreParts, StepState, WorkerState

__all__ = ["PendingDocument", "StatusDocument", "StatusEncoder", "snapshot"]


def _worker(w: WorkerState, now: float) -> dict:
    return _worker_fields(w) | {"timeline": [[s, a, b] for s, a, b in w.timeline.segments] + [[w.state, w.state_since, now]]}


def _worker_fields(w: WorkerState) -> dict:
    return {
        "worker_id": w.hello.worker_id,
        "state": w.state,
        "policy_version": w.version,
        "loading": w.loading,
        "load_failed": w.load_failed,
        "running": len(w.running),
        "queued": len(w.private),
        "drafting": len(w.drafts),
        "capacity": w.capacity,
        "speculation": w.hello.speculation,
        "tokens_per_second": round(w.tokens_per_second, 2),
        "seconds": {"busy": w.timeline.busy, "idle": w.timeline.idle, "drafting": w.timeline.drafting},
    }


def _step(s: StepState, now: float) -> dict:
    out = {
        "step_id": s.spec.step_id,
        "policy_version": s.spec.policy_version,
        "policy": s.spec.policy.value,
        "requests": len(s.requests),
        "completed": len(s.completions),
        "queued": len(s.shared),
        "started_at": s.started_at,
        "finished_at": s.finished_at,
        "elapsed_seconds": (s.finished_at or now) - s.started_at,
        "cancelled": s.cancelled,
    }
    if s.summary is not None:
        summary = asdict(s.summary)
        summary["forward_passes_per_token"] = s.summary.forward_passes_per_token
        summary["bubble_share"] = s.summary.bubble_share
        out["summary"] = summary
    return out


def snapshot(core: CoreParts) -> dict:
    now = core.clock()
    return _document(core, now, [_worker(w, now) for w in core.workers.values()])


def _document(core: CoreParts, now: float, workers: list) -> dict:
    covered, announced = core.planner.coverage()
    return {
        "now": now,
        "policy_version": core.version,
        "workers": workers,
        "steps": [_step(s, now) for s in core.steps.values()],
        "requests_waiting": sum(len(s.shared) for s in core.steps.values() if s.active)
        + sum(len(w.private) for w in core.workers.values()),
        "requests_running": sum(len(w.running) for w in core.workers.values()),
        "drafts": {"prompts_covered": covered, "prompts_announced": announced},
        "paused": core.pauser.mode or None,  # /pause's mode while paused (core/pause.py)
    }


@dataclass(frozen=True)
class StatusDocument:
    """One status document: ``view`` is ``snapshot`` without the workers' timelines (what the
    Status RPC's typed fields need), ``body`` the whole document as JSON."""

    view: dict
    body: bytes
    built_at: float


class _Segments:
    """The JSON text of one worker's closed timeline segments (without brackets), kept in step
    with the list: new segments are encoded and appended, dropped ones cut off the front.
    One string per worker, so the cache adds few objects for the garbage collector to walk.
    ``plan`` reads the live list (cheap: it looks for the newest segment encoded, usually the
    last or nearly); ``apply`` does the encoding and may run in another thread."""

    def __init__(self, segments: list) -> None:
        self.source = segments
        self.joined = ""
        self.lengths: deque[int] = deque()  # text length of each encoded segment, oldest first
        self.last: tuple | None = None  # the newest segment encoded

    def plan(self) -> tuple[bool, int, list]:
        """(start over, how many of the oldest encoded segments to cut, the new segments)."""
        segs = self.source
        i = len(segs) - 1
        while i >= 0 and segs[i] is not self.last:
            i -= 1
        if i < 0:  # first build, or every encoded segment was dropped: encode them all
            return True, 0, list(segs)
        return False, len(self.lengths) - (i + 1), segs[i + 1:]

    def apply(self, plan: tuple[bool, int, list]) -> str:
        reset, drop, new = plan
        if reset:
            self.joined, self.lengths, self.last = "", deque(), None
        elif drop > 0:
            cut = sum(self.lengths.popleft() for _ in range(drop)) + drop  # each with its "," separator
            self.joined = self.joined[cut:]
        texts = [_segment_text(seg) for seg in new]
        if texts:
            self.lengths.extend(len(t) for t in texts)
            self.joined += ("," if self.joined else "") + ",".join(texts)
            self.last = new[-1]
        return self.joined


def _segment_text(seg: tuple) -> str:
    """``json.dumps(list(seg), separators=_COMPACT)``, about ten times faster."""
    state, start, end = seg
    return f"[{_STATES.get(state) or _dumps(state)},{_number(start)},{_number(end)}]"


def _number(x: object) -> str:
    return repr(x) if type(x) in (int, float) and math.isfinite(cast(float, x)) else _dumps(x)


def _dumps(x: object) -> str:
    return json.dumps(x, separators=_COMPACT)


_COMPACT = (",", ":")
_STATES = {s: _dumps(s.value) for s in WorkerStatus}


@dataclass(frozen=True)
class PendingDocument:
    """What ``StatusEncoder.prepare`` read from the core; ``finish`` turns it into JSON."""

    now: float
    view: dict
    workers: list  # (segment cache, its plan, the worker's fields, its current segment)


class StatusEncoder:
    """``snapshot(core)`` as JSON bytes, rebuilt at most every ``max_age_seconds`` (core
    clock), each closed timeline segment encoded once (see the module docstring).

    ``prepare`` reads the core (it must run where the core is driven: the event loop) and is
    cheap; ``finish`` encodes, from what ``prepare`` copied, and may run in another thread, one
    build at a time. ``encode`` does both."""

    def __init__(self, max_age_seconds: float = 0.5) -> None:
        self.max_age_seconds = max_age_seconds
        self._segments: dict[str, _Segments] = {}
        self._last: StatusDocument | None = None

    def fresh(self, core: CoreParts) -> StatusDocument | None:
        """The document built less than ``max_age_seconds`` ago, if any."""
        last = self._last
        return last if last is not None and 0 <= core.clock() - last.built_at < self.max_age_seconds else None

    def encode(self, core: CoreParts, reuse: bool = True) -> StatusDocument:
        """The document; ``reuse=False``: built now, even if one is less than max_age old."""
        if reuse and (fresh := self.fresh(core)) is not None:
            return fresh
        return self.finish(self.prepare(core))

    def prepare(self, core: CoreParts) -> PendingDocument:
        now = core.clock()
        caches = {wid: self._cache(wid, w) for wid, w in core.workers.items()}
        self._segments = caches  # workers that left are forgotten
        workers = [(caches[wid], caches[wid].plan(), _worker_fields(w), (w.state, w.state_since, now))
                   for wid, w in core.workers.items()]
        return PendingDocument(now, _document(core, now, [f for _, _, f, _ in workers]), workers)

    def finish(self, pending: PendingDocument) -> StatusDocument:
        texts = []
        for cache, plan, fields, current in pending.workers:
            closed = cache.apply(plan)
            texts.append(f'{_dumps(fields)[:-1]},"timeline":[{closed}{"," if closed else ""}{_segment_text(current)}]}}')
        head = _dumps(pending.view | {"workers": None}).split('"workers":null', 1)  # "now", "policy_version" come first
        body = f'{head[0]}"workers":[{",".join(texts)}]{head[1]}'.encode()
        self._last = StatusDocument(pending.view, body, pending.now)
        return self._last

    def _cache(self, wid: str, w: WorkerState) -> _Segments:
        cache = self._segments.get(wid)
        return cache if cache is not None and cache.source is w.timeline.segments else _Segments(w.timeline.segments)
