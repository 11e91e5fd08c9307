"""Per-request draft matching and adaptive draft length (pure: numpy only, no vLLM).

A request carries candidate continuations (``Candidate``) from three sources: ``future``
(responses pre-generated in bubbles for this prompt), ``history`` (earlier steps' responses)
and ``sibling`` (the other samples of the same prompt, read live from the batch).

``RequestDrafter.propose`` returns the next draft tokens for one request:

1. **Aligned**: a candidate whose prefix equals everything generated so far proposes its
   next tokens.
2. **Resync**: otherwise the longest suffix (up to ``match_len`` tokens) of what was
   generated that occurs in a candidate is found; the occurrence nearest to the current
   position proposes what follows it.
3. A cursor ``(candidate, position)`` remembers the match; as long as newly generated tokens
   keep agreeing with the candidate it advances without searching again.

Drafts never change a result: vLLM verifies them against the target model.

Adaptive length (``DraftLength``): each request keeps an exponential moving average ``a`` of
its per-token acceptance.  The j-th draft token is accepted with probability about ``a**j``,
so we draft while ``a**j >= min_accept_prob``; the batch caps it at
``token_budget // batch_size`` so that verification never makes a step compute-bound; a
request whose acceptance collapsed drafts one probe token every ``probe_every`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Candidate", "DraftLength", "RequestDrafter", "SOURCES"]

SOURCES = ("future", "history", "sibling")


@dataclass
class Candidate:
    """One candidate continuation of a prompt. ``tokens`` may grow (siblings)."""

    source: str
    tokens: np.ndarray  # int64, 1-D


@dataclass(frozen=True)
class DraftLength:
    """The rule that picks how many tokens to draft for a request in a batch."""

    max_tokens: int = 8
    """Upper bound: vLLM's ``num_speculative_tokens``."""
    token_budget: int = 256
    """Draft tokens one engine step may verify in total (over the batch)."""
    min_accept_prob: float = 0.3
    """Keep drafting while the chance that the next draft token is accepted stays above this."""
    prior: float = 0.7
    """Assumed acceptance before a request has any history."""
    ema: float = 0.3
    """Weight of the newest observation in the acceptance average."""
    probe_every: int = 8
    """A request with collapsed acceptance drafts one token every this many steps."""

    def batch_cap(self, batch_size: int) -> int:
        return max(0, min(self.max_tokens, self.token_budget // max(1, batch_size)))

    def for_request(self, accept: float, steps: int, cap: int) -> int:
        if cap <= 0:
            return 0
        if accept < self.min_accept_prob:
            return 1 if steps % self.probe_every == 0 else 0
        if accept >= 0.999:
            return cap
        k = int(math.log(self.min_accept_prob) / math.log(accept))
        return max(1, min(cap, k))


@dataclass
class RequestStats:
    forward_passes: int = 0
    drafted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))


class RequestDrafter:
    """Draft state of one running request."""

    def __init__(
        self,
        candidates: list[Candidate],
        rule: DraftLength,
        *,
        key: str = "",
        prompt_hash: int = 0,
        prompt_len: int = 0,
        match_len: int = 3,
    ):
        self.key = key
        self.prompt_hash = prompt_hash
        self.prompt_len = prompt_len
        self.candidates = candidates
        self._static = len(candidates)
        self.rule = rule
        self.match_len = match_len
        self.accept = rule.prior
        self.stats = RequestStats()
        self._cursor: tuple[int, int] | None = None  # (candidate index, position)
        self._seen = 0  # generated tokens already folded into the cursor
        self._last: tuple[str, int] | None = None  # (source, drafted) of the last proposal

    def observe(self, num_sampled: int) -> None:
        """Account for the engine step that just sampled ``num_sampled`` tokens."""
        self.stats.forward_passes += 1
        if self._last is None:
            return
        source, drafted = self._last
        accepted = max(0, min(drafted, num_sampled - 1))
        self.stats.drafted[source] += drafted
        self.stats.accepted[source] += accepted
        self.accept = (1 - self.rule.ema) * self.accept + self.rule.ema * (accepted / drafted)
        self._last = None

    def set_siblings(self, siblings: list[Candidate]) -> None:
        """Replace the live sibling candidates (the static ones come first and stay)."""
        self.candidates = self.candidates[: self._static] + siblings
        if self._cursor is not None and self._cursor[0] >= self._static:
            self._cursor = None  # sibling contents moved on; search again

    def propose(self, generated: np.ndarray, cap: int) -> list[int]:
        """Draft tokens to follow ``generated`` (this request's output so far)."""
        k = self.rule.for_request(self.accept, self.stats.forward_passes, cap)
        if k <= 0 or not self.candidates:
            return []
        pos = self._advance(generated)
        if pos is None:
            return []
        idx, at = pos
        cand = self.candidates[idx]
        draft = cand.tokens[at : at + k]
        if len(draft) == 0:
            return []
        self._last = (cand.source, len(draft))
        return draft.tolist()

    def _advance(self, generated: np.ndarray) -> tuple[int, int] | None:
        g = len(generated)
        if self._cursor is not None:
            idx, at = self._cursor
            new = generated[self._seen :]
            tokens = self.candidates[idx].tokens
            if np.array_equal(tokens[at : at + len(new)], new) and at + len(new) <= len(tokens):
                self._cursor = (idx, at + len(new))
                self._seen = g
                return self._cursor
        self._cursor = self._search(generated)
        self._seen = g
        return self._cursor

    def _search(self, generated: np.ndarray) -> tuple[int, int] | None:
        g = len(generated)
        for idx, cand in enumerate(self.candidates):  # a candidate that agrees with everything so far
            if len(cand.tokens) > g and np.array_equal(cand.tokens[:g], generated):
                return idx, g
        for m in range(min(self.match_len, g), 0, -1):  # longest generated suffix that matches
            best = self._nearest(generated[g - m:], g)
            if best is not None:
                return best
        return None

    def _nearest(self, tail: np.ndarray, g: int) -> tuple[int, int] | None:
        """(candidate, position after ``tail``) of the occurrence nearest position ``g``."""
        m = len(tail)
        best: tuple[int, int, int] | None = None  # (distance, idx, position after match)
        for idx, cand in enumerate(self.candidates):
            tokens = cand.tokens
            if len(tokens) <= m:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], m)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if len(hits) == 0:
                continue
            after = hits + m
            j = int(np.argmin(np.abs(after - g)))
            dist = int(abs(after[j] - g))
            if best is None or dist < best[0]:
                best = (dist, idx, int(after[j]))
        return None if best is None else (best[1], best[2])
