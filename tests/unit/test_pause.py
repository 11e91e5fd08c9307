"""Pause and resume in the scheduling core (``core/pause.py``), with a fake clock: the three
modes, re-queueing without loss or duplication, a policy update while steps are kept, and the
refusal of new steps."""

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
    WorkerHello,
)
from bubblespec.scheduler.core.validate import Limits, build_step

LIMITS = ModelLimits(max_model_len=256, vocab_size=100)


def make_core() -> SchedulerCore:
    core = SchedulerCore(CoreSettings(), lambda: 0.0)
    for wid in ("a", "b"):
        core.add_worker(WorkerHello(wid, 2, 0, LIMITS, True))
    return core


def step(step_id: str, prompts: int, version: int = 0, lookahead=(), policy=SchedulingPolicy.QUEUE):
    return build_step(step_id=step_id, policy_version=version,
                      prompts=[Prompt(f"p{i}", token_ids=(5, i + 6)) for i in range(prompts)],
                      sampling=SamplingParams(temperature=0.0, max_tokens=16),
                      lookahead=[Prompt(f"l{i}", token_ids=t) for i, t in enumerate(lookahead)],
                      policy=policy, limits=Limits(), model=LIMITS)


def complete(core: SchedulerCore, a: Assign, version: int | None = None):
    r = a.request
    c = Completion(r.step_id, r.prompt_id, r.sample_index, (1, 2, 3), (0.0,) * 3, "", FinishReason.STOP,
                   r.policy_version if version is None else version)
    return core.on_completion(a.worker_id, r.key, c)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def run_all(core: SchedulerCore, assigns: list[Assign]) -> list:
    """Complete every assignment, and every one that follows, until no work is left."""
    actions: list = []
    pending = list(assigns)
    while pending:
        out = complete(core, pending.pop(0))
        actions += out
        pending += of(out, Assign)
    return actions


def test_a_new_step_is_refused_while_paused_and_a_known_one_resumes():
    core = make_core()
    core.submit_step(step("s", 2))
    core.pauser.pause("wait")
    with pytest.raises(InvalidRequest) as exc:
        core.check_step(step("t", 1))
    assert (exc.value.field, exc.value.code) == ("step_id", "UNAVAILABLE")
    assert "paused" in str(exc.value) and "t" not in core.steps
    assert core.check_step(step("s", 2)).step_id == "s"  # a retry of a known step is not new
    core.pauser.resume()
    assert of(core.submit_step(step("t", 1)), Assign)


def test_abort_cancels_the_active_steps_and_their_running_requests():
    core = make_core()
    assigns = of(core.submit_step(step("s", 6)), Assign)
    actions = core.pauser.pause("abort")
    assert {(a.worker_id, a.key) for a in of(actions, Abort)} == {(a.worker_id, a.request.key) for a in assigns}
    assert [f.step_id for f in of(actions, StepFinished)] == ["s"]
    assert core.steps["s"].cancelled and not core.steps["s"].active
    assert not any(w.running for w in core.workers.values())


def test_wait_lets_the_active_steps_run_to_their_end():
    core = make_core()
    assigns = of(core.submit_step(step("s", 6)), Assign)
    assert core.pauser.pause("wait") == []
    assert core.pauser.waiting() == ["s"]
    actions = run_all(core, assigns)  # the queued requests of an active step are still dispatched
    assert len(of(actions, Deliver)) == 6 and of(actions, StepFinished)
    assert core.pauser.waiting() == [] and core.pauser.paused


def test_keep_requeues_running_requests_and_loses_or_duplicates_none():
    core = make_core()
    assigns = of(core.submit_step(step("s", 6, lookahead=[(40, 41)])), Assign)
    assert len(assigns) == 4  # 2 workers x capacity 2; 2 queued
    first = complete(core, assigns[0])
    delivered = of(first, Deliver)  # delivered before the pause
    running = assigns[1:] + of(first, Assign)  # the worker took the next queued request
    actions = core.pauser.pause("keep")
    assert {(a.worker_id, a.key) for a in of(actions, Abort)} == {(a.worker_id, a.request.key) for a in running}
    assert not of(actions, Assign) and of(actions, StartDraft)  # nothing dispatched; the idle workers draft
    assert all(not r.failures for r in core.steps["s"].requests.values())  # a held request is no failed attempt
    for a in running:  # a completion the worker sent before the abort reached it is ignored
        assert [type(x) for x in complete(core, a)] == [Ignored]
    assert not of(core.pauser.pause("keep") + core.tick(), Assign)  # idempotent; nothing dispatched
    again = of(core.pauser.resume(), Assign)
    assert len(again) == 4
    delivered += of(run_all(core, again), Deliver)
    keys = [(d.completion.prompt_id, d.completion.sample_index) for d in delivered]
    assert sorted(keys) == [(f"p{i}", 0) for i in range(6)]  # every request once
    assert not core.steps["s"].active and core.steps["s"].summary.completions == 6


def test_a_policy_update_while_kept_reruns_the_undelivered_requests_at_the_new_version():
    core = make_core()
    assigns = of(core.submit_step(step("s", 4)), Assign)
    before = of(complete(core, assigns[0]), Deliver)
    assert [d.completion.policy_version for d in before] == [0]
    running = assigns[1:]
    core.pauser.pause("keep")
    loads = of(core.update_policy(1, "/ckpt/v1"), LoadPolicy)
    assert {x.worker_id for x in loads} == {"a", "b"}
    ready = core.on_policy_loaded("a", 1, True) + core.on_policy_loaded("b", 1, True)
    assert of(ready, PolicyReady) and not of(ready, Assign)  # still paused
    assert core.steps["s"].spec.policy_version == 1
    for a in running:  # old-version work from before the pause is never delivered
        assert [type(x) for x in complete(core, a)] == [Ignored]
    again = of(core.pauser.resume(), Assign)
    assert len(again) == 3 and all(a.request.policy_version == 1 for a in again)
    after = of(run_all(core, again), Deliver)
    assert [d.completion.policy_version for d in after] == [1, 1, 1]
    step_state = core.steps["s"]
    versions = sorted((c.prompt_id, c.policy_version) for c in step_state.completions.values())
    assert versions == [("p0", 0), ("p1", 1), ("p2", 1), ("p3", 1)]
    assert step_state.summary.policy_version == 1


def test_a_policy_update_is_refused_while_an_active_step_is_not_held():
    core = make_core()
    core.submit_step(step("s", 2))
    for mode in (None, "wait"):
        if mode:
            core.pauser.pause(mode)
        with pytest.raises(InvalidRequest) as exc:
            core.update_policy(1, "/ckpt/v1")
        assert exc.value.code == "FAILED_PRECONDITION" and "'s' is still running" in str(exc.value)
        assert core.version == 0 and all(w.loading is None for w in core.workers.values())


def test_a_failed_update_while_kept_leaves_the_held_steps_at_their_version():
    core = make_core()
    core.submit_step(step("s", 4))
    core.pauser.pause("keep")
    core.update_policy(1, "/ckpt/bad")
    core.on_policy_loaded("a", 1, False, "bad checkpoint")
    core.on_policy_loaded("b", 1, False, "bad checkpoint")
    assert core.version == 0 and core.steps["s"].spec.policy_version == 0
    again = of(core.pauser.resume(), Assign)
    assert len(again) == 4 and all(a.request.policy_version == 0 for a in again)
    assert len(of(run_all(core, again), Deliver)) == 4


def test_keep_takes_back_a_static_steps_private_queues():
    core = make_core()
    assigns = of(core.submit_step(step("s", 8, policy=SchedulingPolicy.STATIC)), Assign)
    assert len(assigns) == 4 and any(w.private for w in core.workers.values())
    core.pauser.pause("keep")
    assert not any(w.private or w.running for w in core.workers.values())
    assert len(core.steps["s"].shared) == 8
    again = of(core.pauser.resume(), Assign)
    assert len(of(run_all(core, again), Deliver)) == 8


def test_abort_after_keep_cancels_the_held_steps_too():
    core = make_core()
    core.submit_step(step("s", 4))
    core.pauser.pause("keep")
    actions = core.pauser.pause("abort")
    assert of(actions, StepFinished) and core.steps["s"].cancelled
    assert core.pauser.held == set() and core.pauser.mode == "abort"


def test_pause_and_resume_are_idempotent_and_a_bad_mode_changes_nothing():
    core = make_core()
    assert core.pauser.resume() == [] and not core.pauser.paused  # resume when not paused
    with pytest.raises(InvalidRequest) as exc:
        core.pauser.pause("freeze")
    assert exc.value.field == "mode" and "abort, wait, keep" in str(exc.value)
    assert not core.pauser.paused
    core.pauser.pause("keep")
    core.pauser.pause("keep")
    assert core.pauser.paused and core.status()["paused"] == "keep"
    core.pauser.resume()
    core.pauser.resume()
    assert not core.pauser.paused and core.status()["paused"] is None
