"""The scheduling core with a fake clock: dispatch, exactly-once, failures, barrier, drafts."""

from __future__ import annotations

import pytest
from bubblespec.common.types import Completion, FinishReason, Prompt, SamplingParams, SchedulingPolicy
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.types import (
    Abort,
    Assign,
    Deliver,
    Ignored,
    InvalidRequest,
    LoadPolicy,
    ModelLimits,
    PolicyReady,
    StartDraft,
    StepFinished,
    StopDraft,
    WorkerHello,
)
from bubblespec.scheduler.core.validate import Limits, build_step

LIMITS = ModelLimits(max_model_len=256, vocab_size=100)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_core(**settings) -> tuple[SchedulerCore, Clock]:
    clock = Clock()
    return SchedulerCore(CoreSettings(**settings), clock), clock


def hello(wid: str, capacity: int = 4, version: int = 0, spec: bool = True) -> WorkerHello:
    return WorkerHello(wid, capacity, version, LIMITS, spec)


def step(step_id: str, prompts: int, n: int = 1, policy=SchedulingPolicy.QUEUE, version: int = 0, lookahead=(),
         **kw):
    return build_step(step_id=step_id, policy_version=version,
                      prompts=[Prompt(f"p{i}", token_ids=(5, i + 6)) for i in range(prompts)],
                      sampling=SamplingParams(temperature=0.0, max_tokens=16, n=n),
                      lookahead=[Prompt(f"l{i}", token_ids=t) for i, t in enumerate(lookahead)],
                      policy=policy, limits=Limits(), model=LIMITS, **kw)


def complete(core: SchedulerCore, a: Assign, tokens: int = 3, version: int | None = None):
    r = a.request
    c = Completion(r.step_id, r.prompt_id, r.sample_index, tuple(range(tokens)), (0.0,) * tokens, "",
                   FinishReason.STOP, r.policy_version if version is None else version)
    return core.on_completion(a.worker_id, r.key, c)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_queue_spreads_work_evenly_and_refills():
    core, _ = make_core()
    core.add_worker(hello("a"))
    core.add_worker(hello("b"))
    assigns = of(core.submit_step(step("s", 12)), Assign)
    per = {w: sum(1 for a in assigns if a.worker_id == w) for w in "ab"}
    assert per == {"a": 4, "b": 4}  # capacity 4 each; 4 still queued
    refill = of(complete(core, assigns[0]), Assign)
    assert len(refill) == 1 and refill[0].worker_id == assigns[0].worker_id


def test_static_splits_up_front_and_never_steals_without_watch():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=2))
    core.add_worker(hello("b", capacity=2))
    assigns = of(core.submit_step(step("s", 8, policy=SchedulingPolicy.STATIC, straggler_watch=False)), Assign)
    a_keys = [x.request.prompt_id for x in assigns if x.worker_id == "a"]
    assert a_keys == ["p0", "p1"]
    for x in [x for x in assigns if x.worker_id == "b"]:
        follow = of(complete(core, x), Assign)
        assert all(f.request.prompt_id in ("p6", "p7") for f in follow)  # b only runs its own half


def test_every_completion_delivered_once_and_forgeries_ignored():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=8))
    core.add_worker(hello("b", capacity=8))
    assigns = of(core.submit_step(step("s", 3, n=2)), Assign)
    delivered = []
    first = assigns[0]
    forged = Assign("b" if first.worker_id == "a" else "a", first.request)
    assert [type(x) for x in complete(core, forged)] == [Ignored]  # not assigned to that worker: ignored
    for a in assigns:
        delivered += of(complete(core, a), Deliver)
    assert [type(x) for x in complete(core, assigns[0])] == [Ignored]  # a second copy: ignored
    assert sorted((d.completion.prompt_id, d.completion.sample_index) for d in delivered) == [
        (f"p{i}", s) for i in range(3) for s in range(2)]


def test_worker_loss_requeues_unfinished_work_to_the_others():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=8))
    core.add_worker(hello("b", capacity=8))
    assigns = of(core.submit_step(step("s", 8)), Assign)
    done = [a for a in assigns if a.worker_id == "a"][:1]
    complete(core, done[0])
    moved = of(core.remove_worker("a"), Assign)
    assert {m.request.key for m in moved} == {a.request.key for a in assigns if a.worker_id == "a"} - {done[0].request.key}
    assert all(m.worker_id == "b" for m in moved)
    finished = []
    for a in [a for a in assigns if a.worker_id == "b"] + moved:
        finished += of(complete(core, a), StepFinished)
    assert finished and finished[0].summary.completions == 8 and finished[0].summary.requests_requeued == 3


def test_silent_worker_is_declared_dead_on_tick():
    core, clock = make_core(worker_timeout_seconds=5)
    core.add_worker(hello("a"))
    core.add_worker(hello("b"))
    core.submit_step(step("s", 2))
    clock.now = 3
    core.heartbeat("b", 10.0)
    clock.now = 6
    core.tick()
    assert set(core.workers) == {"b"}


def test_policy_barrier_waits_for_every_worker_and_late_joiner_loads_first():
    core, _ = make_core()
    core.add_worker(hello("a"))
    core.add_worker(hello("b"))
    loads = of(core.update_policy(1, "/w1"), LoadPolicy)
    assert {x.worker_id for x in loads} == {"a", "b"}
    assert of(core.on_policy_loaded("a", 1, True), PolicyReady) == []
    assert of(core.on_policy_loaded("b", 1, True), PolicyReady) == [PolicyReady(1, 2)]
    joined = core.add_worker(hello("c", version=0))
    assert of(joined, LoadPolicy) == [LoadPolicy("c", 1, "/w1")]
    assigns = of(core.submit_step(step("s", 12, version=1)), Assign)
    assert "c" not in {a.worker_id for a in assigns}  # no work before it loaded v1
    assert of(core.on_policy_loaded("c", 1, True), Assign)


def test_step_checks_name_fields_and_change_nothing():
    core, _ = make_core()
    core.add_worker(hello("a"))
    core.submit_step(step("s", 1))
    with pytest.raises(InvalidRequest) as err:
        core.submit_step(step("s", 2))
    assert err.value.field == "step_id" and err.value.code == "ALREADY_EXISTS"
    with pytest.raises(InvalidRequest) as err:
        core.submit_step(step("t", 1, version=3))
    assert err.value.field == "policy_version"
    assert set(core.steps) == {"s"}


def test_idle_worker_drafts_and_yields_when_work_arrives():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=2))
    core.add_worker(hello("b", capacity=2))
    actions = core.submit_step(step("s", 2, n=1, lookahead=[(7, 8), (9, 10), (11, 12)]))
    assigns = of(actions, Assign)
    assert len(assigns) == 2 and {a.worker_id for a in assigns} == {"a", "b"}
    done = complete(core, assigns[0])
    drafts = of(done, StartDraft)
    assert drafts and all(d.worker_id == assigns[0].worker_id for d in drafts)
    assert {d.job.prompt_token_ids for d in drafts} <= {(7, 8), (9, 10), (11, 12)}
    # the other worker's request fails: it is re-queued and the drafting worker yields at once
    retry = core.on_aborted(assigns[1].worker_id, assigns[1].request.key)
    stops = of(retry, StopDraft)
    assert {s.job_id for s in stops} >= {d.job.job_id for d in drafts if d.worker_id == stops[0].worker_id}
    assert of(retry, Assign)


def test_stalled_request_moves_to_another_worker():
    core, clock = make_core(stall_seconds=5)
    core.add_worker(hello("a", capacity=1))
    core.add_worker(hello("b", capacity=1))
    assigns = of(core.submit_step(step("s", 2)), Assign)
    fast, slow = assigns
    complete(core, fast)
    clock.now = 2
    core.on_progress(slow.worker_id, slow.request.key, 4)
    clock.now = 8
    for w in core.workers:
        core.heartbeat(w, 1.0)
    actions = core.tick()
    assert Abort(slow.worker_id, slow.request.key) in actions
    moved = of(actions, Assign)
    assert moved and moved[0].request.key == slow.request.key
    assert of(complete(core, moved[0]), StepFinished)[0].summary.requests_moved == 1


def test_cancel_aborts_running_and_finishes_step():
    core, _ = make_core()
    core.add_worker(hello("a"))
    assigns = of(core.submit_step(step("s", 6)), Assign)
    actions = core.cancel_step("s")
    assert {a.key for a in of(actions, Abort)} == {a.request.key for a in assigns}
    assert of(actions, StepFinished)
    assert [type(x) for x in complete(core, assigns[0])] == [Ignored]


def test_dead_worker_releases_its_stopped_draft_jobs():
    core, _ = make_core(max_draft_jobs_beside_requests=0)  # drafting only once the worker is idle
    core.add_worker(hello("a", capacity=2))
    assigns = of(core.submit_step(step("s", 1, lookahead=[(7, 8)])), Assign)
    assert of(complete(core, assigns[0]), StartDraft)  # drafting in the gap after the step
    assert of(core.submit_step(step("t", 1, lookahead=[(9, 9)])), StopDraft)  # new work preempts it
    assert core.workers["a"].stopping and core.planner.upcoming[(7, 8)].in_flight == 1
    core.remove_worker("a")  # the stopped job's result never comes
    assert all(up.in_flight == 0 for up in core.planner.upcoming.values())


def test_drafting_goes_on_through_the_gap_until_the_next_policy():
    core, _ = make_core(max_draft_jobs_beside_requests=0)  # drafting only once the worker is idle
    core.add_worker(hello("a", capacity=4))
    assigns = of(core.submit_step(step("s", 1, lookahead=[(7, 8), (9, 10)])), Assign)
    finished = complete(core, assigns[0])
    assert of(finished, StepFinished)
    started = of(finished, StartDraft)
    assert {d.job.prompt_token_ids for d in started} == {(7, 8), (9, 10)}
    # a stopped job leaves a partial draft: its prompt is planned again
    stop = of(core.update_policy(1, "/w1"), StopDraft)
    assert {s.job_id for s in stop} == {d.job.job_id for d in started}
    assert core.on_draft_result("a", started[0].job.job_id, tokens=5, finished=False) == []  # still loading
    core.on_draft_result("a", started[1].job.job_id, tokens=9, finished=True)
    again = of(core.on_policy_loaded("a", 1, True), StartDraft)
    assert [d.job.prompt_token_ids for d in again] == [started[0].job.prompt_token_ids]
    assert again[0].job.policy_version == 1
    # greedy: one complete draft per prompt is all a step can use
    core.on_draft_result("a", again[0].job.job_id, tokens=9, finished=True)
    assert core.planner.pick() is None


def test_no_drafting_when_the_latest_step_asked_for_none():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=4))
    assigns = of(core.submit_step(step("s", 1, lookahead=[(7, 8)], use_drafts=False)), Assign)
    assert of(complete(core, assigns[0]), StartDraft) == []


def test_barrier_completes_when_a_loading_worker_dies():
    core, _ = make_core()
    core.add_worker(hello("a"))
    core.add_worker(hello("b"))
    core.update_policy(1, "/w1")
    assert of(core.on_policy_loaded("a", 1, True), PolicyReady) == []
    assert of(core.remove_worker("b"), PolicyReady) == [PolicyReady(1, 1)]


def test_queued_work_moves_to_an_idle_worker_under_straggler_watch():
    core, clock = make_core()
    core.add_worker(hello("a", capacity=1))
    core.add_worker(hello("b", capacity=1))
    assigns = of(core.submit_step(step("s", 6, policy=SchedulingPolicy.STATIC)), Assign)
    pending = [a for a in assigns if a.worker_id == "a"]
    while pending:  # a runs through its own share of the split
        pending = of(complete(core, pending.pop()), Assign)
    assert len(core.workers["b"].private) == 2  # b, slow, still holds queued work; a idles
    clock.now = 5
    moved = of(core.tick(), Assign)
    assert moved and all(m.worker_id == "a" for m in moved)
    assert core.steps["s"].moved >= 1


def test_slow_worker_loses_its_queue_and_does_not_take_it_back():
    core, clock = make_core(straggler_grace_seconds=2.0)
    core.add_worker(hello("a", capacity=4))  # runs its whole share at once
    core.add_worker(hello("b", capacity=2))
    assigns = of(core.submit_step(step("s", 8, policy=SchedulingPolicy.STATIC)), Assign)
    running = {w: [a for a in assigns if a.worker_id == w] for w in "ab"}
    assert len(core.workers["b"].private) == 2
    core.heartbeat("a", 100.0)
    core.heartbeat("b", 10.0)  # under half the median rate: a straggler
    clock.now = 1.0
    assert of(core.tick(), Assign) == [] and core.steps["s"].moved == 0  # still in its grace period
    clock.now = 3.0
    core.tick()
    assert not core.workers["b"].private and core.steps["s"].moved == 2
    # b finishes a request: it takes nothing back, its moved work waits for a
    assert of(complete(core, running["b"][0]), Assign) == []
    given = of(complete(core, running["a"][0]), Assign)
    assert [g.worker_id for g in given] == ["a"]
    assert core.steps["s"].requests[given[0].request.key].moved_from == "b"
    # with a gone, b is the only one left: it runs the rest of its moved work after all
    back = of(core.remove_worker("a"), Assign)
    assert back and all(g.worker_id == "b" for g in back)


def test_without_straggler_watch_static_never_moves_queued_work():
    core, clock = make_core()
    core.add_worker(hello("a", capacity=1))
    core.add_worker(hello("b", capacity=1))
    assigns = of(core.submit_step(step("s", 6, policy=SchedulingPolicy.STATIC, straggler_watch=False)), Assign)
    pending = [a for a in assigns if a.worker_id == "a"]
    while pending:
        pending = of(complete(core, pending.pop()), Assign)
    clock.now = 5
    assert of(core.tick(), Assign) == [] and core.steps["s"].moved == 0


def test_length_history_is_bounded_and_holds_no_prompts():
    core, _ = make_core(max_length_history=3)
    core.add_worker(hello("a", capacity=8))
    for a in of(core.submit_step(step("s", 6)), Assign):  # six distinct prompts
        complete(core, a)
    assert len(core.history.lengths) == 3
    assert all(isinstance(k, int) for k in core.history.lengths)  # keys are hashes, not token tuples
