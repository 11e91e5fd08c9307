"""Weight updates that never finish (``core/transfer.py``) and sleep (``core/sleep.py``), pure,
with the core's fake clock.

Before: a trainer that died between ``start`` and ``finish`` left the policy barrier open for
good (dispatch stopped, every later update refused as "already in progress"); nothing could end
it but a scheduler restart. Sleep did not exist.
"""

from __future__ import annotations

import pytest

from bubblespec.scheduler.core.sleep import EngineSleep, check_tags
from bubblespec.scheduler.core.transfer import WeightTransfer
from bubblespec.scheduler.core.types import Assign, InvalidRequest, PolicyFailed, PolicyReady, StopDraft
from tests.unit.test_core import complete, hello, make_core, of, step

INIT = {"master_address": "10.0.0.7", "master_port": 29551, "rank_offset": 1, "world_size": 3}


def group(deadline: float = 600.0):
    core, clock = make_core()
    core.add_worker(hello("a"))
    core.add_worker(hello("b"))
    transfer = WeightTransfer(core, deadline_seconds=deadline)
    transfer.commit_init(transfer.plan_init(INIT))
    return core, clock, transfer


def test_an_update_not_finished_by_its_deadline_is_rolled_back_and_the_version_stays():
    core, clock, transfer = group(deadline=30)
    version, _ = transfer.start()
    transfer.started({"a": None, "b": None})
    assert version == 1 and core.pauser.waiting() == [] and transfer.overdue() is None
    clock.now = 29.9
    assert transfer.expire() == [] and transfer.updating == 1  # not yet
    clock.now = 30.0
    actions = transfer.expire()
    failed = of(actions, PolicyFailed)
    assert len(failed) == 1 and failed[0].version == 1, actions
    assert "not finished within 30s" in failed[0].message and "stays at version 0" in failed[0].message
    assert transfer.updating is None and core.version == 0 and core.policy_loading is None
    # both members took start: their engines hold the update open until the shell closes it
    assert transfer.unclosed == {"a", "b"}
    # their weights may be partly replaced: neither serves until an update succeeds
    assert {w.version for w in core.workers.values()} == {-1}
    with pytest.raises(InvalidRequest, match="no connected worker holds policy version 0"):
        core.submit_step(step("s", 2))
    # a late finish is refused, saying why
    with pytest.raises(InvalidRequest, match="not finished within 30s"):
        transfer.check_updating("finish")
    assert transfer.expire() == []  # once


def test_after_a_rollback_a_new_update_succeeds_and_requests_run_again():
    core, clock, transfer = group(deadline=5)
    transfer.start()
    clock.now = 6
    transfer.expire()
    transfer.unclosed.clear()  # the shell closed it on both workers
    version, _ = transfer.start()
    assert version == 1 and transfer.rolled_back == "" and transfer.started_at == 6
    ready = of(transfer.finish("v1", {"a": None, "b": None}), PolicyReady)
    assert ready and core.version == 1 and core.policy_weights_path == "weight-transfer:v1"
    assigns = of(core.submit_step(step("s", 2, version=1)), Assign)
    assert {a.worker_id for a in assigns} == {"a", "b"}
    for a in assigns:
        complete(core, a)


def test_abort_ends_the_update_at_once_with_its_reason():
    core, clock, transfer = group()
    transfer.start()
    transfer.started({"a": None, "b": "start failed"})  # only a holds it open
    failed = of(transfer.abort({}, "aborted by POST /abort_weight_update"), PolicyFailed)
    assert failed and "aborted by POST /abort_weight_update" in failed[0].message
    assert transfer.unclosed == {"a"} and transfer.updating is None and core.version == 0
    assert transfer.abort({}, "again") == []  # nothing in progress: nothing to do


def test_a_finished_update_leaves_only_failed_members_open():
    core, clock, transfer = group()
    transfer.start()
    transfer.started({"a": None, "b": None})
    transfer.finish("", {"a": None, "b": "finish_weight_update failed"})
    assert transfer.unclosed == {"b"} and core.version == 0


def test_the_deadline_must_be_positive():
    core, _ = make_core()
    with pytest.raises(ValueError, match="weight_update_deadline_seconds"):
        WeightTransfer(core, deadline_seconds=0)


def test_asleep_workers_get_no_work_and_no_drafts_and_level_2_forgets_their_weights():
    core, clock = make_core()
    core.add_worker(hello("a"))
    complete(core, of(core.submit_step(step("s0", 1, lookahead=[(7, 8, 9), (7, 8, 10)])), Assign)[0])
    assert len(core.workers["a"].drafts) == 2  # an idle worker drafts the announced prompts
    sleep = EngineSleep(core)
    actions = sleep.sleep(1)
    assert sleep.asleep and all(w.asleep for w in core.workers.values())
    assert len(of(actions, StopDraft)) == 2 and core.drafts.drafter(core.workers["a"]) is False
    assert core.workers["a"].version == 0  # level 1 keeps the weights
    assert of(core.submit_step(step("s", 2)), Assign) == []  # asleep: nothing dispatched
    sleep.sleep(2)
    assert sleep.level == 2 and core.workers["a"].version == -1  # discarded
    sleep.wake()
    assert not sleep.asleep and not core.workers["a"].asleep
    assert core.workers["a"].version == -1  # still nothing to serve until an update succeeds


def test_a_level_1_sleep_then_wake_serves_the_held_work():
    core, clock = make_core()
    core.add_worker(hello("a"))
    sleep = EngineSleep(core)
    sleep.sleep(1)
    assert of(core.submit_step(step("s", 2)), Assign) == []
    assigns = of(sleep.wake(), Assign)
    assert len(assigns) == 2 and {a.worker_id for a in assigns} == {"a"}


def test_sleep_is_refused_while_an_update_loads_and_bad_levels_and_tags_are_named():
    core, clock, transfer = group()
    sleep = EngineSleep(core)
    with pytest.raises(InvalidRequest, match="level"):
        sleep.check_can_sleep(3, None)
    transfer.start()
    with pytest.raises(InvalidRequest, match="policy version 1 is in progress"):
        sleep.check_can_sleep(1, transfer.updating)
    with pytest.raises(InvalidRequest, match="tags"):
        check_tags(["weights", "gpu"])
    assert check_tags([]) is None and check_tags(["kv_cache"]) == ["kv_cache"]


def test_the_deadline_is_a_scheduler_flag_with_its_environment_variable(monkeypatch):
    from bubblespec.cli.commands import _scheduler_settings
    from bubblespec.cli.main import build_parser

    monkeypatch.setenv("BUBBLESPEC_WEIGHT_UPDATE_DEADLINE_SECONDS", "45")
    a = build_parser().parse_args(["scheduler"])
    assert _scheduler_settings(a).weight_update_deadline_seconds == 45.0
    a = build_parser().parse_args(["scheduler", "--weight-update-deadline-seconds", "7.5"])
    assert _scheduler_settings(a).weight_update_deadline_seconds == 7.5
    monkeypatch.delenv("BUBBLESPEC_WEIGHT_UPDATE_DEADLINE_SECONDS")
    assert _scheduler_settings(build_parser().parse_args(["scheduler"])).weight_update_deadline_seconds == 600.0
    with pytest.raises(SystemExit, match="weight_update_deadline_seconds"):
        _scheduler_settings(build_parser().parse_args(["scheduler", "--weight-update-deadline-seconds", "0"]))
