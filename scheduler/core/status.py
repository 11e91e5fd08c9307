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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bubblespec.scheduler.core.state import SchedulerCore, StepState, WorkerState

__all__ = ["StatusDocument", "StatusEncoder", "snapshot"]


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


def snapshot(core: SchedulerCore) -> dict:
    now = core.clock()
    return _document(core, now, [_worker(w, now) for w in core.workers.values()])


def _document(core: SchedulerCore, now: float, workers: list) -> dict:
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
    One string per worker, so the cache adds few objects for the garbage collector to walk."""

    def __init__(self, segments: list) -> None:
        self.source = segments
        self.joined = ""
        self.lengths: deque[int] = deque()  # text length of each encoded segment, oldest first
        self.last: tuple | None = None  # the newest segment encoded

    def stale(self) -> bool:
        return bool(self.source) and self.source[-1] is not self.last

    def text(self, segs: list | None = None) -> str:
        """Bring the text up to ``segs`` (default: the live list; a copy of it may be passed
        from another thread while nothing else touches this cache) and return it."""
        segs = self.source if segs is None else segs
        i = len(segs) - 1
        while i >= 0 and segs[i] is not self.last:  # usually found at once: few segments are new
            i -= 1
        if i < 0:  # first build, or every encoded segment was dropped: encode them all
            self.joined, self.lengths = "", deque()
        else:
            self._drop(len(self.lengths) - (i + 1))
        new = [_segment_text(seg) for seg in segs[i + 1:]]
        if new:
            self.lengths.extend(len(t) for t in new)
            self.joined += ("," if self.joined else "") + ",".join(new)
            self.last = segs[-1]
        elif not segs:
            self.last = None
        return self.joined

    def _drop(self, k: int) -> None:
        """Cut the ``k`` oldest encoded segments (the timeline dropped them)."""
        if k <= 0:
            return
        cut = sum(self.lengths.popleft() for _ in range(k)) + k  # each with its "," separator
        self.joined = self.joined[cut:]


def _segment_text(seg: tuple) -> str:
    """``json.dumps(list(seg), separators=_COMPACT)``, about ten times faster."""
    state, start, end = seg
    return f"[{_STATES.get(state) or _dumps(state)},{_number(start)},{_number(end)}]"


def _number(x) -> str:
    return repr(x) if type(x) in (int, float) and math.isfinite(x) else _dumps(x)


def _dumps(x) -> str:
    return json.dumps(x, separators=_COMPACT)


_COMPACT = (",", ":")
_STATES = {s: _dumps(s) for s in ("busy", "idle", "drafting", "loading")}


class StatusEncoder:
    """``snapshot(core)`` as JSON bytes, rebuilt at most every ``max_age_seconds`` (core
    clock), each closed timeline segment encoded once (see the module docstring)."""

    def __init__(self, max_age_seconds: float = 0.5) -> None:
        self.max_age_seconds = max_age_seconds
        self._segments: dict[str, _Segments] = {}
        self._last: StatusDocument | None = None

    def fresh(self, core: SchedulerCore) -> StatusDocument | None:
        """The document built less than ``max_age_seconds`` ago, if any."""
        last = self._last
        return last if last is not None and 0 <= core.clock() - last.built_at < self.max_age_seconds else None

    def stale(self, core: SchedulerCore) -> list[tuple[_Segments, list]]:
        """Segment caches behind their timelines, each with a copy of the timeline's list (the
        segments themselves never change): ``catch_up`` may encode them off the event loop."""
        self._segments = {wid: self._cache(wid, w) for wid, w in core.workers.items()}  # leavers forgotten
        return [(c, list(c.source)) for c in self._segments.values() if c.stale()]

    @staticmethod
    def catch_up(stale: list[tuple[_Segments, list]]) -> int:
        """Encode the segments ``stale`` found (any thread, while nothing else uses this
        encoder); the next ``encode`` then only adds what came since. Returns the segments seen."""
        for cache, segs in stale:
            cache.text(segs)
        return sum(len(segs) for _, segs in stale)

    def _cache(self, wid: str, w: WorkerState) -> _Segments:
        cache = self._segments.get(wid)
        return cache if cache is not None and cache.source is w.timeline.segments else _Segments(w.timeline.segments)

    def encode(self, core: SchedulerCore, reuse: bool = True) -> StatusDocument:
        """The document; ``reuse=False``: built now, even if one is less than max_age old."""
        if reuse and (fresh := self.fresh(core)) is not None:
            return fresh
        now = core.clock()
        fields, texts = [], []
        segments: dict[str, _Segments] = {}
        for wid, w in core.workers.items():
            segments[wid] = cache = self._cache(wid, w)
            f = _worker_fields(w)
            fields.append(f)
            closed = cache.text()
            current = _segment_text((w.state, w.state_since, now))
            texts.append(f'{_dumps(f)[:-1]},"timeline":[{closed}{"," if closed else ""}{current}]}}')
        self._segments = segments  # workers that left are forgotten
        view = _document(core, now, fields)
        head = _dumps(view | {"workers": None}).split('"workers":null', 1)  # "now", "policy_version" come first
        body = f'{head[0]}"workers":[{",".join(texts)}]{head[1]}'.encode()
        self._last = StatusDocument(view, body, now)
        return self._last
