"""The attempt cap of the scheduling core (``CoreSettings.max_attempts``), with a fake clock.

A request taken back from a worker that failed it (the worker reported it aborted, died or
left while running it, or let it stall) counts a failed attempt; after ``max_attempts`` its
step fails with ``StepFailed`` naming the prompt, the rest of the step is aborted on its
workers and the step stays failed on resume. Moving queued work is never an attempt.
"""

from __future__ import annotations

from bubblespec.common.types import Completion, FinishReason, Prompt, SamplingParams, SchedulingPolicy
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.types import (
    Abort,
    Assign,
    Deliver,
    Ignored,
    ModelLimits,
    StepFailed,
    StepFinished,
    WorkerHello,
)
from bubblespec.scheduler.core.validate import Limits, build_step

MODEL = ModelLimits(max_model_len=256, vocab_size=100)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_core(workers: str = "abc", capacity: int = 4, **settings) -> tuple[SchedulerCore, Clock]:
    clock = Clock()
    core = SchedulerCore(CoreSettings(drafting=False, **settings), clock)
    for wid in workers:
        core.add_worker(WorkerHello(wid, capacity, 0, MODEL))
    return core, clock


def step(step_id: str, prompts: int, n: int = 1, **kw):
    return build_step(step_id=step_id, policy_version=0,
                      prompts=[Prompt(f"p{i}", token_ids=(5, i + 6)) for i in range(prompts)],
                      sampling=SamplingParams(temperature=0.0, max_tokens=16, n=n),
                      limits=Limits(), model=MODEL, **kw)


def complete(core: SchedulerCore, a: Assign):
    r = a.request
    c = Completion(r.step_id, r.prompt_id, r.sample_index, (1, 2), (0.0, 0.0), "", FinishReason.STOP, 0)
    return core.on_completion(a.worker_id, r.key, c)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def holder(actions, key: str) -> str:
    return next(a.worker_id for a in of(actions, Assign) if a.request.key == key)


def test_a_request_failing_everywhere_fails_its_step_after_max_attempts():
    core, _ = make_core()
    actions = core.submit_step(step("s", 3, n=2))
    poison = "s/p1/0"
    tried = []
    for attempt in range(1, 4):
        wid = holder(actions, poison)
        tried.append(wid)
        actions = core.on_aborted(wid, poison, f"engine error #{attempt}")
        assert not of(actions, Deliver) and not of(actions, StepFinished)
        if attempt < 3:
            assert not of(actions, StepFailed)
            assert holder(actions, poison) != wid, "a failed request goes to another worker first"
    assert len(set(tried)) == 3
    failed = of(actions, StepFailed)
    assert len(failed) == 1
    f = failed[0]
    assert f.step_id == "s" and f.field == "prompts[1]"
    assert "'p1'" in f.message and "sample 0" in f.message and "3 attempts" in f.message
    assert "engine error #3" in f.message and all(w in f.message for w in tried)
    # every other request of the step still running is aborted on its worker
    running = {k for w in core.workers.values() for k in w.running}
    assert not running
    assert {a.key for a in of(actions, Abort)} == {"s/p0/0", "s/p0/1", "s/p1/1", "s/p2/0", "s/p2/1"}
    st = core.steps["s"]
    assert not st.active and st.summary is None and st.failure == f and not st.shared


def test_a_failed_step_stays_failed_and_the_workers_serve_the_next_step():
    core, _ = make_core(max_attempts=1)
    actions = core.submit_step(step("s", 2))
    failed = of(core.on_aborted(holder(actions, "s/p0/0"), "s/p0/0", "boom"), StepFailed)
    assert failed and failed[0].field == "prompts[0]" and "1 attempts" in failed[0].message
    other = holder(actions, "s/p1/0")
    late = complete(core, Assign(other, core.steps["s"].requests["s/p1/0"].spec))
    assert [type(x) for x in late] == [Ignored]  # late answer: ignored
    assert core.check_step(step("s", 2)).failure == failed[0]  # resume: the same failure
    assert core.submit_step(step("s", 2)) == []  # not a re-run
    fresh = of(core.submit_step(step("t", 3)), Assign)
    assert len(fresh) == 3
    finished = [f for a in fresh for f in of(complete(core, a), StepFinished)]
    assert finished and finished[0].summary.completions == 3


def test_a_worker_dying_while_running_counts_queued_work_does_not():
    core, _ = make_core("ab", capacity=1)
    actions = core.submit_step(step("s", 6, policy=SchedulingPolicy.STATIC))
    running = holder(actions, "s/p0/0")
    assert running == "a"
    queued = list(core.workers["a"].private)
    assert queued, "static split: a holds queued work too"
    core.remove_worker("a", "the worker's stream ended while running it")
    reqs = core.steps["s"].requests
    assert [w for w, _ in reqs["s/p0/0"].failures] == ["a"]
    assert "stream ended" in reqs["s/p0/0"].failures[0][1]
    assert all(not reqs[k].failures for k in queued)


def test_repeated_worker_deaths_while_running_fail_the_step():
    core, _ = make_core("a", capacity=1, max_attempts=2)
    actions = core.submit_step(step("s", 2))
    assert holder(actions, "s/p0/0") == "a"
    assert not of(core.remove_worker("a", "died"), StepFailed)
    actions = core.add_worker(WorkerHello("a", 1, 0, MODEL))  # it comes back and gets the request again
    assert holder(actions, "s/p0/0") == "a"
    failed = of(core.remove_worker("a", "died again"), StepFailed)
    assert failed and failed[0].field == "prompts[0]" and "died again" in failed[0].message
    assert not core.steps["s"].active


def test_stalls_count_straggler_moves_do_not():
    core, clock = make_core("ab", capacity=1, stall_seconds=5.0, max_attempts=2)
    actions = core.submit_step(step("s", 4, policy=SchedulingPolicy.STATIC))
    reqs = core.steps["s"].requests
    clock.now = 1.0
    refill = of(complete(core, next(a for a in of(actions, Assign) if a.worker_id == "b")), Assign)
    core.heartbeat("b", 10.0)
    clock.now = 6.5
    core.on_progress("b", refill[0].request.key, 5)  # b goes on; a stalls
    clock.now = 7.0
    core.tick()
    stalled = reqs["s/p0/0"]
    assert [w for w, _ in stalled.failures] == ["a"] and "no progress" in stalled.failures[0][1]
    assert core.steps["s"].moved == 2 and reqs["s/p1/0"].moved_from == "a"  # a's queued p1 moved too
    assert all(not r.failures for k, r in reqs.items() if k != "s/p0/0"), "moved queued work is not an attempt"


def test_stalling_on_every_worker_fails_the_step():
    core, clock = make_core("ab", capacity=1, stall_seconds=5.0, max_attempts=2)
    core.submit_step(step("s", 1))
    for t in (6.0, 12.0, 18.0):
        clock.now = t
        for wid in "ab":
            core.heartbeat(wid, 0.0)
        failed = of(core.tick(), StepFailed)
        if failed:
            break
    assert failed and "no progress for 5s" in failed[0].message
    assert not core.steps["s"].active and not any(w.running for w in core.workers.values())
