"""``SimulatedEngine``: one simulated worker's continuous batch (not vLLM; a model of it).

A simulated engine runs the requests assigned to it and its draft jobs, in one batch (the
core stops the jobs it does not keep beside requests before it assigns one; a stopped job's
partial draft is kept, as the real worker agent does). Every forward pass over the batch costs
``CostProfile.step_seconds(batch, draft tokens, prefill, drafting members)`` and advances every member by
``1 + E[accepted drafts]`` tokens: drafts only while the member has one (a ``future`` or
``history`` draft of its prompt that has not run out), otherwise 1 token.

Passes are counted continuously (a fluid model of the pass clock), which makes the simulation
cost proportional to the number of batch changes rather than to the number of passes: a member
needs a known number of passes to reach its next boundary (the end of its draft, or its
last token), every member of a batch advances one pass per pass, so a heap ordered by the pass
count at which each boundary falls stays valid when the batch grows or shrinks; only the
seconds per pass change. Acceptance enters by its expectation; the randomness of a run comes
from the lengths and the per-request acceptance of the workload.

With a context-aware profile (``CostProfile.context_aware``) a pass also costs per token of
context each member holds (and per draft token times its member's context), so the seconds per
pass grow between batch changes. The engine keeps the batch's context in all (``ctx``, and
``kctx``, the sum of draft tokens times context) with their growth per pass, and charges each
stretch of passes at its midpoint; where the next boundary is far, it schedules a re-costing
point when the batch's context has grown by ``RECOST_SHARE`` (at least ``RECOST_MIN_PASSES``
passes on), at which the simulator finds nothing due and commits again.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from bubblespec.bench.sim.costs import CostProfile
from bubblespec.bench.sim.workload import AcceptanceModel, expected_accepted
from bubblespec.common.rules import paying_draft_tokens

__all__ = ["Member", "SimulatedEngine"]

_EPS = 1e-9
_LOOP_EPS = 1e-6
"""A position this close below ``Member.loop_from`` counts as having reached it (a boundary's rounding)."""
RECOST_SHARE = 0.05
"""Context-aware profiles: the seconds per pass are taken again once the batch's context grew by this share."""
RECOST_MIN_PASSES = 16
"""... and no sooner than this many passes on."""


@dataclass(slots=True)  # slots: hundreds of thousands per run; cheaper to create and to read
class Member:
    """A running request (``job=False``) or draft job (``job=True``) of a simulated engine."""

    key: str
    length: int
    """Tokens it generates before it finishes."""
    job: bool = False
    draft_len: float = 0.0
    """Draft available for positions [0, draft_len)."""
    source: str = ""
    alpha: float = 0.0
    prompt_tokens: int = 0
    joined: float = 0.0
    """Engine pass count when it joined."""
    p0: float = 0.0
    """Pass count at the start of its current phase."""
    pos0: float = 0.0
    """Tokens done at ``p0``."""
    k: int = 0
    """Draft tokens per pass in the current phase."""
    rate: float = 1.0
    """Tokens per pass in the current phase (1 + expected accepted drafts)."""
    target: float = 0.0
    """Pass count at which its next boundary falls."""
    spec_passes: float = 0.0
    """Passes spent with drafts (closed phases)."""
    drafted: float = 0.0
    accepted: float = 0.0
    started: bool = False
    """Its first phase has begun (set by ``commit``)."""
    gen: int = 0
    """Heap generation: bumps whenever ``target`` changes (stale entries are skipped)."""
    payload: object = None
    """What the simulator attached (the request spec or the draft job)."""
    suffix_alpha: float = 0.0
    """What-if: acceptance of self-drafts (suffix matching on its own text) past its draft's end; 0: none."""
    suffix_phase: bool = False
    """The current phase drafts from its own text."""
    suffix_drafted: float = 0.0
    suffix_accepted: float = 0.0
    max_k: int = 0
    """Most draft tokens per pass it ran with (makespan attribution)."""
    assigned_at: float = 0.0
    """Simulated time it joined (makespan attribution)."""
    batch_at_start: int = 0
    """Batch size when it joined, itself included (makespan attribution)."""
    best: bool = False
    """Its drafted phases take the better of its draft's and its own text's acceptance (grouped drafts)."""
    loop_from: float = math.inf
    """Position from which its text loops (drafted from its own text at ``loop_alpha``); inf: never."""
    loop_alpha: float = 0.0
    resumed: int = 0
    """Tokens it had generated on the worker it moved off (it joined at that position; their
    passes and drafts are in ``drafted`` / ``accepted`` from the start)."""

    def position(self, passes: float) -> float:
        pos = self.pos0 + (passes - self.p0) * self.rate
        return pos if pos < self.length else float(self.length)  # min(length, pos), inlined: a hot path

    def forward_passes(self, passes: float) -> int:
        return max(1, round(passes - self.joined))


class SimulatedEngine:
    """The batch of one simulated worker. Call ``commit(now)`` after a round of changes."""

    def __init__(self, worker_id: str, profile: CostProfile, acceptance: AcceptanceModel):
        self.worker_id = worker_id
        self.profile = profile
        self.acceptance = acceptance
        self._paying = acceptance.paying  # ``draft_tokens``'s dispatch, resolved once (see ``_rule``)
        # a drafted member's own cost (``per_drafted_seq_seconds``) as a share of a draft token's:
        # the paying rule's bar for a member's whole draft is the token's bar times this
        per_token = profile.per_draft_token_seconds
        self._row_ratio = profile.per_drafted_seq_seconds / per_token if per_token > 0 else 0.0
        self._caps = _cap_table(acceptance)
        self.members: dict[str, Member] = {}
        self.job_count = 0  # draft jobs in the batch
        self.passes = 0.0
        self.at = 0.0
        self.debt = 0.0  # seconds of prefill still to pay before passes advance
        self.pass_seconds = 0.0
        self.draft_tokens = 0  # sum of k over the batch
        self.drafting = 0  # members with k > 0 (a profile's costs of speculation beyond the tokens)
        self.rate_sum = 0.0  # sum of tokens per pass over the batch
        self.cap = -1
        self.plan_b = 0  # batch size the members' k were last planned at (the paying rule's bar)
        self.threshold = 0.0  # the paying rule's bar: a draft token's cost x the batch's tokens/s
        self.version = 0  # bumps on every commit: older scheduled events are stale
        # (target, seq, gen, member): an entry is stale once the member's gen moved on (a new phase,
        # or it left the batch: ``remove`` bumps it too), so no lookup by key is needed to tell
        self._heap: list[tuple[float, int, int, Member]] = []
        self._seq = itertools.count()
        self._pending: list[Member] = []
        self.context_aware = profile.context_aware
        self.ctx = 0.0  # context-aware profiles: the members' context tokens in all at ``passes``
        self.kctx = 0.0  # ... the sum of each member's draft tokens per pass times its context
        self.krate = 0.0  # ... kctx's growth per pass: the sum of k x tokens per pass
        self._recost = False  # the scheduled event is a re-costing point, not a member's boundary

    # ------------------------------------------------------------ changes --

    def advance(self, now: float) -> None:
        dt = now - self.at
        if dt > 0:  # now > at; called several times per event at the same ``now``, mostly with dt == 0
            if self.members:
                debt = self.debt
                paid = debt if debt < dt else dt  # min(dt, debt)
                self.debt = debt - paid
                moved = (dt - paid) / self.pass_seconds
                self.passes += moved
                if self.context_aware:
                    self.ctx += self.rate_sum * moved
                    self.kctx += self.krate * moved
            self.at = now

    @property
    def jobs(self) -> bool:
        """The batch is made of draft jobs alone."""
        return 0 < self.job_count == len(self.members)

    def add(self, now: float, member: Member) -> None:
        """Add a request or a draft job (a moved request at its ``resumed`` position: the prompt
        and what it generated before are prefilled)."""
        if now > self.at:  # advance(now) does nothing otherwise (several calls per event at one ``now``)
            self.advance(now)
        self.job_count += member.job
        member.joined = member.p0 = self.passes
        member.pos0 = float(member.resumed)
        self.members[member.key] = member
        self.ctx += member.prompt_tokens + member.resumed
        self.debt += self.profile.prefill_seconds(member.prompt_tokens + member.resumed)
        self._pending.append(member)

    def remove(self, now: float, key: str) -> Member | None:
        """Take a member out (abort, stop); its position is frozen at ``now``."""
        if now > self.at:  # advance(now) does nothing otherwise (several calls per event at one ``now``)
            self.advance(now)
        m = self.members.pop(key, None)
        if m is None:
            return None
        self.job_count -= m.job
        pos = m.position(self.passes)
        if not m.started:
            self._pending.remove(m)
            self.ctx -= m.prompt_tokens + m.pos0
        else:
            self._close_phase(m)
            self.draft_tokens -= m.k
            self.drafting -= m.k > 0
            self.rate_sum -= m.rate
            context = m.prompt_tokens + pos
            self.ctx -= context
            self.kctx -= m.k * context
            self.krate -= m.k * m.rate
        m.pos0, m.p0, m.k, m.rate = pos, self.passes, 0, 1.0
        m.gen += 1
        if not self.members:
            self._empty()
        return m

    def _empty(self) -> None:
        self.job_count, self.debt, self.rate_sum, self.draft_tokens, self.drafting = 0, 0.0, 0.0, 0, 0
        self.ctx, self.kctx, self.krate = 0.0, 0.0, 0.0

    def due(self, now: float) -> list[Member]:
        """Members whose last token falls at ``now`` (removed); drafts that ran out switch phase."""
        if now > self.at:  # advance(now) does nothing otherwise (several calls per event at one ``now``)
            self.advance(now)
        done: list[Member] = []
        heap, members, pop = self._heap, self.members, heapq.heappop  # locals: the simulator's hottest loop
        first = not self._recost  # a re-costing point: nothing is due by construction
        self._recost = False
        aware = self.context_aware
        passes = self.passes
        while heap:
            target, _, gen, m = heap[0]
            if m.gen != gen or not m.started:
                pop(heap)
                continue
            if not first and target > passes + _EPS * (1 + passes):
                break
            first = False  # the scheduled event is due by construction (rounding aside)
            pop(heap)
            if target > passes:
                if aware:
                    self.ctx += self.rate_sum * (target - passes)
                    self.kctx += self.krate * (target - passes)
                self.passes = passes = target
            k = m.k
            if k:  # a phase without drafts has nothing to close
                self._close_phase(m)
                self.drafting -= 1
            self.draft_tokens -= k
            self.rate_sum -= m.rate
            pos = m.pos0 + (target - m.p0) * m.rate  # m.position(target), inlined
            length = m.length
            m.pos0 = pos = pos if pos < length else float(length)
            m.p0 = target
            if aware and k:
                self.kctx -= k * (m.prompt_tokens + pos)
                self.krate -= k * m.rate
            if pos >= length - _EPS:
                m.pos0 = float(length)
                del members[m.key]
                self.job_count -= m.job
                self.ctx -= m.prompt_tokens + length
                done.append(m)
            elif m.job or not m.suffix_alpha > 0:
                # _start_phase(m, drafts=False) without self-drafts, inlined: one token per pass
                # to its last token (x / 1.0 is x exactly, so the target is the same)
                m.suffix_phase, m.k, m.rate = False, 0, 1.0
                left = length - pos
                m.target = target = target + (left if left > 0.0 else 0.0)
                m.gen += 1
                self.rate_sum += 1.0
                heapq.heappush(heap, (target, next(self._seq), m.gen, m))
            else:
                self._start_phase(m, drafts=False)
        if not self.members:
            self._empty()
        return done

    def commit(self, now: float) -> float | None:
        """Settle the round of changes at ``now``; return when the next member is due (or None)."""
        if now > self.at:  # advance(now) does nothing otherwise (several calls per event at one ``now``)
            self.advance(now)
        b = len(self.members)
        caps = self._caps
        cap = caps[b] if b < len(caps) else self.acceptance.batch_cap(b)
        moved = self._paying and b and not self.plan_b // 2 <= b <= 2 * self.plan_b
        if cap != self.cap or moved:  # re-planned when the cap changes or the batch doubles or halves
            self.cap, self.plan_b = cap, b
            self.threshold = self._threshold()
            self._rerate(cap)
        for m in self._pending:
            m.started = True
            self._start_phase(m, drafts=True)
        self._pending.clear()
        self.version += 1
        if not self.members:
            return None
        self.pass_seconds = self.profile.step_seconds(len(self.members), self.draft_tokens,
                                                      drafted_sequences=self.drafting)
        while self._heap:
            target, _, gen, top = self._heap[0]
            if top.gen == gen:
                if self.context_aware:
                    return self._commit_with_context(target)
                return self.at + self.debt + max(0.0, target - self.passes) * self.pass_seconds
            heapq.heappop(self._heap)
        raise RuntimeError(f"{self.worker_id}: members without a scheduled boundary")

    def _commit_with_context(self, target: float) -> float:
        """``commit``'s answer with a context-aware profile: the stretch to the next boundary
        (or to a re-costing point, if the batch's context grows by ``RECOST_SHARE`` before it)
        charged at the context of its midpoint."""
        passes = max(0.0, target - self.passes)
        self._recost = False
        if self.rate_sum > 0:
            recost = max(RECOST_MIN_PASSES, RECOST_SHARE * self.ctx / self.rate_sum)
            if passes > recost:
                passes, self._recost = recost, True
        half = passes / 2
        self.pass_seconds = self.profile.step_seconds(len(self.members), self.draft_tokens,
                                                      context_tokens=self.ctx + self.rate_sum * half,
                                                      draft_context_tokens=self.kctx + self.krate * half,
                                                      drafted_sequences=self.drafting)
        return self.at + self.debt + passes * self.pass_seconds

    def retune(self, now: float, m: Member, suffix_alpha: float) -> None:
        """A running member's own-text acceptance changed (live siblings finished): its current
        phase is re-planned at ``now`` if it drafts from its own text (or, with ``best``, from
        the better of its draft and its own text). Call ``commit`` after."""
        if now > self.at:
            self.advance(now)
        m.suffix_alpha = suffix_alpha
        if not m.started or self.members.get(m.key) is not m:
            return
        pos = m.position(self.passes)
        looping = pos >= m.loop_from - _LOOP_EPS
        drafted = pos < m.draft_len and not looping
        if looping or not (m.suffix_phase or (drafted and m.best)):
            return
        self._close_phase(m)
        self.draft_tokens -= m.k
        self.drafting -= m.k > 0
        self.rate_sum -= m.rate
        if m.k and self.context_aware:
            self.kctx -= m.k * (m.prompt_tokens + pos)
            self.krate -= m.k * m.rate
        m.pos0, m.p0 = pos, self.passes
        self._start_phase(m, drafts=True)

    # ------------------------------------------------------------- views --

    def tokens(self, key: str, now: float) -> int:
        if now > self.at:  # advance(now) does nothing otherwise (several calls per event at one ``now``)
            self.advance(now)
        m = self.members.get(key)
        return 0 if m is None else int(m.position(self.passes))

    def tokens_per_second(self) -> float:
        if not self.members or self.pass_seconds <= 0:
            return 0.0
        return self.rate_sum / self.pass_seconds

    @property
    def idle(self) -> bool:
        return not self.members

    # ----------------------------------------------------------- phases --

    def _start_phase(self, m: Member, drafts: bool, planned: int | None = None) -> None:
        """Begin a phase at (m.p0, m.pos0): with drafts while one covers the position; past it,
        self-drafts when ``suffix_alpha`` is set (a what-if), else one token per pass."""
        k, alpha, m.suffix_phase = 0, m.alpha, False
        looping = m.pos0 >= m.loop_from - _LOOP_EPS  # False unless a looping what-if set loop_from
        # a job too (its prompt's stored draft); ``drafts`` False: it just ran out
        if drafts and m.pos0 < m.draft_len and not looping:
            # only ``commit`` (and its ``_rerate``) start phases with drafts, after setting
            # ``self.cap`` to the cap of the batch as it is: batch_cap(len(self.members));
            # ``planned``: the k ``_rerate`` just took from the rule for this very phase
            if m.best and m.suffix_alpha > alpha:
                alpha = m.suffix_alpha
            k = self._rule(alpha, self.cap, self.threshold) if planned is None else planned
        elif m.suffix_alpha > 0 and not m.job:
            alpha, m.suffix_phase = (m.loop_alpha if looping else m.suffix_alpha), True
            k = self._rule(alpha, self.acceptance.batch_cap(len(self.members)), self.threshold)
        m.k = k
        if k > m.max_k:
            m.max_k = k
        if not k:
            rate = 1.0
        elif k > 0 and 0.0 < alpha < 1.0:  # expected_accepted(alpha, k), inlined: the same operations
            rate = 1.0 + alpha * (1 - alpha**k) / (1 - alpha)
        else:
            rate = 1.0 + expected_accepted(alpha, k)
        m.rate = rate
        if m.suffix_phase or not k:
            boundary = m.length
        else:  # min(m.draft_len, m.length): the first of two equal ones, as min returns
            boundary = m.length if m.length < m.draft_len else m.draft_len
        if boundary > m.loop_from and not looping:  # never with loop_from inf
            boundary = m.loop_from
        left = boundary - m.pos0
        m.target = target = m.p0 + (left if left > 0.0 else 0.0) / rate  # max(0.0, left), inlined: a hot path
        m.gen += 1
        self.draft_tokens += k
        if k:
            self.drafting += 1
        self.rate_sum += rate
        if k and self.context_aware:
            self.kctx += k * (m.prompt_tokens + m.pos0)
            self.krate += k * rate
        heapq.heappush(self._heap, (target, next(self._seq), m.gen, m))

    def _rerate(self, cap: int) -> None:
        """The batch size crossed a draft-cap threshold: re-plan members whose k changes."""
        threshold, passes = self.threshold, self.passes  # fixed here
        rule = self._rule
        # The paying rule, ``paying_draft_tokens(alpha, cap, threshold, 1.0, row_bar)``, for the usual case
        # (0 < threshold < 1, cap > 0, 0 < alpha < 1) with log(threshold) taken once per re-plan
        # instead of once per member: the same operations on the same values, so the same k
        # (tests/unit/test_sim_engine_speed.py compares it with the rule); any other case calls it.
        fast = self._paying and 0.0 < threshold < 1.0 and cap > 0
        log_t = math.log(threshold) if fast else 0.0
        row_bar = threshold * self._row_ratio
        log, floor = math.log, math.floor
        for m in self.members.values():
            if not m.started:
                continue
            if not m.k and not m.suffix_phase and m.pos0 >= m.draft_len:
                continue  # past its draft (its position is at least pos0), no self-drafts: k stays 0
            pos = m.pos0 + (passes - m.p0) * m.rate  # m.position(passes), inlined: once per member per re-plan
            pos = pos if pos < m.length else float(m.length)
            loop_from = m.loop_from
            drafted = pos < m.draft_len and pos < loop_from - _LOOP_EPS  # the second: always, unless a loop what-if
            if drafted or m.suffix_phase:
                if drafted:
                    alpha = m.alpha
                    if m.best and m.suffix_alpha > alpha:
                        alpha = m.suffix_alpha
                else:
                    alpha = m.loop_alpha if pos >= loop_from - _LOOP_EPS else m.suffix_alpha
                if fast and 0.0 < alpha < 1.0:
                    if alpha <= threshold:
                        want = 0
                    else:
                        want = floor(log_t / log(alpha) - 1e-9)
                        want = 0 if want < 0 else cap if want > cap else want  # max(0, min(cap, want))
                        if want and row_bar and alpha * (1 - alpha**want) / (1 - alpha) - want * threshold <= row_bar:
                            want = 0  # the member's draft does not pay for its own cost
                else:
                    want = rule(alpha, cap, threshold)
            else:
                want = 0
            if want != m.k:
                self._close_phase(m)
                self.draft_tokens -= m.k
                self.drafting -= m.k > 0
                self.rate_sum -= m.rate
                if m.k and self.context_aware:
                    self.kctx -= m.k * (m.prompt_tokens + pos)
                    self.krate -= m.k * m.rate
                m.pos0, m.p0 = pos, passes
                # with its draft ahead, _start_phase would ask the rule the same question again
                self._start_phase(m, drafts=True, planned=want if drafted else None)
        heap = self._heap
        if len(heap) > 2 * len(self.members) + 32:
            # mostly stale entries (each re-planned member left one): keep the live ones. Entries
            # are ordered by (target, seq), seq unique, so the live ones pop in the same order
            self._heap = [e for e in heap if e[3].gen == e[2]]
            heapq.heapify(self._heap)

    def _rule(self, alpha: float, cap: int, threshold: float) -> int:
        """``AcceptanceModel.draft_tokens(alpha, cap, threshold)``, its ``paying`` dispatch resolved once."""
        if self._paying:
            return paying_draft_tokens(alpha, cap, threshold, 1.0, threshold * self._row_ratio)
        return self.acceptance.draft_tokens(alpha, cap, threshold)

    def _threshold(self) -> float:
        """The paying rule's bar for the batch as it is: a draft token's cost times the batch's
        tokens/s (members not started yet counted at one token per pass)."""
        b = len(self.members)
        if not b:
            return 0.0
        tokens = self.rate_sum + len(self._pending)  # the members not started yet are those pending
        seconds = self.profile.step_seconds(b, self.draft_tokens, context_tokens=self.ctx, draft_context_tokens=self.kctx,
                                            drafted_sequences=self.drafting)
        return self.profile.per_draft_token_seconds * max(tokens, float(b)) / seconds

    def _close_phase(self, m: Member) -> None:
        if not m.k:
            return
        # max(0.0, x) written as ``x if x > 0.0 else 0.0`` (the same value, NaN and -0.0 included):
        # this runs for every phase that ends, hundreds of thousands of times a step
        if self.passes < m.target:
            passes = self.passes - m.p0
            passes = passes if passes > 0.0 else 0.0
        else:
            passes = m.target - m.p0
        tokens = passes * m.rate
        gained = tokens - passes
        gained = gained if gained > 0.0 else 0.0
        m.spec_passes += passes
        if m.suffix_phase:
            m.suffix_drafted += passes * m.k
            m.suffix_accepted += gained
        else:
            m.drafted += passes * m.k
            m.accepted += gained


_CAP_TABLES: dict[AcceptanceModel, list[int]] = {}


def _cap_table(acceptance: AcceptanceModel) -> list[int]:
    """``acceptance.batch_cap(b)`` for b = 0..1024, computed by it once per model (``commit``
    asks for every batch change; larger batches call it)."""
    table = _CAP_TABLES.get(acceptance)
    if table is None:
        table = _CAP_TABLES[acceptance] = [acceptance.batch_cap(b) for b in range(1025)]
    return table
