"""Positions by n-gram, newest first, in numpy arrays (pure: numpy).

``PositionTable`` is a hash table of chains: entry ``e`` holds a 64-bit key, a value and the
entry added before it to the same bucket; ``head[bucket]`` is the newest entry. A lookup walks
one chain from the newest entry and keeps the values whose key matches. An entry costs 24
bytes plus its share of the buckets (8 bytes each, at most one per entry), against ~200 bytes a
token for dicts of Python lists. Entries are added in batches (``add``), linked by one sort; the
buckets double, relinked the same way, when the entries outnumber them twice.

``ngram_keys`` gives each n-gram of a token array a 64-bit key (1-grams: the token itself). Two
n-grams may share a key: a caller compares the tokens it finds.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAX_N", "PositionTable", "ngram_key", "ngram_keys"]

_MULTIPLIERS = (np.random.default_rng(0x6E6772616D).integers(1, 1 << 62, 32, dtype=np.int64).astype(np.uint64)
                * np.uint64(2) + np.uint64(1))  # odd: each multiplication is a bijection of the 64-bit integers
MAX_N = len(_MULTIPLIERS)
"""Longest n-gram ``ngram_keys`` keys."""
_INT_MULTIPLIERS = [int(k) for k in _MULTIPLIERS]
_MASK = (1 << 64) - 1


def ngram_key(tokens: list[int]) -> int:
    """``ngram_keys(tokens, len(tokens))[0]`` in Python integers (one key costs ~1 us, not ~10)."""
    key = 0
    for t, k in zip(tokens, _INT_MULTIPLIERS):
        key ^= (t * k) & _MASK
    return key if len(tokens) > 1 else tokens[0]


def ngram_keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """The key of each ``n``-gram of ``tokens`` (``len(tokens) - n + 1`` of them, uint64)."""
    t = np.asarray(tokens).astype(np.uint64)
    if n == 1:
        return t
    count = max(0, len(t) - n + 1)
    key = np.zeros(count, dtype=np.uint64)
    for j in range(n):
        key ^= t[j:j + count] * _MULTIPLIERS[j]  # wraps modulo 2**64
    return key


class PositionTable:
    """Values by 64-bit key, newest first (module docstring)."""

    def __init__(self, min_bits: int = 10):
        self._min_bits = min_bits
        self._head = np.full(1 << min_bits, -1, dtype=np.int64)
        self._key = np.empty(0, dtype=np.uint64)
        self._val = np.empty(0, dtype=np.int64)
        self._next = np.empty(0, dtype=np.int64)
        self.n = 0
        """Entries held."""

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Add ``values[i]`` under ``keys[i]``, in order (the last is the newest)."""
        k = len(keys)
        if k == 0:
            return
        end = self.n + k
        if end > len(self._key):
            size = max(end, 2 * len(self._key), 1024)
            for name in ("_key", "_val", "_next"):
                old = getattr(self, name)
                grown = np.empty(size, dtype=old.dtype)
                grown[: self.n] = old[: self.n]
                setattr(self, name, grown)
        self._key[self.n:end] = keys
        self._val[self.n:end] = values
        start, self.n = self.n, end
        if self.n > 2 * len(self._head):
            self._head = np.full(1 << max(self._min_bits, self.n.bit_length()), -1, dtype=np.int64)
            self._link(np.arange(self.n))
        else:
            self._link(np.arange(start, end))

    def add_few(self, keys: list[int], values: list[int]) -> None:
        """``add`` one entry at a time in Python integers: for the few entries a pass adds
        (a running sample's new tokens), where ``add``'s dozen numpy calls cost more than the
        entries. Same chains, same order as ``add``."""
        end = self.n + len(keys)
        if end > len(self._key) or end > 2 * len(self._head):
            self.add(np.array(keys, dtype=np.uint64), np.array(values, dtype=np.int64))
            return
        key, val, nxt, head = self._key.data, self._val.data, self._next.data, self._head.data
        mask = len(self._head) - 1
        e = self.n
        for k, v in zip(keys, values):
            key[e], val[e] = k, v
            b = k & mask
            nxt[e], head[b] = head[b], e
            e += 1
        self.n = end

    def newest(self, key: int, most: int) -> list[int]:
        """The values added under ``key``, newest first, at most ``most`` of them."""
        keys, vals, nxt = self._key.data, self._val.data, self._next.data  # indexed as Python ints
        out: list[int] = []
        e = int(self._head[key & (len(self._head) - 1)])
        while e >= 0 and len(out) < most:
            if keys[e] == key:
                out.append(vals[e])
            e = nxt[e]
        return out

    def _link(self, ids: np.ndarray) -> None:
        """Put entries ``ids`` (ascending: oldest first) at the heads of their buckets' chains."""
        buckets = (self._key[ids] & np.uint64(len(self._head) - 1)).astype(np.int64)
        order = np.argsort(buckets, kind="stable")
        b, e = buckets[order], ids[order]
        first = np.ones(len(b), dtype=bool)  # the oldest new entry of its bucket
        first[1:] = b[1:] != b[:-1]
        prev = np.empty_like(e)
        prev[first] = self._head[b[first]]
        later = np.flatnonzero(~first)
        prev[later] = e[later - 1]
        self._next[e] = prev
        last = np.ones(len(b), dtype=bool)  # the newest new entry of its bucket
        last[:-1] = first[1:]
        self._head[b[last]] = e[last]
