"""One suffix structure per prompt group: every text a group's samples may draft from, indexed
once (pure: numpy, no vLLM).

A group is one prompt under one adapter version and one set of weights (``BubbleSpecProposer``
keys it so). Its texts (``Doc``) are the ``future`` and ``history`` drafts its requests brought,
the responses of its samples that finished on this engine, and the outputs of its samples
running now, which grow every step. ``GroupIndex`` keeps every text's tokens and ``min_match``-
grams in two tables of positions (``ngram_table.PositionTable``), so that finding where a
sample's recent tokens occurred costs O(occurrences), not a scan of every text. With 16 running
and 16 finished samples, that scan took ~0.3-2 ms a resync on this machine and the lookup
8-22x less (``python -m bubblespec.bench.resync_cost``); a pass may resync many rows.

``find`` is the resync of ``RequestDrafter``: among the occurrences of the sample's last tokens
(in any text but the sample's own, and in a running sibling only while it is ahead of the
sample), the longest match wins (up to ``max_match`` tokens; by the last token alone where no
``min_match``-gram matches); among the longest, the token that most texts continue with (the
frequency rule of suffix-tree drafting: SuffixDecoding, Seer's grouped drafts); among those,
the occurrence nearest the sample's position; on a tie, a stored draft before a sibling
(``future``, ``history``, ``sibling``), then the text added first, then the earlier position.
The draft then follows that text (``RequestDrafter``'s cursor) until it stops agreeing.

A text is held once: the same tokens brought again (a stored draft that several samples
bring, a draft job's response that the store returns as a ``future`` draft) add no text and
no vote, and the text counts as the higher-ranked source, the attribution the scheduler's
decisions read. Drafts never change a result: vLLM verifies them (docs/EXACTNESS.md).

Memory is bounded: at most ``max_finished`` finished responses a group (the newest; the engine
keeps more in ``groups.FinishedSamples``), and at most ``max_tokens`` tokens indexed per group
(past it, texts are kept but not indexed); ~78 bytes a token in all (the tables and each
text's int64 tokens). Texts grow between searches and are indexed, all of a group's at once,
at the next search. Entries of dropped texts are skipped, and the tables are rebuilt once
they outnumber the kept ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from bubblespec.worker.ngram_table import MAX_N, PositionTable, ngram_key, ngram_keys

__all__ = ["Candidate", "Doc", "GroupIndex", "GroupRule"]

_RANK = {"future": 0, "history": 1, "sibling": 2}
"""Which source a tie goes to, and which a text held twice is counted as."""


@dataclass
class Candidate:
    """One candidate continuation of a prompt. ``tokens`` may grow (a running sample's)."""

    source: str
    tokens: np.ndarray  # int64, 1-D


@dataclass(frozen=True)
class GroupRule:
    """How a group's texts are indexed and searched."""

    min_match: int = 3
    """Tokens of the sample's recent text that must occur in another text (the n-gram key)."""
    max_match: int = 24
    """Longest match compared when ranking occurrences."""
    max_occurrences: int = 64
    """Most recent occurrences of the key examined per search (bounds a search's cost)."""
    max_finished: int = 16
    """Finished responses a group keeps as texts (the newest)."""
    max_tokens: int = 1 << 21
    """Tokens indexed per group at most."""

    def __post_init__(self) -> None:
        for name in ("min_match", "max_occurrences", "max_finished", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")
        if self.min_match > MAX_N:
            raise ValueError(f"min_match: must be <= {MAX_N}, got {self.min_match!r}")
        if self.max_match < self.min_match:
            raise ValueError(f"max_match: must be >= min_match ({self.min_match}), got {self.max_match!r}")


class Doc:
    """One text of a group. ``candidate.tokens`` is always its tokens so far (a view)."""

    __slots__ = ("_buf", "candidate", "id", "live", "n")

    def __init__(self, doc_id: int, source: str, tokens: np.ndarray, live: bool):
        self.id, self.live = doc_id, live
        self._buf = np.array(tokens, dtype=np.int64)
        self.n = len(self._buf)
        self.candidate = Candidate(source, self._buf[: self.n])

    def append(self, tokens: np.ndarray) -> None:
        end = self.n + len(tokens)
        if end > len(self._buf):
            grown = np.empty(max(end, 2 * len(self._buf), 64), dtype=np.int64)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : end] = tokens
        self.n = end
        self.candidate.tokens = self._buf[:end]


class GroupIndex:
    """The texts of one group and their n-gram index (module docstring)."""

    SMALL_FLUSH = 64
    """New tokens up to which ``_flush`` indexes them one by one (``_flush_few``): a pass adds a
    few tokens a running sample, and numpy's fixed cost a call outweighs so few
    (``python -m bubblespec.bench.propose_cost``)."""

    def __init__(self, rule: GroupRule | None = None):
        self.rule = rule or GroupRule()
        self._docs: dict[int, Doc] = {}  # by id, in the order added
        self._ends = PositionTable()  # n-gram key -> doc id << 32 | the position just after it
        self._ones = PositionTable()  # token -> doc id << 32 | the position just after it
        self._pending: dict[int, tuple[Doc, int]] = {}  # doc id -> (doc, position its unindexed tokens start at)
        self._kept: dict[tuple[int, int], Doc] = {}  # (length, hash) of each fixed text: one text per content
        self._finished: list[Doc] = []
        self._next_id = 0
        self.version = 0
        """Changes whenever a text is added, grows or goes (a search that found nothing may find
        something after)."""
        self.indexed = 0
        """Tokens in the tables, those of dropped texts included until they are rebuilt."""
        self._dropped = 0
        self._sources: tuple[int, dict[str, int]] = (-1, {})  # (version, texts with a token by source)

    def sources(self, exclude: Doc | None = None) -> set[str]:
        """The draft sources of the texts that have a token, ``exclude`` left out."""
        version, counts = self._sources
        if version != self.version:
            counts = {}
            for doc in self._docs.values():
                if doc.n:
                    counts[doc.candidate.source] = counts.get(doc.candidate.source, 0) + 1
            self._sources = (self.version, counts)
        mine = exclude.candidate.source if exclude is not None and exclude.n and exclude.id in self._docs else None
        return {s for s, n in counts.items() if n > (s == mine)}

    def add(self, source: str, tokens: Iterable[int] | np.ndarray, *, live: bool = False,
            finished: bool = False) -> Doc | None:
        """A text of ``source``. A fixed one (a stored draft; ``finished``: a sample's response)
        is added once however many samples bring it (None the second time, or for an empty
        one); a ``live`` one is a running sample's output, grown with ``extend``."""
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not live:
            if len(arr) == 0 or self._known(arr, source):
                return None
        doc = Doc(self._next_id, source, arr, live)
        self._next_id += 1
        self.version += 1
        self._docs[doc.id] = doc
        self._pending[doc.id] = (doc, 0)
        if not live:
            self._kept[(len(arr), hash(arr.tobytes()))] = doc
        if finished:
            self._keep_finished(doc)
        return doc

    def extend(self, doc: Doc, tokens: np.ndarray) -> None:
        """``tokens`` were appended to the running sample's output ``doc``."""
        self._pending.setdefault(doc.id, (doc, doc.n))  # indexed at the next search, with the others'
        doc.append(np.asarray(tokens, dtype=np.int64))
        self.version += 1

    def finish(self, doc: Doc, source: str | None = None) -> None:
        """The running sample of ``doc`` finished: its response stays, for the group's other and
        later samples (the oldest finished one goes past ``max_finished``), as ``source`` if
        given (a draft job's response is a ``future`` draft). A response some text of the
        group already holds word for word is not kept twice."""
        if doc.id not in self._docs or not doc.live:
            return
        doc.live = False
        if source is not None:
            doc.candidate.source = source
            self.version += 1
        tokens = doc.candidate.tokens
        if doc.n == 0 or self._known(tokens, doc.candidate.source):
            self.drop(doc)
            return
        self._kept[(doc.n, hash(tokens.tobytes()))] = doc
        self._keep_finished(doc)

    def _known(self, tokens: np.ndarray, source: str) -> bool:
        """Whether a text of the group holds ``tokens`` already; if so, it takes ``source``
        where that ranks before its own (``future`` < ``history`` < ``sibling``: the attribution
        the scheduler's decisions read)."""
        doc = self._kept.get((len(tokens), hash(tokens.tobytes())))
        if doc is None or doc.id not in self._docs or not np.array_equal(doc.candidate.tokens, tokens):
            return False
        if _RANK.get(source, len(_RANK)) < _RANK.get(doc.candidate.source, len(_RANK)):
            doc.candidate.source = source
            self.version += 1
        return True

    def _keep_finished(self, doc: Doc) -> None:
        self._finished.append(doc)
        if len(self._finished) > self.rule.max_finished:
            self.drop(self._finished[0])

    def drop(self, doc: Doc) -> None:
        """Forget ``doc`` (its entries are skipped, then swept by a rebuild)."""
        if self._docs.pop(doc.id, None) is None:
            return
        self.version += 1
        if doc in self._finished:
            self._finished.remove(doc)
        if not doc.live:  # a fixed text: its content no longer stands for a text held
            key = (doc.n, hash(doc.candidate.tokens.tobytes()))
            if self._kept.get(key) is doc:
                del self._kept[key]
        self._dropped += doc.n
        if self._dropped * 2 > self.indexed:
            self._rebuild()

    def forget_finished(self) -> None:
        """Drop every finished response (the engine's caches were reset)."""
        for doc in list(self._finished):
            self.drop(doc)

    @property
    def live_docs(self) -> int:
        return sum(1 for d in self._docs.values() if d.live)

    def candidates(self, exclude: Doc | None = None) -> list[Candidate]:
        """Every text but ``exclude``, in the order added."""
        return [d.candidate for d in self._docs.values() if d is not exclude]

    def find(self, generated: np.ndarray, exclude: Doc | None = None) -> tuple[Candidate, int] | None:
        """(text, position) whose next tokens should follow ``generated`` (a sample's output so
        far, whose own text is ``exclude``); None where no other text continues it. Matches of
        ``min_match`` tokens or more are looked up by their n-gram; where there is none, or the
        output is shorter, by the last token alone (a shorter match, as good as there is)."""
        self._flush()
        g, m = len(generated), self.rule.min_match
        if g == 0:  # nothing to match: the first text that has a token
            for doc in self._docs.values():
                if self._usable(doc, 0, 0, exclude):
                    return doc.candidate, 0
            return None
        tail = generated[g - min(g, self.rule.max_match):].tolist()
        most = self.rule.max_occurrences
        found = []
        if g >= m:
            found = self._longest(self._ends.newest(ngram_key(tail[-m:]), most), tail, g, m, exclude)
        if not found:
            found = self._longest(self._ones.newest(tail[-1], most), tail, g, 1, exclude)
        if not found:
            return None
        votes: dict[int, set[int]] = {}  # next token -> the texts that continue with it
        for doc, end in found:
            votes.setdefault(int(doc.candidate.tokens[end]), set()).add(doc.id)
        top = max(map(len, votes.values()))
        doc, end = min(((d, e) for d, e in found if len(votes[int(d.candidate.tokens[e])]) == top),
                       key=lambda de: (abs(de[1] - g), _RANK.get(de[0].candidate.source, len(_RANK)), de[0].id, de[1]))
        return doc.candidate, end

    @staticmethod
    def _usable(doc: Doc | None, after: int, g: int, exclude: Doc | None) -> bool:
        """Whether ``doc`` has a token at ``after`` to propose: not the sample's own text, and a
        running sibling only while it is ahead of the sample (one in step with it, as under
        greedy decoding, holds only the sample's own past)."""
        return doc is not None and doc is not exclude and after < doc.n and (not doc.live or doc.n > g)

    def _longest(self, entries: list[int], tail: list[int], g: int, least: int,
                 exclude: Doc | None) -> list[tuple[Doc, int]]:
        """The (text, position after) pairs of ``entries`` whose match with ``tail`` is
        longest, at least ``least`` tokens."""
        best, found = least - 1, []
        for packed in entries:
            doc, end = self._docs.get(packed >> 32), packed & 0xFFFFFFFF
            if not self._usable(doc, end, g, exclude):
                continue
            assert doc is not None  # _usable checked it
            most = min(len(tail), end)
            before = doc.candidate.tokens[end - most:end].tolist()
            length = 0
            while length < most and before[most - 1 - length] == tail[-1 - length]:
                length += 1
            if length > best:
                best, found = length, [(doc, end)]
            elif length == best:
                found.append((doc, end))
        return found

    def _flush(self) -> None:
        """Enter the tokens added since the last search into both tables, every text's at once:
        a few (``SMALL_FLUSH`` at most, the new tokens of a pass) one by one in Python integers,
        more with numpy over all of them. Both paths make the same entries in the same order."""
        if not self._pending:
            return
        pending, self._pending = list(self._pending.values()), {}
        if sum(doc.n - start for doc, start in pending) <= self.SMALL_FLUSH:
            self._flush_few(pending)
            return
        m = self.rule.min_match
        segments, heads = [], []  # per text: its tokens from lo on; (id, lo, start, n)
        for doc, start in pending:
            if doc.id not in self._docs or doc.n <= start or self.indexed >= self.rule.max_tokens:
                continue
            lo = min(start, max(start + 1, m) - m)  # from where its first new n-gram begins
            segments.append(doc.candidate.tokens[lo:])
            heads.append((doc.id, lo, start, doc.n))
            self.indexed += doc.n - start
        if not segments:
            return
        ids, los, starts, ns = (np.array(c, dtype=np.int64) for c in zip(*heads))
        lens = ns - los
        tokens = np.concatenate(segments)
        seg = np.repeat(np.arange(len(lens)), lens)  # the text each token belongs to
        local = np.arange(len(tokens)) - np.repeat(np.cumsum(lens) - lens, lens)
        pos = los[seg] + local  # each token's position in its text
        base = ids[seg] << 32
        new = pos >= starts[seg]
        self._ones.add(tokens[new], (base + pos + 1)[new])
        count = len(tokens) - m + 1  # n-gram windows over the joined tokens: those inside one text
        if count > 0:
            inside = local[:count] + m <= lens[seg[:count]]
            ends = pos[:count] + m
            fresh = inside & (ends > starts[seg[:count]])
            self._ends.add(ngram_keys(tokens, m)[fresh], (base[:count] + ends)[fresh])

    def _flush_few(self, pending: list[tuple[Doc, int]]) -> None:
        """``_flush`` for a few new tokens: the same entries, in Python integers."""
        m = self.rule.min_match
        one_keys: list[int] = []
        one_vals: list[int] = []
        end_keys: list[int] = []
        end_vals: list[int] = []
        for doc, start in pending:
            if doc.id not in self._docs or doc.n <= start or self.indexed >= self.rule.max_tokens:
                continue
            lo = max(0, start - m + 1)  # the first new n-gram's first token
            tokens = doc.candidate.tokens[lo:doc.n].tolist()
            base = doc.id << 32
            self.indexed += doc.n - start
            for pos in range(start, doc.n):
                one_keys.append(tokens[pos - lo])
                one_vals.append(base + pos + 1)
            for end in range(max(start + 1, m), doc.n + 1):
                end_keys.append(ngram_key(tokens[end - m - lo:end - lo]))
                end_vals.append(base + end)
        if one_keys:
            self._ones.add_few(one_keys, one_vals)
        if end_keys:
            self._ends.add_few(end_keys, end_vals)

    def _rebuild(self) -> None:
        self._ends, self._ones, self.indexed, self._dropped = PositionTable(), PositionTable(), 0, 0
        self._pending = {doc.id: (doc, 0) for doc in self._docs.values()}
