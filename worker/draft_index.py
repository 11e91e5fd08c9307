"""Per-request draft matching and adaptive draft length (pure: numpy and the scheduler core's
paying rule, no vLLM).

A request drafts from the texts of its group (``group_index.GroupIndex``: one per prompt,
adapter version and weights), each a candidate continuation (``Candidate``) of one of three
sources: ``future`` (responses pre-generated in bubbles for this prompt), ``history`` (earlier
steps' responses) and ``sibling`` (the other samples of the same prompt: running beside it,
their outputs growing every step, or finished on this engine).

``RequestDrafter.propose`` returns the next draft tokens for one request:

1. **Resync** (``GroupIndex.find``): where the request's recent tokens occur in another text
   of the group, the longest match, the continuation most texts agree on, the occurrence
   nearest the request's position; a text that agrees with everything so far is found so.
2. A cursor ``(candidate, position)`` remembers the match; as long as newly generated tokens
   keep agreeing with the candidate it advances without searching again.

4. **Self-suffix** (``SuffixIndex``): where no candidate continues the current position, the
   longest recent suffix (``min_match`` to ``max_match`` tokens) of the request's own sequence
   (prompt + output so far) that occurred earlier in that sequence proposes what followed it
   (source ``suffix``). The index grows by the new tokens only: a step costs O(new tokens +
   ``max_occurrences * max_match``), never a scan of the sequence.

Drafts never change a result: vLLM verifies them against the target model.

Adaptive length (``DraftLength``): each request keeps, per draft source, an exponential moving
average ``a`` of its per-token acceptance.  The j-th draft token is accepted with probability
about ``a**j``, so we draft while ``a**j >= min_accept_prob``; the batch caps it at
``token_budget // batch_size`` so that verification never makes a step compute-bound; a
request whose acceptance collapsed drafts one probe token every ``probe_every`` steps.

Paying length: where the engine knows what one draft token costs a pass
(``DraftLength.draft_token_seconds``, measured by ``bubblespec calibrate``) and the batch's
current tokens/s (``StepRate``, measured from the steps' wall time), ``min_accept_prob`` gives
way to the shared cost rule (``common.rules.paying_draft_tokens``, the
rule the simulator's engines use): the j-th token is drafted only while ``a**j`` exceeds the
draft token's cost times the batch's tokens/s. It drafts deep where a pass is memory-bound and
nothing where a draft token costs more than it is expected to save. The caps and the collapse
probe stay. The length decides only what is proposed: exactness never depends on it
(docs/EXACTNESS.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bubblespec.common.rules import paying_draft_tokens
from bubblespec.worker.group_index import Candidate, Doc, GroupIndex

__all__ = ["SOURCES", "Candidate", "DraftLength", "RequestDrafter", "StepRate", "SuffixIndex",
           "SuffixRule"]

SOURCES = ("future", "history", "sibling", "suffix")


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
    draft_token_seconds: float = 0.0
    """Seconds one more draft token adds to an engine pass (``bubblespec calibrate``'s
    ``per_draft_token_seconds``). Set (> 0): the paying rule picks the length from it and the
    batch's tokens/s (module docstring). 0: unknown; the ``min_accept_prob`` rule alone."""
    drafted_request_seconds: float = 0.0
    """Seconds a pass adds for each request with any draft, beyond its draft tokens
    (``DraftCostFit.per_drafted_request_seconds``). With the paying rule, a request drafts only
    where its draft's expected gain pays for that too. 0: not known (charged to nothing)."""

    def __post_init__(self) -> None:
        for name in ("draft_token_seconds", "drafted_request_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")

    def batch_cap(self, batch_size: int) -> int:
        return max(0, min(self.max_tokens, self.token_budget // max(1, batch_size)))

    def for_request(self, accept: float, steps: int, cap: int, tokens_per_second: float = 0.0) -> int:
        """Draft tokens for a request with acceptance average ``accept`` at its ``steps``-th step
        under ``cap``. ``tokens_per_second``: the batch's current rate (0: not measured yet);
        with ``draft_token_seconds`` set and a rate known, the paying rule decides."""
        if cap <= 0:
            return 0
        if self.draft_token_seconds > 0 and tokens_per_second > 0:
            return self._paying(accept, steps, cap, tokens_per_second)
        if accept < self.min_accept_prob:
            return 1 if steps % self.probe_every == 0 else 0
        if accept >= 0.999:
            return cap
        k = int(math.log(self.min_accept_prob) / math.log(accept))
        return max(1, min(cap, k))

    def _paying(self, accept: float, steps: int, cap: int, tokens_per_second: float) -> int:
        """``paying_draft_tokens`` under ``cap``. Where nothing pays, a request whose acceptance
        collapsed still probes (one token every ``probe_every`` steps) so that its average can
        recover, unless the batch is so compute-bound that not even a surely accepted token
        would pay (cost x tokens/s >= 1): then it drafts nothing."""
        k = paying_draft_tokens(accept, cap, self.draft_token_seconds, tokens_per_second, self.drafted_request_seconds)
        if k > 0 or accept >= self.min_accept_prob or self.draft_token_seconds * tokens_per_second >= 1:
            return k
        return 1 if steps % self.probe_every == 0 else 0


@dataclass
class StepRate:
    """Tokens per second of an engine's batch, from the wall time between its steps (smoothed).

    ``observe`` is called once per engine step with the tokens that step produced (over the
    whole batch, drafted requests or not) and the clock. The time since the previous call is
    that step's cost to the service (scheduling, forward pass, sampling, proposing), but only
    where the engine ran without a pause: a step that shares no request with the previous one
    (``continued`` False) may follow an idle spell, and its gap is not counted. Tokens and
    seconds are averaged apart (weight ``ema`` on the newest step) and divided."""

    ema: float = 0.2
    """Weight of the newest step in both averages."""
    tokens: float = 0.0
    """Average tokens per step (over the whole batch)."""
    seconds: float = 0.0
    """Average seconds per step; 0 until a step was measured."""
    last: float | None = None
    """Clock reading at the previous step."""

    def observe(self, tokens: int, now: float, continued: bool) -> None:
        last, self.last = self.last, now
        if last is None or not continued or now <= last:
            return
        if self.seconds <= 0:
            self.tokens, self.seconds = float(tokens), now - last
        else:
            self.tokens += self.ema * (tokens - self.tokens)
            self.seconds += self.ema * ((now - last) - self.seconds)

    def tokens_per_second(self) -> float:
        """The batch's smoothed rate; 0 before any step was measured."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SearchBackoff:
    """When the batch's search for drafts was fruitless, how many steps to propose nothing
    without searching.

    A search costs the proposer tens of microseconds a row, every step. In a large batch whose
    samples diverge (sampled at temperature 1) it mostly finds nothing the paying rule drafts,
    or drafts that the pass's fixed cost vetoes: on a 64-row CPU engine (4 prompts x 16
    samples, ``bench/group_drafts.py``) the proposer took 132 us a generated token searching
    every step, 29 with this backoff, against 6 with drafts off. After a proposal that sent no
    draft the next one skips the search, after two in a row the next two, and so on, doubling
    up to ``most``; a proposal that sends a draft, or a request that joins the batch (with
    stored drafts, or a group's new sample), searches again at once. (Not one that leaves it:
    in a large batch one leaves at almost every step.) A skipped step leaves out the group
    search only: its rows' outputs still join their groups' texts, and a row still drafts from
    its own text (``SuffixRule``, a lookup of its own). What is proposed changes, never what is
    accepted."""

    most: int = 16
    """The longest run of steps skipped in a row."""
    _wait: int = 0  # steps still to skip
    _next: int = 1  # steps to skip after the next fruitless search

    def skip(self) -> bool:
        """Whether this step skips its search (and counts it)."""
        if self._wait > 0:
            self._wait -= 1
            return True
        return False

    def searched(self, drafted: bool) -> None:
        """A search ended; ``drafted``: it sent some draft."""
        if drafted:
            self.reset()
        else:
            self._wait, self._next = self._next, min(self.most, 2 * self._next)

    def reset(self) -> None:
        self._wait, self._next = 0, 1


@dataclass
class RequestStats:
    forward_passes: int = 0
    drafted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))


@dataclass(frozen=True)
class SuffixRule:
    """How a request drafts from its own text where no candidate continues it (source ``suffix``)."""

    enabled: bool = True
    """Draft from the request's own prompt + output when no stored or sibling draft continues
    the current position. Exact either way: the target model verifies every proposed token."""
    min_match: int = 3
    """Shortest suffix of the sequence that must have occurred before to propose anything."""
    max_match: int = 24
    """Longest suffix compared when ranking earlier occurrences (bounds the cost of a lookup)."""
    max_occurrences: int = 8
    """Most recent earlier occurrences of the ``min_match``-token suffix that are compared."""

    def __post_init__(self) -> None:
        if self.min_match < 1:
            raise ValueError(f"min_match: must be >= 1, got {self.min_match}")
        if self.max_match < self.min_match:
            raise ValueError(f"max_match: must be >= min_match ({self.min_match}), got {self.max_match}")
        if self.max_occurrences < 1:
            raise ValueError(f"max_occurrences: must be >= 1, got {self.max_occurrences}")


class SuffixIndex:
    """Incremental index of one token sequence: every ``min_match``-gram maps to the positions
    just after its occurrences. ``extend`` costs O(new tokens); ``propose`` compares at most
    ``max_occurrences`` occurrences over at most ``max_match`` tokens each."""

    def __init__(self, rule: SuffixRule, tokens: Iterable[int] = ()):
        self.rule = rule
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        m = self.rule.min_match
        seq = self.tokens
        for t in tokens:
            seq.append(int(t))
            if len(seq) >= m:
                self._ends.setdefault(tuple(seq[-m:]), []).append(len(seq))

    def match(self) -> tuple[int, int]:
        """(position after the best earlier occurrence of the sequence's suffix, its length);
        (-1, 0) if the last ``min_match`` tokens never occurred before. Longest match wins,
        the most recent among equals."""
        seq, m, n = self.tokens, self.rule.min_match, len(self.tokens)
        if n <= m:
            return -1, 0
        ends = self._ends.get(tuple(seq[n - m:]), ())
        best_end, best_len = -1, 0
        for end in reversed(ends[-self.rule.max_occurrences - 1:]):
            if end >= n:
                continue  # the suffix itself
            length = m
            while length < self.rule.max_match and end - length > 0 and seq[end - length - 1] == seq[n - length - 1]:
                length += 1
            if length > best_len:
                best_end, best_len = end, length
                if length >= self.rule.max_match:
                    break
        return best_end, best_len

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the best earlier occurrence of the current suffix.
        Where that continuation runs into the present, it repeats with the period ``n - end``
        (the matched text repeats with that period, so the draft continues the repetition)."""
        end, _ = self.match()
        if end < 0 or k <= 0:
            return []
        seq, n = self.tokens, len(self.tokens)
        out: list[int] = []
        period = n - end
        for i in range(k):
            out.append(seq[end + i] if end + i < n else out[i - period])
        return out


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
        suffix: SuffixRule | None = None,
        prompt_tokens: Sequence[int] = (),
        predicted: float = 0.0,
        draft_job: bool = False,
        min_tokens: int = 0,
        group: GroupIndex | None = None,
    ) -> None:
        self.key = key
        self.min_tokens = min_tokens
        """The request's ``min_tokens``: drafts never reach it from below (``propose``)."""
        self.draft_job = draft_job
        """A draft job's generation: left out of the batch's makespan plan (``tail_drafts``),
        drafted by the paying rule."""
        self.predicted = predicted
        """The scheduler's predicted response length (0: none), for the batch's plan where no
        candidate continues the request (``tail_drafts``)."""
        self.prompt_hash = prompt_hash
        self.prompt_len = prompt_len
        self.group = group if group is not None else GroupIndex()
        """The texts this request drafts from: its group's (the proposer's), or its own."""
        for c in candidates:
            self.group.add(c.source, c.tokens)
        self.doc: Doc = self.group.add("sibling", (), live=True)  # type: ignore[assignment]  # live: never None
        """This request's own output, a text of the group for its other samples."""
        self.rule = rule
        self.accepts = dict.fromkeys(SOURCES, rule.prior)
        """Acceptance average by draft source, kept apart: a sibling that runs in step with
        the request (greedy decoding makes every sample the same) only matches the request's
        own past, and its rejected proposals must not shorten a stored draft that is accepted."""
        self.stats = RequestStats()
        self._cursor: tuple[Candidate, int] | None = None  # (candidate followed, position in it)
        self._seen = 0  # generated tokens already folded into the cursor
        self._missed: tuple[int, int] | None = None  # (output length, group version) of a search that found nothing
        self._last: tuple[str, int] | None = None  # (source, drafted) of the last proposal
        self._nothing_pays: tuple[tuple, bool] | None = None  # (its inputs, verdict) of the last ``nothing_pays``
        self.held_back = False
        """Whether the last proposal was cut to nothing by the length rule while a candidate
        continued the request (what a draft token's cost figure holds back; ``DraftCostFit``)."""
        self._suffix = SuffixIndex(suffix, prompt_tokens) if suffix is not None and suffix.enabled else None
        self._suffix_seen = 0  # generated tokens already in the suffix index
        self._suffix_prompt = len(prompt_tokens)

    @property
    def output(self) -> np.ndarray:
        """The request's output as the batch last showed it (``keep``): its response once it
        finishes, a sibling draft for its group's later samples (``worker/groups.py``)."""
        return self.doc.candidate.tokens

    @property
    def candidates(self) -> list[Candidate]:
        """The texts this request may draft from (its group's, its own output left out)."""
        return self.group.candidates(exclude=self.doc)

    def observe(self, num_sampled: int) -> None:
        """Account for the engine step that just sampled ``num_sampled`` tokens."""
        self.stats.forward_passes += 1
        if self._last is None:
            return
        source, drafted = self._last
        accepted = max(0, min(drafted, num_sampled - 1))
        self.stats.drafted[source] += drafted
        self.stats.accepted[source] += accepted
        rate = accepted / drafted
        self.accepts[source] = (1 - self.rule.ema) * self.accepts[source] + self.rule.ema * rate
        self._last = None

    @property
    def accept(self) -> float:
        """Acceptance average of the candidate that continues the request now (where none
        does, of ``future`` drafts, the usual first candidate)."""
        return self.accepts[self._cursor[0].source if self._cursor is not None else "future"]

    @property
    def last_accept(self) -> float:
        """Acceptance average of the source of the last proposal (0: none pending)."""
        return self.accepts[self._last[0]] if self._last is not None else 0.0

    def withdraw(self) -> None:
        """The last proposal was not sent to the engine (the batch's drafts did not pay for the
        pass): nothing to account for at the next step."""
        self._last = None

    @property
    def suffix_accept(self) -> float:
        """Acceptance average of self-suffix drafts."""
        return self.accepts["suffix"]

    def keep(self, generated: np.ndarray) -> None:
        """Bring ``output`` (the request's text in the group) up to ``generated``: the new
        tokens only; should the output ever be shorter than what was kept, from the start."""
        n = self.doc.n
        if len(generated) < n:
            self.group.drop(self.doc)
            self.doc = self.group.add("sibling", (), live=True)  # type: ignore[assignment]  # live: never None
            n = 0
        if len(generated) > n:
            self.group.extend(self.doc, generated[n:])

    def finish(self) -> np.ndarray:
        """The request left the batch: its output stays in the group as a finished sample's
        response; returned."""
        self.group.finish(self.doc, "future" if self.draft_job else None)
        return self.output

    def coverage(self, generated: np.ndarray, cap: int | None = None, tokens_per_second: float = 0.0) -> int:
        """Tokens of the candidate that continues ``generated`` left past it (0: none does);
        for a ``future`` or ``history`` draft, a prediction of what this request still has to
        generate (``tail_drafts``). With ``cap``: 0 without a search where the length rule
        drafts nothing from any source of the group (``nothing_pays``)."""
        if cap is not None and self.nothing_pays(cap, tokens_per_second):
            return 0
        pos = self._advance(generated)
        return 0 if pos is None else max(0, len(pos[0].tokens) - pos[1])

    def propose(self, generated: np.ndarray, cap: int, tokens_per_second: float = 0.0, k: int | None = None,
                search: bool = True) -> list[int]:
        """Draft tokens to follow ``generated`` (this request's output so far): from a
        candidate where one continues it, else from the request's own text (``SuffixRule``).
        ``tokens_per_second``: the batch's rate, for the paying rule (``DraftLength``); ``k``: a
        length decided for the batch (``tail_drafts``) instead of the rule's, for the candidate
        that continues the request (then nothing comes from the request's own text);
        ``search`` False: no candidate is looked for (``SearchBackoff``), only the own text."""
        if self._suffix is not None:
            self._sync_suffix(generated)
        if len(generated) < self.min_tokens:
            # vLLM 0.32 masks stop tokens at the bonus position (after the drafts) by the output length
            # *before* them, so a draft that reached min_tokens would keep EOS and stop tokens away from
            # a position where they are allowed. Drafting at most min_tokens - len - 1 tokens keeps the
            # bonus position below min_tokens, where the mask is right (docs/EXACTNESS.md).
            most = self.min_tokens - len(generated) - 1
            cap = min(cap, most)
            k = None if k is None else min(k, most)
        decided = k is not None
        self.held_back = False
        if not search:
            pos = None
        elif k is None and cap > 0 and self.nothing_pays(cap, tokens_per_second):
            pos = None  # a search could only find a candidate the rule would not draft from
            self.held_back = bool(self.group.sources(exclude=self.doc))
        else:
            pos = self._advance(generated) if (cap if k is None else k) > 0 else None
        if pos is not None:
            cand, at = pos
            if k is None:  # by the acceptance of this candidate's source
                k = self.rule.for_request(self.accepts[cand.source], self.stats.forward_passes, cap, tokens_per_second)
                self.held_back = k == 0 and at < len(cand.tokens)
            draft = cand.tokens[at : at + k]
            if len(draft):
                self._last = (cand.source, len(draft))
                return draft.tolist()
        if self._suffix is None or decided:
            return []
        drafted = self._suffix.propose(
            self.rule.for_request(self.suffix_accept, self.stats.forward_passes, cap, tokens_per_second))
        if drafted:
            self._last = ("suffix", len(drafted))
        return drafted

    def nothing_pays(self, cap: int, tokens_per_second: float = 0.0) -> bool:
        """Whether the length rule (``DraftLength.for_request``, this step) drafts no token at
        this request's acceptance of any source its group's texts have: then no candidate is
        drafted from, and the search for one (the proposer's main CPU cost in a large batch
        whose samples diverge) is skipped. The cursor catches up at the next search."""
        steps = self.stats.forward_passes
        key = (steps, cap, tokens_per_second, self.group.version, self.rule, *self.accepts.values())
        if self._nothing_pays is not None and self._nothing_pays[0] == key:
            return self._nothing_pays[1]  # asked again this pass (the batch plan, then the proposal)
        verdict = all(self.rule.for_request(self.accepts[s], steps, cap, tokens_per_second) == 0
                      for s in self.group.sources(exclude=self.doc))
        self._nothing_pays = (key, verdict)
        return verdict

    def _sync_suffix(self, generated: np.ndarray) -> None:
        """Append the newly generated tokens to the suffix index. Output only grows while a
        request runs; should it ever be shorter than what was indexed, the index restarts
        from the prompt."""
        assert self._suffix is not None
        if len(generated) < self._suffix_seen:
            self._suffix = SuffixIndex(self._suffix.rule, self._suffix.tokens[: self._suffix_prompt])
            self._suffix_seen = 0
        self._suffix.extend(generated[self._suffix_seen:].tolist())
        self._suffix_seen = len(generated)

    def _advance(self, generated: np.ndarray) -> tuple[Candidate, int] | None:
        g = len(generated)
        if self._cursor is not None:
            cand, at = self._cursor
            new = generated[self._seen :]
            # lists, not np.array_equal: a pass's few new tokens compare ~10x faster so
            if at + len(new) <= len(cand.tokens) and cand.tokens[at : at + len(new)].tolist() == new.tolist():
                self._cursor = (cand, at + len(new))
                self._seen = g
                return self._cursor
        elif self._missed == (g, self.group.version):  # nothing new since the last search (the batch plan, then the proposal)
            return None
        self._cursor = self.group.find(generated, exclude=self.doc)
        self._seen = g
        self._missed = (g, self.group.version) if self._cursor is None else None
        return self._cursor
