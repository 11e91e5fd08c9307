"""Draft jobs on the workers (pure): when a worker drafts, how many jobs it runs, which ones
stop, and the evidence that gates jobs beside requests. ``DraftJobs`` (``core.drafts``) owns
that state; the planner (``core/drafting.py``) picks the prompts.

- A worker with nothing to run drafts for announced prompts (``plan``), up to
  ``CoreSettings.max_draft_jobs_per_worker`` (``max_draft_jobs_during_step`` while a step runs),
  from the first step that asked for drafts until the next policy: drafting goes on through the
  trainer's gap between steps.
- A busy worker keeps up to ``max_draft_jobs_beside_requests`` jobs beside its requests
  (``beside``): never in a request's slot, never beside a moved request, only while future
  drafts pay (``BESIDE_MIN_SAVING``; through the first step before any evidence) and while the
  trainer's gaps are short; none beside fewer than ``min_requests_beside_draft_jobs`` requests,
  nor, once the step's tail began (``tail_begins``), fewer than
  ``min_requests_beside_draft_jobs_at_tail``.
- A new step stops the jobs of its own prompts, and dispatch waits for their results (``held``,
  ``HOLD_SECONDS`` at most): a job stores its partial draft before it reports, and a request
  dispatched earlier would read the draft store without it.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from bubblespec.common.types import Provenance
from bubblespec.scheduler.core.drafting import draft_seed, job_sampling
from bubblespec.scheduler.core.types import Action, DraftJobSpec, StartDraft, StepSpec, StopDraft

if TYPE_CHECKING:
    from bubblespec.scheduler.core.records import CoreParts, WorkerState

__all__ = ["BESIDE_MIN_SAVING", "HOLD_SECONDS", "DraftJobs"]

HOLD_SECONDS = 1.0
"""Longest dispatch waits for the results of a new step's stopped draft jobs (``stop_arrived``)."""
BESIDE_MIN_SAVING = 0.2
"""Share of a completion's tokens from accepted future drafts (a running mean over completions
offered any) below which no draft job runs beside requests."""


class DraftJobs:
    """The workers' draft jobs: which to start and stop, and what gates them (``core.drafts``)."""

    def __init__(self, core: CoreParts):
        self.core = core
        self.wanted = False
        """The latest step (or a call) asked for drafts of its lookahead."""
        self.held: dict[tuple[int, ...], list[float]] = {}
        """Prompt -> [its stopped jobs whose result is pending, since]: dispatch waits while any."""
        self.future_saving = -1.0
        """Running share of tokens from accepted future drafts (-1: none seen yet)."""
        self.last_finish: tuple[float, float] | None = None
        """(When, makespan) of the step that finished last."""
        self.long_gap = False
        """The trainer's last gap lasted at least as long as the step before it."""
        self.tail: str | None = None
        """The worker whose running out of the step's work began its tail (``tail_begins``)."""
        self._ids = itertools.count()

    # ------------------------------------------------------------------ steps --

    def step_arrives(self, spec: StepSpec, now: float, idle: bool) -> None:
        """A new step arrives at ``now`` (``idle``: no step was running, so a trainer's gap ends)."""
        if self.last_finish is not None and idle:
            finished_at, makespan = self.last_finish
            self.long_gap = makespan > 0 and now - finished_at >= makespan
        self.tail = None
        self.wanted = spec.use_drafts

    def stop_arrived(self, spec: StepSpec) -> list[Action]:
        """Stop the draft jobs of the step's own prompts, which have arrived (a job kept beside
        requests may still run one), and hold dispatch while any of them, or an earlier stopped
        job of those prompts, has not reported (``result``): a job stores its partial draft
        before it reports, and a request dispatched earlier would read the draft store without
        it. The reports take a few milliseconds (``HOLD_SECONDS`` at most, ``expire``); then one
        fill places the whole step, as it would have at once (a fill per report would split the
        balancer's placement into rounds, and scan every worker each time)."""
        arrived = {p.token_ids for p in spec.prompts}
        actions: list[Action] = []
        now = self.core.clock()
        for w in self.core.workers.values():
            for job in [j for j, p in w.drafts.items() if p in arrived]:
                actions.append(StopDraft(w.hello.worker_id, job))
                w.stopping[job] = w.drafts.pop(job)
            if spec.use_drafts:
                for prompt in w.stopping.values():
                    if prompt in arrived:
                        self.held.setdefault(prompt, [0, now])[0] += 1
        return actions

    def step_finished(self, now: float, makespan: float) -> list[Action]:
        """A step finished: the gap it leaves is timed from now; where no other step runs, idle
        workers draft at full width (``max_draft_jobs_during_step`` no longer limits them)."""
        self.last_finish = (now, makespan)
        self.tail = None
        core = self.core
        if core.settings.max_draft_jobs_during_step is None or core.current_step() is not None:
            return []
        return [a for w in core.workers.values() if not w.running for a in self.plan(w)]

    def forget(self) -> None:
        """Forget the evidence (benchmarks compare arms from scratch)."""
        self.future_saving, self.last_finish, self.long_gap = -1.0, None, False

    # ---------------------------------------------------------------- results --

    def release(self, prompt: tuple[int, ...]) -> None:
        """One pending draft result of ``prompt`` came (or never will)."""
        held = self.held.get(prompt)
        if held is not None:
            held[0] -= 1
            if held[0] <= 0:
                del self.held[prompt]

    def expire(self, now: float) -> bool:
        """Stop waiting for results that did not come within ``HOLD_SECONDS`` (the requests run
        without their drafts); whether any did."""
        expired = [p for p, (_, since) in self.held.items() if now - since > HOLD_SECONDS]
        for prompt in expired:
            del self.held[prompt]
        return bool(expired)

    def result(self, w: WorkerState, job_id: str, tokens: int, finished: bool) -> list[Action]:
        """A job of ``w`` ended (``SchedulerCore.on_draft_result``); unknown ones change nothing."""
        core = self.core
        if job_id not in w.drafts and job_id not in w.stopping:
            return []
        prompt = w.drafts.pop(job_id, None) or w.stopping.pop(job_id)
        core.planner.done(prompt, complete=finished and tokens > 0)
        core.timing.set_state(w, core.clock())
        if self.held:  # dispatch waits (``stop_arrived``): one fill, when the last pending
            self.release(prompt)  # partial draft is stored, places the work and plans drafts
            return [] if self.held else core.dispatcher.fill_all()
        actions = core.dispatcher.fill(w)
        if w.running and self.tail is not None and (first := core.workers.get(self.tail)) is not None \
                and not first.running:  # e.g. a job the tail stopped: the idle worker that began the tail drafts it
            actions += self.plan(first)
        return actions

    def worker_gone(self, w: WorkerState) -> None:
        """``w`` left: its jobs' prompts go back to the planner, and no result of theirs is awaited."""
        for prompt in (*w.drafts.values(), *w.stopping.values()):
            self.core.planner.done(prompt, complete=False)
            self.release(prompt)

    def note_saving(self, provenance: Provenance, tokens: int) -> None:
        """Fold the share of a completion's tokens that came from accepted future drafts into
        the running share that gates draft jobs beside requests (only completions that were
        offered future draft tokens count; ``CoreSettings.max_draft_jobs_beside_requests``)."""
        if tokens and provenance.drafted("future"):
            share = provenance.accepted("future") / tokens
            self.future_saving = share if self.future_saving < 0 else self.future_saving + 0.1 * (share - self.future_saving)

    # ------------------------------------------------------------------ gates --

    def beside(self, w: WorkerState, busy: int) -> int:
        """Draft jobs ``w`` may run beside ``busy`` requests (never in a request's slot; none
        beside fewer than ``min_requests_beside_draft_jobs``, or at the step's tail than
        ``min_requests_beside_draft_jobs_at_tail``, beside a moved request, while future drafts
        do not pay or while the trainer's gaps are long; ``CoreSettings.max_draft_jobs_beside_requests``)."""
        settings = self.core.settings
        if busy < settings.min_requests_beside_draft_jobs or self.long_gap or not self.pay() \
                or w.moved_in or (self.tail is not None and busy < settings.min_requests_beside_draft_jobs_at_tail):
            return 0
        return max(0, min(settings.max_draft_jobs_beside_requests, w.capacity - busy))

    def pay(self) -> bool:
        """Whether completions show future drafts paying (``BESIDE_MIN_SAVING``). Before any
        completion was offered one: yes through the first step (``draft_beside_first_step``),
        no after it (where workers propose no draft tokens, nothing will ever show them paying)."""
        if self.future_saving < 0:
            return self.last_finish is None and self.core.settings.draft_beside_first_step
        return self.future_saving >= BESIDE_MIN_SAVING

    def drafter(self, w: WorkerState) -> bool:
        """Whether ``w`` may run draft jobs now."""
        return self.core.settings.drafting and w.hello.speculation and w.version == self.core.version and not w.asleep

    def tail_begins(self, w: WorkerState) -> list[Action]:
        """If ``w`` is the first worker of the running step to have none of its work and to be
        able to draft, the step's tail begins (``CoreSettings.min_requests_beside_draft_jobs_at_tail``):
        stop the draft jobs beside the requests of every worker with fewer than that; none
        starts beside so few again until the next step (``beside``). Once a step: a pass over the workers."""
        least = self.core.settings.min_requests_beside_draft_jobs_at_tail
        if self.tail is not None or not least or w.running or self.held or w.loading is not None \
                or w.load_failed is not None or not self.drafter(w) or self.core.current_step() is None:
            return []
        self.tail = w.hello.worker_id
        return [a for o in self.core.workers.values() if o.running and o.drafts and len(o.running) < least
                for a in self.stop(o)]

    # ------------------------------------------------------------ start, stop --

    def plan(self, w: WorkerState, width: int | None = None) -> list[Action]:
        """Start draft jobs on ``w`` until it runs ``width`` (default: an idle worker's width)."""
        if not self.drafter(w):
            return []
        if not self.wanted:  # drafting goes on after the step, until the next policy
            return []
        core = self.core
        settings = core.settings
        actions: list[Action] = []
        if width is None:
            width = settings.max_draft_jobs_per_worker
            if settings.max_draft_jobs_during_step is not None and core.current_step() is not None:
                width = min(width, settings.max_draft_jobs_during_step)
            width = min(w.capacity, width)
        while len(w.drafts) < width:
            up = core.planner.pick()
            if up is None:
                break
            # never a request's seed (nor its random stream); logprobs of a draft are not used
            sampling = job_sampling(up, draft_seed(core.rng), w.hello.logprobs_mode)
            job = DraftJobSpec(f"d{next(self._ids)}", up.token_ids, sampling, core.version, up.for_step)
            w.drafts[job.job_id] = up.token_ids
            actions.append(StartDraft(w.hello.worker_id, job))
        return actions

    def stop(self, w: WorkerState, keep: int = 0) -> list[Action]:
        """Preempt ``w``'s draft jobs but the ``keep`` most valuable (their prompts predicted
        longest); each stopped one still reports its (partial) result."""
        if len(w.drafts) <= keep:
            return []
        jobs = list(w.drafts)
        if keep:
            upcoming = self.core.planner.upcoming
            jobs.sort(key=lambda j: -(u.predicted_len if (u := upcoming.get(w.drafts[j])) is not None else -1.0))
            jobs = jobs[keep:]
        actions: list[Action] = []
        for job in jobs:
            actions.append(StopDraft(w.hello.worker_id, job))
            w.stopping[job] = w.drafts.pop(job)
        return actions
