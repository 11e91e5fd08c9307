"""Worker events through ``SchedulerCore.handle``: the core alone decides what it takes (request
ownership, vocabulary, policy version, an unasked policy answer, heartbeat values) and reports
moves and re-queues as ``RequestsMoved`` actions; the read-only views it offers the shell."""

from __future__ import annotations

import math

import pytest
from bubblespec.common.types import Completion, FinishReason, SchedulingPolicy
from bubblespec.scheduler.core.events import (
    Aborted, Completed, DraftResult, Heartbeat, PolicyLoaded, Progress, WorkerJoined, WorkerLeft, WorkerSeen,
)
from bubblespec.scheduler.core.types import (
    Assign, Deliver, ErrorCode, Ignored, InvalidRequest, PolicyLoadReported, PolicyReady, RequestsMoved, StepFinished,
    WorkerStatus,
)
from tests.unit.test_core import LIMITS, hello, make_core, of, step


def _completion(a: Assign, tokens: tuple[int, ...] = (1, 2, 3), version: int | None = None, worker: str = "") -> Completion:
    r = a.request
    return Completion(r.step_id, r.prompt_id, r.sample_index, tokens, (0.0,) * len(tokens), "", FinishReason.STOP,
                      r.policy_version if version is None else version, worker)


def test_a_completion_outside_the_vocabulary_is_refused_by_the_core_and_changes_nothing():
    core, _ = make_core()
    core.handle(WorkerJoined(hello("a")))
    [a] = of(core.submit_step(step("s", 1)), Assign)
    bad = _completion(a, tokens=(1, LIMITS.vocab_size))
    with pytest.raises(InvalidRequest) as err:
        core.handle(Completed("a", a.request.key, bad))
    assert err.value.field == "completion.completion.token_ids" and err.value.code == ErrorCode.INVALID_ARGUMENT
    assert core.step("s").completed == 0 and core.stats().requests_running == 1  # still runs on a
    delivered = of(core.handle(Completed("a", a.request.key, _completion(a))), Deliver)
    assert len(delivered) == 1


def test_a_completion_naming_another_request_is_refused():
    core, _ = make_core()
    core.handle(WorkerJoined(hello("a")))
    first, second = of(core.submit_step(step("s", 2)), Assign)
    with pytest.raises(InvalidRequest, match="not for its request_key"):
        core.handle(Completed("a", first.request.key, _completion(second)))
    assert core.step("s").completed == 0


def test_the_core_stamps_the_sender_on_a_completion():
    core, _ = make_core()
    core.handle(WorkerJoined(hello("a")))
    [a] = of(core.submit_step(step("s", 1)), Assign)
    [d] = of(core.handle(Completed("a", a.request.key, _completion(a, worker="someone-else"))), Deliver)
    assert d.completion.worker_id == "a"


def test_a_completion_of_another_policy_version_is_a_failed_attempt_and_runs_again():
    core, _ = make_core()
    core.handle(WorkerJoined(hello("a", capacity=1)))
    core.handle(WorkerJoined(hello("b", capacity=1)))
    first, _ = of(core.submit_step(step("s", 2)), Assign)
    actions = core.handle(Completed(first.worker_id, first.request.key, _completion(first, version=7)))
    [ignored] = of(actions, Ignored)
    assert ignored.field == "completion.policy_version" and "asked for 0" in ignored.reason
    assert of(actions, RequestsMoved) == [RequestsMoved("s", (first.request.key,), requeued=True)]
    assert not of(actions, Deliver) and core.step("s").requeued == 1


def test_events_about_requests_the_worker_does_not_run_are_ignored():
    core, _ = make_core()
    core.handle(WorkerJoined(hello("a")))
    core.handle(WorkerJoined(hello("b")))
    [a] = of(core.submit_step(step("s", 1)), Assign)
    other = "b" if a.worker_id == "a" else "a"
    for event in (Progress(other, a.request.key, 3), Completed(other, a.request.key, _completion(a)),
                  Aborted(other, a.request.key, "boom")):
        [ignored] = core.handle(event)
        assert isinstance(ignored, Ignored) and ignored.field.endswith(".request_key")
    assert core.step("s").completed == 0 and core.step("s").requeued == 0


def test_an_unasked_policy_answer_changes_nothing_and_an_asked_one_is_reported():
    core, _ = make_core()
    core.handle(WorkerJoined(hello("a")))
    [ignored] = core.handle(PolicyLoaded("a", 3, True, seconds=1.0))
    assert ignored == Ignored("a", "policy_loaded.version", "3 was not asked of it")
    assert core.policy_version == 0 and core.worker("a").policy_version == 0
    core.update_policy(1, "/w1")
    actions = core.handle(PolicyLoaded("a", 1, True, seconds=2.5))
    assert actions[0] == PolicyLoadReported("a", 1, True, "", 2.5)
    assert PolicyReady(1, 1) in actions and core.policy_version == 1 and core.policy_weights_path == "/w1"


@pytest.mark.parametrize("tps", [-1.0, math.inf, math.nan])
def test_a_bad_heartbeat_is_refused_naming_the_field(tps):
    core, clock = make_core()
    core.handle(WorkerJoined(hello("a")))
    clock.now = 3.0
    with pytest.raises(InvalidRequest) as err:
        core.handle(Heartbeat("a", tps))
    assert err.value.field == "heartbeat.tokens_per_second"
    assert core.worker("a").tokens_per_second == 0.0


def test_any_event_but_a_heartbeat_proves_the_worker_alive():
    core, clock = make_core(worker_timeout_seconds=10)
    core.handle(WorkerJoined(hello("a")))
    clock.now = 8.0
    assert core.handle(WorkerSeen("a")) == []
    assert core.handle(DraftResult("a", "no-such-job", 0)) == []
    clock.now = 15.0
    assert core.tick() == [] and core.worker_count == 1  # last seen at 8
    assert core.handle(WorkerLeft("a")) == [] and core.worker_count == 0


def test_straggler_moves_come_out_as_one_action_per_intervention():
    core, clock = make_core(straggler_grace_seconds=2.0)
    core.add_worker(hello("a", capacity=4))
    core.add_worker(hello("b", capacity=2))
    of(core.submit_step(step("s", 8, policy=SchedulingPolicy.STATIC)), Assign)
    core.heartbeat("a", 100.0)
    core.heartbeat("b", 10.0)  # a straggler
    clock.now = 3.0
    [moved] = of(core.tick(), RequestsMoved)
    assert not moved.requeued and len(moved.keys) == 2 == core.step("s").moved


def test_a_lost_worker_requeues_its_work_as_actions():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=2))
    core.add_worker(hello("b", capacity=2))
    assigns = of(core.submit_step(step("s", 4)), Assign)
    held = sorted(x.request.key for x in assigns if x.worker_id == "a")
    moved = of(core.handle(WorkerLeft("a", "gone")), RequestsMoved)
    assert sorted(k for m in moved for k in m.keys) == held and all(m.requeued for m in moved)
    assert core.step("s").requeued == len(held)


def test_the_views_are_frozen_snapshots():
    core, clock = make_core()
    core.add_worker(hello("a", capacity=2))
    [first, _] = of(core.submit_step(step("s", 3)), Assign)
    clock.now = 2.0
    core.handle(Progress("a", first.request.key, 5))
    stats = core.stats()
    assert (stats.requests_running, stats.requests_waiting, stats.policy_version, stats.paused) == (2, 1, 0, False)
    [w] = stats.workers
    assert w.state is WorkerStatus.BUSY and w.busy_seconds == 2.0 and w.running == 2
    [s] = stats.active_steps
    assert (s.step_id, s.requests, s.pending, s.last_progress_at) == ("s", 3, 3, 2.0)
    of(core.handle(Completed("a", first.request.key, _completion(first))), Deliver)
    assert s.pending == 3 and core.step("s").pending == 2  # the old view did not change
    with pytest.raises(AttributeError):
        s.pending = 0  # type: ignore[misc]
    assert of(core.cancel_step("s"), StepFinished)
    assert core.step("s", completions=True).completions[0].prompt_id == first.request.prompt_id
