"""Makespan attribution: what the last requests of a simulated step were doing.

A step ends with its last request, so its makespan is set by a handful of requests at the tail.
For each of the last requests to finish, :class:`TailRequest` records when it started and
finished, how long it was, whether it had a draft and how much of its length the draft
covered, the acceptance and draft length it ran with, and the batch it ran in. ``bubblespec
simulate --tail N`` prints them; :func:`format_tail` is that printout.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["TailLog", "TailRequest", "format_tail"]


@dataclass(frozen=True)
class TailRequest:
    """One of the last requests of a step, and what its decoding looked like."""

    key: str
    worker: str
    length: int
    """Tokens generated."""
    started_seconds: float
    """Assignment time, from the step's start (a request moved or re-queued: its last start)."""
    finished_seconds: float
    """Completion time, from the step's start."""
    source: str
    """Draft source it had at assignment (``future``, ``history``) or '' for none."""
    draft_tokens: int
    """Length of that draft."""
    alpha: float
    """Its per-token acceptance."""
    max_k: int
    """Most draft tokens per pass it ran with."""
    forward_passes: int
    drafted_passes: float
    """Forward passes during which it had a draft."""
    accepted: float
    """Draft tokens accepted."""
    batch_at_start: int
    batch_at_finish: int
    """Batch size of its worker when it joined, and just before it finished (itself included)."""

    @property
    def coverage(self) -> float:
        """Share of its tokens the draft could cover."""
        return min(self.draft_tokens, self.length) / self.length if self.length else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.length / max(1, self.forward_passes)

    @property
    def undrafted_passes(self) -> float:
        """Passes it decoded one token at a time (no draft, or past the draft's end)."""
        return max(0.0, self.forward_passes - self.drafted_passes)


class TailLog:
    """Keeps the last ``size`` completions of a step (completions arrive in time order)."""

    def __init__(self, size: int):
        self.size = size
        self._last: deque[TailRequest] = deque(maxlen=max(1, size))

    def add(self, req: TailRequest) -> None:
        if self.size > 0:
            self._last.append(req)

    def requests(self) -> tuple[TailRequest, ...]:
        """The last requests, the very last one first."""
        return tuple(reversed(self._last)) if self.size > 0 else ()


HEADER = ("request", "length", "start_s", "end_s", "draft", "cover", "alpha", "k", "tok/pass",
          "undrafted_passes", "batch start>end")


def format_tail(title: str, tail: Iterable[TailRequest]) -> str:
    """A small table of one step's tail requests, under ``title``."""
    rows = [HEADER]
    for t in tail:
        draft = f"{t.source}:{t.draft_tokens}" if t.source else "-"
        rows.append((t.key, str(t.length), f"{t.started_seconds:.1f}", f"{t.finished_seconds:.1f}", draft,
                     f"{t.coverage:.0%}", f"{t.alpha:.2f}", str(t.max_k), f"{t.tokens_per_pass:.2f}",
                     f"{t.undrafted_passes:.0f}", f"{t.batch_at_start}>{t.batch_at_finish}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = [title] + ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
