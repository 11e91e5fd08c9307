"""How fast this machine runs plain Python now: a fixed reference workload, timed.

The control plane's absolute figures (completions/s through the scheduler, scheduler CPU per
completion) and ``simulate``'s wall time are set by the CPU as much as by the code. On the
shared 2-core development machine the same commit gave 9,828 completions/s one day and 2,713
the next, and ``simulate`` at 4,096 workers took 2.5-2.9x longer (docs/LOAD.md,
docs/SIMULATOR.md): ratios measured in one run survive that, absolute targets do not. So
``loadtest``, ``simulate`` and ``bench`` print and record ``reference_ms``: the CPU time of
one fixed workload of the operations those paths are made of (dict and heap updates, small
tuples, float arithmetic, method calls), the median of a few repeats, measured as the command
starts. A figure from another day compares with one from today only beside it: half the
reference_ms, about twice the completions/s.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time

__all__ = ["reference_ms"]


class _Item:
    __slots__ = ("key", "tokens")

    def __init__(self, key: int, tokens: float):
        self.key, self.tokens = key, tokens

    def grow(self, by: float) -> float:
        self.tokens += by
        return self.tokens


def _workload(n: int = 40_000) -> float:
    """A fixed, deterministic mix; returns a checksum so that nothing is optimised away."""
    counts: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    items = [_Item(i, 0.0) for i in range(256)]
    total = 0.0
    for i in range(n):
        k = i * 2654435761 % 1_000_003
        counts[k & 4095] = counts.get(k & 4095, 0) + 1
        heapq.heappush(heap, (k, i))
        if len(heap) > 256:
            heapq.heappop(heap)
        total += items[i & 255].grow(math.sqrt(k) * 1e-3)
    return total + len(counts) + heap[0][0]


def reference_ms(repeats: int = 5) -> float:
    """Milliseconds of CPU time (this thread) one run of the reference workload takes now:
    the median of ``repeats`` runs."""
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats!r}")
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        _workload()
        times.append((time.thread_time() - started) * 1e3)
    return statistics.median(times)
