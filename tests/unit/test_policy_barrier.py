"""The policy-update barrier with a fake clock: a failed update fails loudly and changes nothing.

Core: ``update_policy`` / ``on_policy_loaded`` (``core/policy.py``). Service: the outcome as an
``UpdatePolicy`` answer (error naming every failed worker), the journal, and completions whose
policy version differs from their request's.
"""

from __future__ import annotations

import asyncio

import pytest
from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.types import Completion, FinishReason
from bubblespec.scheduler.core.types import (
    Assign,
    Deliver,
    InvalidRequest,
    LoadPolicy,
    PolicyFailed,
    PolicyLoadReported,
    PolicyReady,
    StartDraft,
    StepFinished,
)
from bubblespec.scheduler.service import SchedulerService
from bubblespec.scheduler.wire import feed

from tests.unit.test_core import complete, hello, make_core, of, step


def two_workers():
    core, clock = make_core()
    core.add_worker(hello("a"))
    core.add_worker(hello("b"))
    return core, clock


def test_update_where_every_load_fails_names_each_worker_and_keeps_the_old_version():
    core, _ = two_workers()
    assert {x.worker_id for x in of(core.update_policy(1, "/no/such/dir"), LoadPolicy)} == {"a", "b"}
    assert core.version == 0  # the cluster's version moves only when every worker loaded it
    first = core.on_policy_loaded("a", 1, False, "weights_path '/no/such/dir' is not a directory")
    assert [type(x) for x in first] == [PolicyLoadReported]
    failed = of(core.on_policy_loaded("b", 1, False, "weights_path '/no/such/dir' is not a directory"), PolicyFailed)
    assert len(failed) == 1 and of(core.on_policy_loaded("b", 1, False, "again"), PolicyReady) == []
    f = failed[0]
    assert (f.version, f.code, f.field) == (1, "FAILED_PRECONDITION", "weights_path")
    assert "worker a: weights_path '/no/such/dir'" in f.message and "worker b: " in f.message
    assert "2 of 2" in f.message and "stays at version 0" in f.message
    assert (core.version, core.weights_path) == (0, "")
    # the old version still serves, on both workers
    assigns = of(core.submit_step(step("s", 4, version=0)), Assign)
    assert {a.worker_id for a in assigns} == {"a", "b"}
    for a in assigns:
        complete(core, a)
    # the same version again, with a good path: a fresh update, not "must be greater"
    assert {x.worker_id for x in of(core.update_policy(1, "/good"), LoadPolicy)} == {"a", "b"}
    core.on_policy_loaded("a", 1, True)
    assert of(core.on_policy_loaded("b", 1, True), PolicyReady) == [PolicyReady(1, 2)]
    assert (core.version, core.weights_path) == (1, "/good")


def test_partly_loaded_update_fails_and_the_loaded_workers_get_no_work_until_the_next_update():
    core, _ = two_workers()
    core.update_policy(1, "/half")
    core.on_policy_loaded("a", 1, True)
    failed = of(core.on_policy_loaded("b", 1, False, "tensor 'lm_head.weight' is missing"), PolicyFailed)
    assert failed and "1 of 2" in failed[0].message and "worker b: tensor 'lm_head.weight'" in failed[0].message
    assert "worker a" not in failed[0].message
    assert core.version == 0 and core.workers["a"].version == 1 and core.workers["b"].version == 0
    # a holds weights of a version the cluster does not run: neither requests nor draft jobs for it
    actions = core.submit_step(step("s", 6, version=0, lookahead=[(7, 8)]))
    assert {a.worker_id for a in of(actions, Assign)} == {"b"}
    while (assigns := [a for a in of(actions, Assign)]):
        actions = [x for a in assigns for x in complete(core, a)]
        assert all(x.worker_id == "b" for x in of(actions, Assign) + of(actions, StartDraft))
    assert core.steps["s"].summary is not None and core.steps["s"].summary.completions == 6
    # the next update reloads every worker, and only then is the version the cluster's
    assert {x.worker_id for x in of(core.update_policy(1, "/whole"), LoadPolicy)} == {"a", "b"}
    core.on_policy_loaded("a", 1, True)
    ready = core.on_policy_loaded("b", 1, True)
    assert of(ready, PolicyReady) == [PolicyReady(1, 2)]
    assert {a.worker_id for a in of(core.submit_step(step("t", 6, version=1)), Assign)} == {"a", "b"}


def test_a_load_that_left_weights_unknown_keeps_that_worker_out_of_every_version():
    core, _ = two_workers()
    core.update_policy(1, "/w1")
    core.on_policy_loaded("a", 1, False, "reload failed half way", weights_unknown=True)
    assert of(core.on_policy_loaded("b", 1, False, "tensor 'x' is missing"), PolicyFailed)
    assert core.workers["a"].version == -1
    assert {a.worker_id for a in of(core.submit_step(step("s", 4, version=0)), Assign)} == {"b"}


def test_step_at_a_version_no_worker_holds_is_refused_instead_of_waiting_forever():
    core, _ = two_workers()
    core.update_policy(1, "/half")
    core.on_policy_loaded("a", 1, True)
    core.on_policy_loaded("b", 1, False, "reload failed half way", weights_unknown=True)
    assert core.version == 0 and core.workers["a"].version == 1 and core.workers["b"].version == -1
    with pytest.raises(InvalidRequest) as err:
        core.submit_step(step("s", 4, version=0))
    assert err.value.field == "policy_version" and err.value.code == "FAILED_PRECONDITION"
    assert "no connected worker holds policy version 0" in str(err.value) and "s" not in core.steps
    core.update_policy(1, "/whole")  # the remedy the error names
    core.on_policy_loaded("a", 1, True)
    assert of(core.on_policy_loaded("b", 1, True), PolicyReady) == [PolicyReady(1, 2)]
    assert {a.worker_id for a in of(core.submit_step(step("t", 4, version=1)), Assign)} == {"a", "b"}


def test_update_with_no_live_worker_fails_unavailable_and_changes_nothing():
    core, _ = make_core()
    with pytest.raises(InvalidRequest) as err:
        core.update_policy(1, "/w1")
    assert (err.value.code, err.value.field) == ("UNAVAILABLE", "workers")
    assert (core.version, core.weights_path, core.policy_loading) == (0, "", None)
    core, _ = two_workers()
    core.update_policy(1, "/w1")
    core.remove_worker("a")
    failed = of(core.remove_worker("b"), PolicyFailed)
    assert [(f.code, f.field) for f in failed] == [("UNAVAILABLE", "workers")]
    assert core.version == 0


def test_a_failed_worker_that_leaves_does_not_fail_the_update_of_the_others():
    core, _ = two_workers()
    core.update_policy(1, "/w1")
    core.on_policy_loaded("a", 1, False, "engine died")
    core.remove_worker("a")  # its engine died: it left before the barrier ended
    assert of(core.on_policy_loaded("b", 1, True), PolicyReady) == [PolicyReady(1, 1)]


def test_same_update_joins_or_repeats_and_a_conflicting_one_names_the_field():
    core, _ = two_workers()
    core.update_policy(1, "/w1")
    assert core.update_policy(1, "/w1") == []  # a retry while loading joins: no second load
    with pytest.raises(InvalidRequest) as err:
        core.update_policy(1, "/other")
    assert (err.value.field, err.value.code) == ("weights_path", "ALREADY_EXISTS")
    with pytest.raises(InvalidRequest) as err:
        core.update_policy(2, "/w2")
    assert (err.value.field, err.value.code) == ("version", "FAILED_PRECONDITION")
    core.on_policy_loaded("a", 1, True)
    assert of(core.on_policy_loaded("b", 1, True), PolicyReady) == [PolicyReady(1, 2)]
    assert core.update_policy(1, "/w1") == [PolicyReady(1, 2)]  # done: the same answer, nothing reloaded
    with pytest.raises(InvalidRequest) as err:
        core.update_policy(1, "/other")
    assert (err.value.field, err.value.code) == ("weights_path", "ALREADY_EXISTS")
    with pytest.raises(InvalidRequest) as err:
        core.update_policy(0, "/w0")
    assert (err.value.field, err.value.code) == ("version", "FAILED_PRECONDITION")
    assert (core.version, core.weights_path) == (1, "/w1")


def test_worker_joining_during_an_update_loads_it_and_the_barrier_waits_for_it():
    core, _ = two_workers()
    core.update_policy(1, "/w1")
    assert of(core.add_worker(hello("c")), LoadPolicy) == [LoadPolicy("c", 1, "/w1")]
    core.on_policy_loaded("a", 1, True)
    assert [type(x) for x in core.on_policy_loaded("b", 1, True)] == [PolicyLoadReported]  # c has not answered yet
    failed = of(core.on_policy_loaded("c", 1, False, "tensor 'x' is missing"), PolicyFailed)
    assert failed and "worker c: tensor 'x'" in failed[0].message and core.version == 0


def test_no_new_step_while_an_update_loads():
    core, _ = two_workers()
    core.update_policy(1, "/w1")
    for version in (0, 1):
        with pytest.raises(InvalidRequest) as err:
            core.submit_step(step(f"s{version}", 2, version=version))
        assert err.value.field == "policy_version" and "still loading" in str(err.value)
    assert core.steps == {}


def test_the_next_version_is_numbered_by_the_core_and_refusals_name_the_callers_field():
    core, _ = two_workers()
    assert {x.version for x in of(core.update_policy(None, "/w1", "request"), LoadPolicy)} == {1}
    assert core.policy_loading == 1 and core.update_policy(None, "/w1", "request") == []  # a retry joins
    with pytest.raises(InvalidRequest) as err:  # weight transfer never joins an update it did not open
        core.update_policy(1, "weight-transfer:1", "weight_version", pushed_to=["a", "b"])
    assert (err.value.field, err.value.code) == ("weight_version", "FAILED_PRECONDITION")
    core.on_policy_loaded("a", 1, True)
    assert of(core.on_policy_loaded("b", 1, True), PolicyReady) == [PolicyReady(1, 2)]
    core.submit_step(step("s", 2, version=1))
    with pytest.raises(InvalidRequest) as err:
        core.update_policy(None, "/w2", "request")
    assert err.value.field == "request" and "step 's' is still running; pause first" in err.value.message
    assert (core.version, core.policy_loading) == (1, None)


def test_a_pushed_update_loads_nothing_and_waits_for_its_members_alone():
    core, _ = two_workers()
    actions = core.update_policy(1, "weight-transfer:1", "weight_version", pushed_to=["a"])
    assert of(actions, LoadPolicy) == [] and core.policy_loading == 1
    assert of(core.on_policy_loaded("a", 1, True), PolicyReady) == [PolicyReady(1, 1)]
    assert core.version == 1


# ----------------------------------------------------------------- service --


class Journal:
    def __init__(self) -> None:
        self.policies: list[tuple[int, str]] = []

        self.flushed: list[tuple[int, str]] = []  # what was saved when UpdatePolicy answered

    def save_policy(self, version: int, weights_path: str) -> None:
        self.policies.append((version, weights_path))

    async def flush(self) -> None:
        self.flushed = list(self.policies)


def loaded(service: SchedulerService, worker: str, version: int, ok: bool, error: str = "") -> None:
    feed(service, worker, pb.WorkerMessage(policy_loaded=pb.PolicyLoaded(version=version, ok=ok, error=error)))


async def test_service_answers_a_failed_update_with_each_reason_and_journals_nothing():
    core, _ = two_workers()
    journal = Journal()
    service = SchedulerService(core, journal=journal)
    first = asyncio.create_task(service.update_policy(1, "/no/such/dir"))
    await asyncio.sleep(0)
    second = asyncio.create_task(service.update_policy(1, "/no/such/dir"))  # an SDK retry joins it
    await asyncio.sleep(0)
    loaded(service, "a", 1, False, "weights_path '/no/such/dir' is not a directory")
    loaded(service, "b", 1, False, "weights_path '/no/such/dir' is not a directory")
    for task in (first, second):
        with pytest.raises(InvalidRequest) as err:
            await task
        assert err.value.code == "FAILED_PRECONDITION" and err.value.field == "weights_path"
        assert "worker a: weights_path '/no/such/dir' is not a directory" in str(err.value)
        assert "worker b: " in str(err.value)
    assert journal.policies == [] and core.version == 0 and service.barriers == []
    retry = asyncio.create_task(service.update_policy(1, "/good"))
    await asyncio.sleep(0)
    loaded(service, "a", 1, True)
    loaded(service, "b", 1, True)
    assert await retry == PolicyReady(1, 2)
    assert journal.flushed == journal.policies == [(1, "/good")]  # answered once the version was written
    assert await service.update_policy(1, "/good") == PolicyReady(1, 2)  # done: the same answer
    assert journal.policies[0] == (1, "/good")


async def test_service_refuses_a_completion_from_another_policy_version_and_runs_it_again(caplog):
    core, _ = two_workers()
    service = SchedulerService(core)
    delivered = []
    service.listeners.append(lambda a: delivered.append(a) if isinstance(a, (Deliver, StepFinished)) else None)
    assigns = of(core.submit_step(step("s", 1, version=0)), Assign)
    r = assigns[0].request
    wrong = Completion(r.step_id, r.prompt_id, r.sample_index, (1, 2), (0.0, 0.0), "", FinishReason.STOP, 7)
    msg = pb.WorkerCompletion(request_key=r.key, completion=cv.completion_to_pb(wrong))
    feed(service, assigns[0].worker_id, pb.WorkerMessage(completion=msg))
    assert delivered == [] and not core.steps["s"].requests[r.key].done
    assert any("from policy version 7, the request asked for 0" in m for m in caplog.messages)
    again = core.steps["s"].requests[r.key].worker
    assert again is not None  # given out again (to a worker of version 0)
    right = Completion(r.step_id, r.prompt_id, r.sample_index, (1, 2), (0.0, 0.0), "", FinishReason.STOP, 0)
    msg = pb.WorkerCompletion(request_key=r.key, completion=cv.completion_to_pb(right))
    feed(service, again, pb.WorkerMessage(completion=msg))
    assert [type(a) for a in delivered] == [Deliver, StepFinished]
