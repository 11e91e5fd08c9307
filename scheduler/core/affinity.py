"""Session affinity (pure): a conversation's next turn goes to the worker that holds its prefix
in its KV cache, while that worker has room.

Multi-turn rollouts (agents, tool use, prime-rl's and SkyRL's environments) send each turn as
a new call whose prompt extends the previous turn's prompt and response. vLLM's prefix cache
keeps the KV of recent prompts on the worker that computed them, so a turn placed there
computes only its new tokens; placed elsewhere, it computes the whole conversation again.

A conversation is told in one of two ways:

- an explicit session id (the HTTP header ``X-Session-ID``, which prime-rl's client and vLLM's
  routers send per rollout): the worker that ran the session's latest turn;
- else its tokens: the worker that finished the longest earlier request whose prompt, or whose
  prompt and response, this prompt starts with, compared in blocks of ``BLOCK`` tokens (a chain
  of hashes, as vLLM's prefix cache keys its blocks).

Affinity is a preference, never a pin: the pool places a request on its preferred worker when
that worker is up, on the request's policy version and has a free slot
(``RequestPool.place_with_siblings``), and lets that worker take it out of the queue's first
``WINDOW`` requests when a slot frees (``RequestPool.take_preferred``); otherwise any worker
runs it, as without affinity. A worker that died or left is simply never free. Placement only:
which worker computes a request never changes its tokens.

Memory: at most ``max_entries`` sessions and as many prefixes, oldest forgotten first, plus one
entry per request waiting to be placed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["BLOCK", "Affinity", "prefix_hashes"]

K = TypeVar("K", str, int)

BLOCK = 64
"""Tokens per block of the prefix chain. Coarser than vLLM's KV blocks (16 on most backends):
a turn's prompt shares all but its last few blocks with the previous turn, so the match is as
good, at a quarter of the hashing."""


def prefix_hashes(tokens: Sequence[int], block: int = BLOCK) -> list[int]:
    """The chain hash of each full block of ``tokens``: entry i covers ``tokens[:(i+1) * block]``."""
    hashes: list[int] = []
    h = 0
    for start in range(0, len(tokens) - block + 1, block):
        h = hash((h, tuple(tokens[start:start + block])))
        hashes.append(h)
    return hashes


class Affinity:
    """Which worker each session and each recent prefix last ran on, and which worker each
    queued request prefers."""

    def __init__(self, max_entries: int = 65_536, block: int = BLOCK):
        self.max_entries = max_entries
        self.block = block
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> worker of its latest turn
        self._prefixes: OrderedDict[int, str] = OrderedDict()  # chain hash -> worker that finished it
        self.wanted: dict[str, str] = {}
        """Queued request key -> the worker it prefers (set at submit, gone once placed or dropped)."""
        self.wanted_by: dict[str, deque[str]] = {}
        """Worker -> the keys that preferred it, oldest first (stale ones are skipped as met)."""
        self.session_of: dict[str, str] = {}
        """Request key -> its session id, for requests that named one."""
        self.placements = {"home": 0, "away": 0}
        """Requests with a preferred worker started there (home) or on another (away)."""

    # ---------------------------------------------------------------- requests --

    def submitted(self, keys: Sequence[str], prompt: Sequence[int], session_id: str = "") -> str | None:
        """``keys`` (one prompt's requests) joined the queue: the worker they prefer, if any."""
        if session_id:
            for key in keys:
                self.session_of[key] = session_id
        worker = self._sessions.get(session_id) if session_id else None
        if worker is None and self._prefixes:
            for h in reversed(prefix_hashes(prompt, self.block)):
                worker = self._prefixes.get(h)
                if worker is not None:
                    break
        if worker is not None:
            queue = self.wanted_by.setdefault(worker, deque())
            for key in keys:
                self.wanted[key] = worker
                queue.append(key)
        return worker

    def oldest_for(self, worker_id: str) -> str | None:
        """The oldest request still preferring ``worker_id`` (None: none)."""
        queue = self.wanted_by.get(worker_id)
        while queue:
            if self.wanted.get(queue[0]) == worker_id:
                return queue[0]
            queue.popleft()
        return None

    def worker_gone(self, worker_id: str) -> None:
        """``worker_id`` left: nothing prefers it any more (its KV cache went with it)."""
        for key in self.wanted_by.pop(worker_id, ()):
            if self.wanted.get(key) == worker_id:
                del self.wanted[key]
        for session in [k for k, w in self._sessions.items() if w == worker_id]:
            del self._sessions[session]
        for prefix in [k for k, w in self._prefixes.items() if w == worker_id]:
            del self._prefixes[prefix]

    def placed(self, key: str, worker_id: str) -> None:
        """``key`` started on ``worker_id``: it prefers nothing any more."""
        wanted = self.wanted.pop(key, None)
        if wanted is not None:
            self.placements["home" if wanted == worker_id else "away"] += 1

    def unwant(self, key: str) -> None:
        """``key`` keeps its session but prefers no worker (one that cannot take it)."""
        self.wanted.pop(key, None)

    def finished(self, key: str, prompt: Sequence[int], response: Sequence[int], worker_id: str) -> None:
        """``key`` finished on ``worker_id``: its session and its prefixes (the prompt, and the
        prompt with the response) now live there."""
        self.wanted.pop(key, None)
        session_id = self.session_of.pop(key, None)
        if not worker_id:
            return
        if session_id:
            _put(self._sessions, session_id, worker_id, self.max_entries)
        hashes = prefix_hashes((*prompt, *response), self.block)
        whole = len(prompt) // self.block
        for i in {whole - 1, len(hashes) - 1}:
            if i >= 0:
                _put(self._prefixes, hashes[i], worker_id, self.max_entries)

    def dropped(self, key: str) -> None:
        """``key`` left the pool without finishing (aborted, failed, its caller went away)."""
        self.wanted.pop(key, None)
        self.session_of.pop(key, None)

    def sizes(self) -> tuple[int, int, int]:
        """(sessions, prefixes, requests with a preference): what the affinity holds."""
        return len(self._sessions), len(self._prefixes), len(self.wanted)


def _put(table: OrderedDict[K, str], key: K, value: str, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
