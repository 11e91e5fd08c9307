"""Discrete-event cluster simulator driving the real ``SchedulerCore`` on a simulated clock.

The core is the class the service runs, fed the same events the service feeds it, through the
same door (``core.handle``, ``core/events.py``): workers say hello (``WorkerJoined``), a trainer
submits steps (``submit_step`` with the next step's prompts as lookahead), workers report
completions (``Completed``), draft results (``DraftResult``), progress (``Progress``), weight
loads (``PolicyLoaded``) and heartbeats, each of which proves the worker alive, and a periodic
``tick`` runs the straggler and liveness checks. The actions the core returns are carried out on simulated
engines (:class:`~bubblespec.bench.sim.engine.SimulatedEngine`): ``Assign`` starts a request,
``Abort`` drops one, ``StartDraft`` / ``StopDraft`` run and preempt draft jobs, ``Deliver`` and
``StepFinished`` are recorded. The core's clock is the simulator's ``now``.

Events are kept in one heap: an engine's next boundary (a member's last token or the end of
its draft), a weight load finishing, and the tick. Per-step figures come from the
``StepSummary`` the core emits (makespan, busy / idle / drafting worker-seconds, provenance).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from dataclasses import MISSING, dataclass, field, fields, replace

from bubblespec.common.types import (
    Completion,
    FinishReason,
    Prompt,
    Provenance,
    SamplingParams,
    SchedulingPolicy,
    SourceStats,
    StepSummary,
)
from bubblespec.scheduler.core.events import Aborted, Completed, DraftResult, Heartbeat, PolicyLoaded, Progress, WorkerJoined
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.types import (
    Abort,
    Action,
    Assign,
    Deliver,
    Disconnect,
    Ignored,
    LoadPolicy,
    ModelLimits,
    PolicyFailed,
    PolicyLoadReported,
    PolicyReady,
    RequestsMoved,
    StartDraft,
    StepFailed,
    StepFinished,
    StopDraft,
    WorkerHello,
)
from bubblespec.scheduler.core.validate import Limits, build_step
from bubblespec.bench.sim.attribution import TailLog, TailRequest
from bubblespec.bench.sim.costs import CostProfile
from bubblespec.bench.sim.engine import Member, SimulatedEngine
from bubblespec.bench.sim.reasoning import loops
from bubblespec.bench.sim.workload import AcceptanceModel, SimPrompt, TraceWorkload, Workload

__all__ = ["SimResult", "SimSettings", "SimStalled", "StepStats", "simulate"]

_ENGINE, _LOADED = 0, 1
_NOTICES = (PolicyReady, PolicyLoadReported, RequestsMoved, Ignored)  # actions that ask the simulated cluster for nothing


class _Tokens(Sequence[int]):
    """The token ids of a simulated completion: a length and no tokens. ``len`` is what the core
    reads (lengths, token counts); iterating yields nothing, so the scheduler's vocabulary check
    has no simulated ids to scan (a real completion's ids are checked by the real tests)."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        raise TypeError("simulated completions carry a length, not token ids")

    def __iter__(self) -> Iterator[int]:
        return iter(())


_new = object.__new__


_SET_COMPLETION_FIELDS = ("step_id", "prompt_id", "sample_index", "token_ids", "logprobs", "text", "finish_reason",
                          "policy_version", "worker_id", "prompt_tokens", "provenance")
_UNUSED_COMPLETION_FIELDS = {f.name: f.default for f in fields(Completion) if f.name not in _SET_COMPLETION_FIELDS}
"""``Completion`` fields a simulated completion leaves at their defaults (every field it does not set)."""
if any(v is MISSING for v in _UNUSED_COMPLETION_FIELDS.values()):
    raise RuntimeError(f"Completion fields without a plain default: {_UNUSED_COMPLETION_FIELDS}")


def _frozen(cls: type, fields: dict[str, object]) -> Any:
    """``cls(**fields)`` for a frozen dataclass given every one of its fields, in their order,
    without its ``__init__``, which sets each field through ``object.__setattr__`` (a
    ``Completion`` and its provenance cost ~3 us that way, once per simulated request). The
    same object: equal to the constructor's, with the same ``__dict__``
    (tests/unit/test_sim_engine_speed.py)."""
    obj = _new(cls)
    obj.__dict__.update(fields)
    return obj


class SimStalled(RuntimeError):
    """The simulated cluster stopped making progress (a scheduling bug, or a workload that
    cannot finish)."""


@dataclass(frozen=True)
class SimSettings:
    """How the simulated cluster and its workers behave."""

    capacity: int = 256
    """Requests each worker runs at once (vLLM ``max_num_seqs``), sent in its hello."""
    samples: int = 8
    """Samples per prompt (GRPO group size); requests per step = prompts x samples."""
    tick_seconds: float = 1.0
    """Simulated period of ``core.tick()`` (the service ticks every 0.25 s; coarser is cheaper)."""
    heartbeat_seconds: float = 1.0
    """Simulated period of every worker's heartbeat (the real agent's default)."""
    progress_seconds: float = 5.0
    """Simulated period of each running request's progress report (must stay well under the
    core's ``stall_seconds``, or long requests are taken for stalled)."""
    history_drafts: bool = True
    """A finished sample becomes a ``history`` draft for samples of its prompt that start later
    (the worker agent stores every completion as one)."""
    train_seconds: float = 0.0
    """Simulated time between a step's end and the next step (reward + training). Idle workers
    go on drafting the next step's prompts through it, until the next step's work (or
    ``update_policy``) preempts them."""
    policy_updates: bool = False
    """Between steps, call ``update_policy`` and report every worker's load (the RL weight
    push). Off by default. (It was off first because the barrier cost O(workers^2); the core now
    keeps the set of workers still loading, docs/results/2026-11-22-simulator-first-runs.md.)"""
    load_seconds: float = 0.0
    """Simulated time one weight load takes, with ``policy_updates``."""
    straggler_watch: bool | None = None
    """Straggler watch of the steps; None: on for queue policies, off for ``static`` (the
    baseline is today's data-parallel split, which moves nothing)."""
    core: CoreSettings = field(default_factory=CoreSettings)
    """Core settings (``drafting`` is set from ``simulate``'s argument)."""
    max_sim_seconds: float = 1e7
    """Give up (``SimStalled``) when simulated time passes this."""
    tail_requests: int = 0
    """Last requests of each step kept for makespan attribution (``StepStats.tail``); 0: none."""


@dataclass(frozen=True)
class StepStats:
    """What one simulated step did (the core's ``StepSummary`` plus simulator counts)."""

    summary: StepSummary
    requests: int
    delivered: int
    """Distinct requests delivered."""
    duplicates: int
    """Deliveries of a request already delivered (must be 0)."""
    with_future_draft: int
    """Requests that found a ``future`` draft of their prompt when they started."""
    with_history_draft: int
    draft_jobs: int
    """Draft jobs started during the step."""
    drafting_workers: int
    """Distinct workers that got a draft job during the step."""
    wall_seconds: float
    """Real seconds the simulator spent on the step."""
    tail: tuple[TailRequest, ...] = ()
    """The step's last requests, the very last first (``SimSettings.tail_requests`` of them)."""
    tail_share: float = 0.0
    """Share of the step's makespan after 90% of its requests were delivered: the time its last
    tenth of requests takes (Seer's tail measure)."""
    truncated: int = 0
    """Requests delivered with finish reason ``length`` (they reached ``max_tokens``)."""

    @property
    def makespan_seconds(self) -> float:
        return self.summary.makespan_seconds

    @property
    def forward_passes_per_token(self) -> float:
        return self.summary.forward_passes_per_token

    @property
    def bubble_share(self) -> float:
        return self.summary.bubble_share

    @property
    def drafting_share(self) -> float:
        s = self.summary
        total = s.busy_worker_seconds + s.idle_worker_seconds + s.drafting_worker_seconds
        return s.drafting_worker_seconds / total if total > 0 else 0.0

    @property
    def accepted_per_pass(self) -> float:
        p = self.summary.provenance
        return p.accepted() / max(1, p.forward_passes)


@dataclass(frozen=True)
class SimResult:
    policy: SchedulingPolicy
    drafting: bool
    workers: int
    requests_per_step: int
    profile: str
    seed: int
    steps: tuple[StepStats, ...]
    setup_wall_seconds: float
    """Real seconds spent adding the workers to the core."""
    wall_seconds: float
    """Real seconds of the whole run."""
    events: int

    @property
    def reported(self) -> tuple[StepStats, ...]:
        """The steps a comparison should use: all but the first (which has no drafts to use:
        nothing ran before it), or the only one."""
        return self.steps[1:] or self.steps

    def mean(self, attr: str) -> float:
        vals = [getattr(s, attr) for s in self.reported]
        return sum(vals) / len(vals)

    @property
    def name(self) -> str:
        return self.policy.value + ("+drafts" if self.drafting else "")


DEFAULT_WORKLOAD = Workload()
DEFAULT_ACCEPTANCE = AcceptanceModel()
DEFAULT_SETTINGS = SimSettings()


def simulate(
    policy: SchedulingPolicy | str,
    workers: int,
    requests_per_step: int,
    steps: int,
    profile: CostProfile,
    drafting: bool,
    seed: int = 0,
    *,
    workload: Workload | TraceWorkload = DEFAULT_WORKLOAD,
    acceptance: AcceptanceModel = DEFAULT_ACCEPTANCE,
    settings: SimSettings = DEFAULT_SETTINGS,
    on_step: Callable[[StepStats], None] | None = None,
) -> SimResult:
    """Simulate ``steps`` rollout steps of ``requests_per_step`` requests on ``workers`` workers."""
    policy = SchedulingPolicy(policy)
    if workers < 1 or steps < 1:
        raise ValueError("workers and steps must be >= 1")
    if requests_per_step < 1 or requests_per_step % settings.samples:
        raise ValueError(f"requests_per_step ({requests_per_step}) must be a positive multiple of samples ({settings.samples})")
    started = time.perf_counter()
    with _cyclic_gc_paused():  # for the whole run: re-enabled between steps, it would walk each step's objects
        sim = _Simulation(policy, workers, requests_per_step // settings.samples, profile, drafting, seed,
                          workload, acceptance, settings)
        try:
            setup = time.perf_counter() - started
            stats = []
            for s in range(steps):
                if s and settings.train_seconds > 0:
                    sim.train(settings.train_seconds)
                if s and settings.policy_updates:
                    sim.update_policy()
                stats.append(sim.run_step(s))
                if on_step is not None:
                    on_step(stats[-1])
            events = sim.events_done
        finally:
            sim.close()
            del sim  # the run's objects are freed here, by reference counting (``_Simulation.close``)
    return SimResult(policy, drafting, workers, requests_per_step, profile.name, seed, tuple(stats), setup,
                     time.perf_counter() - started, events)


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector; reference counting still frees every object.
    A run allocates millions of objects (requests, engine members, completions, actions) that
    live for a step or more and form no reference cycles; the collector would walk them again
    and again for nothing (a fifth of a run's CPU at 1,024 workers, the same peak memory
    without it). Restores the collector's previous state."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class _StepLog:
    step_id: str
    requests: int
    delivered: set[str] = field(default_factory=set)
    duplicates: int = 0
    with_future: int = 0
    with_history: int = 0
    draft_jobs: int = 0
    drafters: set[str] = field(default_factory=set)
    summary: StepSummary | None = None
    started: float = 0.0
    tail: TailLog = field(default_factory=lambda: TailLog(0))
    finished_at: list[float] = field(default_factory=list)
    """Simulated time of each first delivery."""
    truncated: int = 0

    def tail_share(self, end: float) -> float:
        """Share of [started, end] after 90% of the requests were delivered."""
        times, span = sorted(self.finished_at), end - self.started
        n90 = max(1, math.ceil(0.9 * self.requests))
        if len(times) < n90 or span <= 0:
            return 0.0
        return (end - times[n90 - 1]) / span


class _Simulation:
    def __init__(self, policy: SchedulingPolicy, workers: int, prompts: int, profile: CostProfile, drafting: bool,
                 seed: int, workload: Workload | TraceWorkload, acceptance: AcceptanceModel, settings: SimSettings):
        self.policy, self.prompts, self.drafting, self.seed = policy, prompts, drafting, seed
        self.workload, self.acceptance, self.settings = workload, acceptance, settings
        self.now = 0.0
        self.core = SchedulerCore(replace(settings.core, drafting=drafting), clock=lambda: self.now,
                                  rng=random.Random(seed))  # draft seeds: deterministic per run
        self.limits = ModelLimits(max_model_len=workload.lengths.max_tokens + 1024, vocab_size=32000)
        self.engines: dict[str, SimulatedEngine] = {}
        # (time, seq, kind, worker, version); an engine's event names the engine itself (no lookup
        # by worker id to tell a stale one), a weight load the worker id
        self.heap: list[tuple[float, int, int, SimulatedEngine | str, int]] = []
        self.spent: tuple[float, int, int, SimulatedEngine | str, int] | None = None  # the event being handled, left on top
        self.seq = itertools.count()
        self.dirty: dict[str, None] = {}
        self.future: dict[tuple[int, ...], int] = {}  # prompt -> longest future draft
        self.history: dict[tuple[int, ...], int] = {}  # prompt -> longest finished sample
        self.draft_jobs: dict[tuple[int, ...], int] = {}  # prompt -> draft jobs started
        # live siblings (``AcceptanceModel.siblings``): prompt -> its running requests' members and workers
        self.groups: dict[tuple[int, ...], list[tuple[str, Member]]] = {}
        self.group_done: dict[tuple[int, ...], int] = {}  # prompt -> samples finished
        self.sibling_rows = {n for n, _ in acceptance.siblings}
        self.wheel: dict[int, list[tuple[str, Member]]] = {}  # tick number -> progress reports due
        self.tick_no = 0
        self.progress_ticks = max(1, math.ceil(settings.progress_seconds / settings.tick_seconds))  # between reports
        self.next_heartbeat = 0.0
        self.events_done = 0
        self.loads_pending = 0
        self.outbox: list[tuple[str, str, int]] = []  # draft results still to report
        self.partials: list[tuple[str, str, Completion]] = []  # requests stopped to move, with what they made
        self.batches: dict[int, list[SimPrompt]] = {}
        self.current: dict[str, SimPrompt] = {}
        self.upcoming: dict[tuple[int, ...], SimPrompt] = {}
        self.by_ids: dict[tuple[int, ...], SimPrompt] = {}
        self.draft_lengths: dict[tuple[int, ...], list[int | None]] = {}  # upcoming prompt -> its draft lengths
        self.log: _StepLog | None = None
        for i in range(workers):
            wid = f"w{i:05d}"
            self.engines[wid] = SimulatedEngine(wid, profile, acceptance)
            hello = WorkerHello(wid, settings.capacity, self.core.version, self.limits, speculation=drafting,
                                accepts_resume=True)
            self._execute(self.core.handle(WorkerJoined(hello)))
        self._commit()

    def close(self) -> None:
        """Let reference counting free the run. The core and its collaborators refer to each
        other (and the core's clock to this simulation), so without this the run's millions of
        objects (requests, completions, engine members: 9 M after a drafting run at 4,096
        workers) stay alive as cyclic garbage until a full collection of the cyclic garbage
        collector walks every live object: ~9 s, paid inside whichever run or step it happened to
        fall in. Clearing the core's attributes breaks its cycles; neither is usable afterwards."""
        vars(self.core).clear()

    # -------------------------------------------------------------- steps --

    def _batch(self, s: int) -> list[SimPrompt]:
        if s not in self.batches:
            self.batches = {k: v for k, v in self.batches.items() if k >= s - 1}
            self.batches[s] = self.workload.step(self.seed, s, self.prompts, self.settings.samples)
        return self.batches[s]

    def run_step(self, s: int) -> StepStats:
        started = time.perf_counter()
        prompts, ahead = self._batch(s), self._batch(s + 1)
        self.current = {p.prompt_id: p for p in prompts}
        self.by_ids = {p.token_ids: p for p in prompts}
        self.groups, self.group_done = {}, {}
        self.upcoming = {p.token_ids: p for p in ahead}
        self.draft_lengths = {}
        watch = self.settings.straggler_watch
        spec = build_step(
            step_id=f"s{s}", policy_version=self.core.version,
            prompts=[Prompt(p.prompt_id, token_ids=p.token_ids) for p in prompts],
            sampling=SamplingParams(max_tokens=self.workload.lengths.max_tokens, n=self.settings.samples),  # unseeded
            lookahead=[Prompt(f"a{i}", token_ids=p.token_ids) for i, p in enumerate(ahead)],
            policy=self.policy, use_drafts=self.drafting,
            straggler_watch=self.policy is not SchedulingPolicy.STATIC if watch is None else watch,
            limits=Limits(max_prompts=max(65536, len(prompts)), max_lookahead=max(65536, len(ahead))),
            model=self.limits,
        )
        log = self.log = _StepLog(spec.step_id, spec.num_requests, started=self.now,
                                  tail=TailLog(self.settings.tail_requests))
        self._execute(self.core.submit_step(spec))
        self._commit()
        self._run_until(lambda: log.summary is not None)
        assert log.summary is not None
        return StepStats(log.summary, log.requests, len(log.delivered), log.duplicates, log.with_future,
                         log.with_history, log.draft_jobs, len(log.drafters), time.perf_counter() - started,
                         log.tail.requests(), log.tail_share(log.started + log.summary.makespan_seconds), log.truncated)

    def train(self, seconds: float) -> None:
        """Let ``seconds`` of simulated time pass with no step running (reward + training)."""
        self._run_until(lambda: False, until=self.now + seconds)

    def update_policy(self) -> None:
        version = self.core.version + 1
        self._execute(self.core.update_policy(version, f"sim://weights/v{version}"))
        self._commit()
        self._run_until(lambda: not self.loads_pending)

    # --------------------------------------------------------- event loop --

    def _run_until(self, done: Callable[[], bool], until: float = math.inf) -> None:
        """Process events in time order until ``done()`` or simulated time reaches ``until``."""
        tick = self.settings.tick_seconds
        idle_since = None
        heap = self.heap  # the list itself: never rebound
        while not done():
            while heap and heap[0][2] == _ENGINE and heap[0][4] != heap[0][3].version:  # type: ignore[union-attr]
                heapq.heappop(heap)  # stale: the engine's batch changed since
            if heap:
                idle_since = None
            elif idle_since is None:
                idle_since = self.now
            t_next = heap[0][0] if heap else math.inf
            t_tick = (self.tick_no + 1) * tick
            if min(t_next, t_tick) > until:
                self.now = until
                return
            if t_tick <= t_next:
                self.now = t_tick
                self.tick_no += 1
                self._tick()
                self._check_stall(idle_since)
            else:
                _, _, kind, who, version = top = heap[0]
                self.now = t_next
                self.events_done += 1
                if kind == _ENGINE:
                    self.spent = top  # left on top: stale once _commit moves the engine on, which replaces it
                    self._on_engine(who)  # type: ignore[arg-type]
                else:
                    heapq.heappop(heap)
                    self.loads_pending -= 1
                    self._execute(self.core.handle(PolicyLoaded(who, version, True)))  # type: ignore[arg-type]
            self._commit()
            self.spent = None

    def _check_stall(self, idle_since: float | None) -> None:
        log = self.log
        if log is None or log.summary is not None:
            return  # no step running: an idle cluster is fine
        limit = self.settings.core.worker_timeout_seconds + self.settings.core.stall_seconds
        if self.now > self.settings.max_sim_seconds or (idle_since is not None and self.now - idle_since > limit):
            left = log.requests - len(log.delivered)
            raise SimStalled(f"t={self.now:.1f}s: nothing is running for {self.now - (idle_since or 0):.0f}s "
                             f"and step {log.step_id} has {left} requests undelivered")

    def _tick(self) -> None:
        core, now = self.core, self.now
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + self.settings.heartbeat_seconds
            for wid, eng in self.engines.items():
                core.handle(Heartbeat(wid, 0.0 if eng.jobs else eng.tokens_per_second()))
        for wid, m in self.wheel.pop(self.tick_no, ()):
            eng = self.engines[wid]
            if eng.members.get(m.key) is m:
                core.handle(Progress(wid, m.key, eng.tokens(m.key, now)))
                self._schedule_progress(wid, m)
        self._execute(core.tick())

    def _schedule_progress(self, wid: str, m: Member) -> None:
        due = self.tick_no + self.progress_ticks
        self.wheel.setdefault(due, []).append((wid, m))

    def _commit(self) -> None:
        while self.outbox or self.partials:  # results of stopped jobs and requests reach the core after the stop
            results, self.outbox = self.outbox, []
            for wid, job_id, tokens in results:
                self._execute(self.core.handle(DraftResult(wid, job_id, tokens, finished=False)))
            partials, self.partials = self.partials, []
            for wid, key, partial in partials:
                self._execute(self.core.handle(Aborted(wid, key, "moved", partial)))
        now, heap, engines = self.now, self.heap, self.engines
        for wid in self.dirty:
            eng = engines[wid]
            t = eng.commit(now)
            if t is not None:
                entry = (t, next(self.seq), _ENGINE, eng, eng.version)
                if self.spent is not None and heap[0] is self.spent:
                    # the event just handled is still on top, and stale (its engine was committed):
                    # replace it, one sift of the heap (of every busy worker) instead of two
                    heapq.heapreplace(heap, entry)
                    self.spent = None
                else:
                    heapq.heappush(heap, entry)
        self.dirty.clear()

    def _on_engine(self, eng: SimulatedEngine) -> None:
        wid = eng.worker_id
        self.dirty[wid] = None
        core, execute = self.core, self._execute
        for m in eng.due(self.now):
            if m.job:
                prompt = m.payload.prompt_token_ids  # type: ignore[attr-defined]
                self.future[prompt] = max(self.future.get(prompt, 0), m.length)
                execute(core.handle(DraftResult(wid, m.key, m.length)))
            else:
                req = m.payload
                if self.settings.history_drafts:
                    self.history[req.prompt_token_ids] = max(self.history.get(req.prompt_token_ids, 0), m.length)  # type: ignore[attr-defined]
                if m.best:
                    self._sibling_finished(req.prompt_token_ids)  # type: ignore[attr-defined]
                if self.log is not None and self.log.tail.size:
                    self._attribute(wid, m, eng)
                execute(core.handle(Completed(wid, m.key, self._completion(wid, m, eng.passes))))

    def _sibling_finished(self, prompt: tuple[int, ...]) -> None:
        """One more sample of ``prompt`` finished: where that reaches a row of the siblings
        table, its running siblings draft from their own text at the row's acceptance."""
        done = self.group_done[prompt] = self.group_done.get(prompt, 0) + 1
        if done not in self.sibling_rows:
            return
        mean = self.acceptance.own_text_mean(done)
        p = self.by_ids.get(prompt)
        for wid, sm in self.groups.get(prompt, ()):
            eng = self.engines[wid]
            if p is not None and eng.members.get(sm.key) is sm:
                eng.retune(self.now, sm, self.acceptance.spread_alpha(mean, p.accept_z[sm.payload.sample_index]))  # type: ignore[attr-defined]
                self.dirty[wid] = None

    def _attribute(self, wid: str, m: Member, eng: SimulatedEngine) -> None:
        """Record a finished request for makespan attribution (``SimSettings.tail_requests``)."""
        log = self.log
        log.tail.add(TailRequest(  # type: ignore[union-attr]
            m.key, wid, m.length, m.assigned_at - log.started, self.now - log.started,  # type: ignore[union-attr]
            m.source, int(m.draft_len), m.alpha, m.max_k, m.forward_passes(eng.passes), m.spec_passes,
            m.accepted, m.batch_at_start, len(eng.members) + 1))

    def _completion(self, wid: str, m: Member, passes: float) -> Completion:
        req = m.payload
        sources: tuple[SourceStats, ...] = ()
        accepted = 0
        if m.drafted > 0:
            accepted = round(m.accepted)
            sources = (_frozen(SourceStats, {"source": m.source, "drafted_tokens": round(m.drafted),
                                             "accepted_tokens": accepted}),)
        if m.suffix_drafted > 0:
            suffix = round(m.suffix_accepted)
            accepted += suffix
            sources += (_frozen(SourceStats, {"source": "suffix", "drafted_tokens": round(m.suffix_drafted),
                                              "accepted_tokens": suffix}),)
        # every pass makes one token plus its accepted drafts: passes = length - accepted, exactly
        # (the fluid pass count equals it up to rounding, which must not leak into the identity)
        finish = FinishReason.LENGTH if m.length >= req.sampling.max_tokens else FinishReason.STOP  # type: ignore[attr-defined]
        # Simulated tokens: a length without token ids (the core only measures it), so 262,144
        # completions neither hold nor get scanned token by token (the vocabulary check).
        provenance = _frozen(Provenance, {"forward_passes": max(1, m.length - accepted) if sources or m.resumed
                                          else m.forward_passes(passes), "sources": sources})
        return _frozen(Completion, {
            "step_id": req.step_id, "prompt_id": req.prompt_id, "sample_index": req.sample_index,  # type: ignore[attr-defined]
            "token_ids": _Tokens(m.length), "logprobs": (), "text": "", "finish_reason": finish,
            "policy_version": req.policy_version, "worker_id": wid,  # type: ignore[attr-defined]
            "prompt_tokens": self.workload.prompt_tokens, "provenance": provenance, **_UNUSED_COMPLETION_FIELDS})

    def _partial(self, wid: str, m: Member) -> Completion:
        """What a request stopped to move had generated (``Aborted.partial``): its tokens so far
        (its position, frozen when it left the batch) and their passes and drafts."""
        req = m.payload
        tokens = int(m.pos0)
        sources: tuple[SourceStats, ...] = ()
        accepted = 0
        for name, drafted, gained in ((m.source, m.drafted, m.accepted), ("suffix", m.suffix_drafted, m.suffix_accepted)):
            if drafted > 0:
                took = min(round(gained), tokens - accepted)
                accepted += took
                sources += (_frozen(SourceStats, {"source": name, "drafted_tokens": round(drafted), "accepted_tokens": took}),)
        return _frozen(Completion, {
            "step_id": req.step_id, "prompt_id": req.prompt_id, "sample_index": req.sample_index,  # type: ignore[attr-defined]
            "token_ids": _Tokens(tokens), "logprobs": (), "text": "", "finish_reason": FinishReason.STOP,
            "policy_version": req.policy_version, "worker_id": wid,  # type: ignore[attr-defined]
            "prompt_tokens": self.workload.prompt_tokens,
            "provenance": _frozen(Provenance, {"forward_passes": tokens - accepted, "sources": sources}),
            **_UNUSED_COMPLETION_FIELDS})

    # ------------------------------------------------------------ actions --

    def _execute(self, actions: list[Action]) -> None:
        for a in actions:
            kind = type(a)
            if kind is Assign:
                self._assign(a)  # type: ignore[arg-type]
            elif kind is Deliver:
                self._deliver(a)  # type: ignore[arg-type]
            elif kind is StartDraft:
                self._start_draft(a)  # type: ignore[arg-type]
            elif kind is StopDraft:
                self._keep_partial(a.worker_id, self.engines[a.worker_id].remove(self.now, a.job_id))  # type: ignore[union-attr]
                self.dirty[a.worker_id] = None
            elif kind is Abort:
                m = self.engines[a.worker_id].remove(self.now, a.key)  # type: ignore[union-attr]
                if m is not None and a.keep_partial:  # type: ignore[union-attr]
                    self.partials.append((a.worker_id, m.key, self._partial(a.worker_id, m)))  # type: ignore[union-attr]
                self.dirty[a.worker_id] = None
            elif kind is Disconnect:
                self._disconnect(a.worker_id)  # type: ignore[union-attr]
            elif kind is StepFinished:
                if self.log is not None and a.step_id == self.log.step_id:  # type: ignore[union-attr]
                    self.log.summary = a.summary  # type: ignore[union-attr]
            elif kind is LoadPolicy:
                self.loads_pending += 1
                heapq.heappush(self.heap, (self.now + self.settings.load_seconds, next(self.seq), _LOADED,
                                           a.worker_id, a.version))  # type: ignore[union-attr]
            elif kind is StepFailed:  # a request failed on max_attempts workers (they all died, say)
                left = self.log.requests - len(self.log.delivered) if self.log is not None else 0
                raise SimStalled(f"t={self.now:.1f}s: step {a.step_id} failed ({a.field}: {a.message}); "  # type: ignore[union-attr]
                                 f"{left} requests undelivered")
            elif kind is PolicyFailed:  # simulated loads never fail: a bug, not a scenario
                raise RuntimeError(f"policy update failed: {a.message}")  # type: ignore[union-attr]
            elif kind not in _NOTICES:
                raise TypeError(f"unexpected action {a!r}")

    def _assign(self, a: Assign) -> None:
        req, log = a.request, self.log
        p = self.current[req.prompt_id]
        draft_len, source, alpha = 0, "", 0.0
        if self.drafting and req.use_drafts:
            fut = self.future.get(p.token_ids, 0)
            hist = self.history.get(p.token_ids, 0) if self.settings.history_drafts else 0
            first = a.resume is None  # a moved request was counted where it started
            if fut:
                draft_len, source = fut, "future"
                log.with_future += first  # type: ignore[union-attr]
            elif hist:
                draft_len, source = hist, "history"
                log.with_history += first  # type: ignore[union-attr]
            if source:
                alpha = self.acceptance.alpha(source, p.accept_z[req.sample_index])
            epoch = self.acceptance.epoch_history
            if epoch > 0 and epoch > (getattr(self.acceptance, source) if source else 0.0):
                # what-if: the prompt's response of an earlier epoch (a length drawn around its scale)
                draft_len = self.workload.lengths.length(p.scale, -p.draft_z[-1])
                if source != "history":  # counted once: as a history draft
                    log.with_history += first  # type: ignore[union-attr]
                    log.with_future -= first and source == "future"  # type: ignore[union-attr]
                source, alpha = "history", self.acceptance.spread_alpha(epoch, p.accept_z[req.sample_index])
        m = Member(req.key, p.lengths[req.sample_index], draft_len=draft_len, source=source, alpha=alpha,
                   prompt_tokens=self.workload.prompt_tokens, payload=req, assigned_at=self.now)
        if a.resume is not None:  # moved: it goes on from what it generated on its last worker
            before = a.resume.provenance
            m.resumed = len(a.resume.token_ids)
            m.drafted, m.accepted = float(before.drafted()), float(before.accepted())
            if before.sources and not m.source:
                m.source = before.sources[0].source
        if self.drafting and req.use_drafts and self.acceptance.suffix > 0:
            acc = self.acceptance
            if acc.siblings:  # grouped drafts: own text plus the siblings finished so far
                m.best = True
                m.suffix_alpha = acc.spread_alpha(acc.own_text_mean(self.group_done.get(p.token_ids, 0)),
                                                  p.accept_z[req.sample_index])
                self.groups.setdefault(p.token_ids, []).append((a.worker_id, m))
            else:
                m.suffix_alpha = acc.alpha("suffix", p.accept_z[req.sample_index])
            if acc.loop_share > 0 and m.length >= req.sampling.max_tokens and loops(
                    int(p.prompt_id[1:]), req.sample_index, acc.loop_share):
                m.loop_from, m.loop_alpha = float(max(0, m.length - acc.loop_tokens)), acc.loop_alpha
        eng = self.engines[a.worker_id]
        eng.add(self.now, m)
        m.batch_at_start = len(eng.members)
        self.dirty[a.worker_id] = None
        self._schedule_progress(a.worker_id, m)

    def _start_draft(self, a: StartDraft) -> None:
        ids = a.job.prompt_token_ids
        p = self.upcoming.get(ids)
        j = self.draft_jobs.get(ids, 0)
        self.draft_jobs[ids] = j + 1
        lm = self.workload.lengths
        if p is not None:  # the j-th draft of the prompt has length number j mod len(draft_z), each computed once
            lengths = self.draft_lengths.get(ids)
            if lengths is None:
                lengths = self.draft_lengths[ids] = [None] * len(p.draft_z)
            i = j % len(lengths)
            length = lengths[i]
            if length is None:
                length = lengths[i] = lm.length(p.scale, p.draft_z[i])
        else:
            length = lm.length(lm.median_tokens, 0.0)
        m = Member(a.job.job_id, length, job=True, prompt_tokens=self.workload.prompt_tokens, payload=a.job)
        stored = self.future.get(ids, 0)
        if stored:  # the prompt's stored draft (a stopped job's partial): verified first, as a real job does
            m.draft_len, m.source, m.alpha = min(stored, length), "future", self.acceptance.alpha("future", 0.0)
        self.engines[a.worker_id].add(self.now, m)
        self.dirty[a.worker_id] = None
        if self.log is not None:
            self.log.draft_jobs += 1
            self.log.drafters.add(a.worker_id)

    def _keep_partial(self, wid: str, m: Member | None) -> None:
        """A stopped draft job keeps what it generated and reports it (as the worker agent does:
        it stores the partial draft and sends a draft result)."""
        if m is None or not m.job:
            return
        tokens = int(m.pos0)
        if tokens > 0:
            prompt = m.payload.prompt_token_ids  # type: ignore[attr-defined]
            self.future[prompt] = max(self.future.get(prompt, 0), tokens)
        self.outbox.append((wid, m.key, tokens))

    def _disconnect(self, wid: str) -> None:
        """The core declared the worker dead: its stream closes and it drops all its work (the
        core has re-queued it). The simulated worker does not come back."""
        eng = self.engines[wid]
        for key in list(eng.members):
            eng.remove(self.now, key)
        self.dirty[wid] = None

    def _deliver(self, a: Deliver) -> None:
        log = self.log
        c = a.completion
        key = f"{c.step_id}/{c.prompt_id}/{c.sample_index}"
        if log is None or c.step_id != log.step_id:
            return
        if key in log.delivered:
            log.duplicates += 1
        else:
            log.delivered.add(key)
            log.finished_at.append(self.now)
            log.truncated += c.finish_reason is FinishReason.LENGTH
