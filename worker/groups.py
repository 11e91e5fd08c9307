"""Finished samples of a prompt, kept as sibling drafts for its later samples (pure: numpy).

A group is one prompt under one adapter version and one set of weights (``BubbleSpecProposer``
keys it so). While any of its samples runs, the group's texts live in its ``GroupIndex``
(``worker/group_index.py``), finished responses included. A sample that starts after the last
one left (more samples than the engine has slots, the scheduler's probes running one sample
of each prompt first, a client that sends a prompt's calls one after the other) would find
nothing there. ``FinishedSamples`` keeps each finished sample's response, and the proposer
gives them to the group's index when its next sample starts, as ``sibling`` texts. Drafts
never change a result: vLLM verifies them (docs/EXACTNESS.md).

Memory is bounded: at most ``per_group`` responses a group (the newest), and ``max_tokens``
tokens in all, the groups used least recently dropped first. A response longer than the whole
bound is not kept.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

__all__ = ["FinishedSamples"]


class FinishedSamples:
    """Finished responses by group, least recently used dropped first."""

    def __init__(self, max_tokens: int = 1 << 22, per_group: int = 16):
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens!r}")
        if per_group < 1:
            raise ValueError(f"per_group: must be >= 1, got {per_group!r}")
        self.max_tokens, self.per_group = max_tokens, per_group
        self._groups: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self.tokens = 0
        """Tokens held in all."""

    def add(self, group: int, response: np.ndarray) -> bool:
        """Keep ``response`` (a finished sample's token ids) for ``group``; whether it was kept."""
        if len(response) == 0 or len(response) > self.max_tokens:
            return False
        kept = self._groups.setdefault(group, [])
        self._groups.move_to_end(group)
        kept.append(np.asarray(response, dtype=np.int32))
        self.tokens += len(response)
        if len(kept) > self.per_group:
            self.tokens -= len(kept.pop(0))
        while self.tokens > self.max_tokens:
            _, dropped = self._groups.popitem(last=False)
            self.tokens -= sum(map(len, dropped))
        return True

    def of(self, group: int) -> list[np.ndarray]:
        """The group's kept responses, oldest first (a use: the group is dropped last)."""
        kept = self._groups.get(group)
        if kept is None:
            return []
        self._groups.move_to_end(group)
        return list(kept)

    def __len__(self) -> int:
        return len(self._groups)
