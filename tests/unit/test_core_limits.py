"""Per-scheduler caps on trainer-held state: active steps and announced prompts.

Both are refused with RESOURCE_EXHAUSTED naming the field, and a refusal changes nothing.
"""

from __future__ import annotations

import pytest

from bubblespec.common.types import SamplingParams
from bubblespec.scheduler.core.types import Assign, InvalidRequest
from tests.unit.test_core import complete, hello, make_core, of, step

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def state(core) -> tuple:
    return (tuple(core.steps), tuple(sorted(core.planner.upcoming)), core.drafts.wanted,
            tuple((w.hello.worker_id, tuple(sorted(w.running)), tuple(w.private)) for w in core.workers.values()))


def refused(call, field: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        call()
    assert err.value.code == "RESOURCE_EXHAUSTED" and err.value.field == field
    assert str(err.value).startswith(f"{field}: ")
    return err.value


def test_new_step_beyond_max_active_steps_is_refused_and_changes_nothing():
    core, _ = make_core(max_active_steps=2)
    core.add_worker(hello("a", capacity=1))
    first = of(core.submit_step(step("s1", 1)), Assign)
    core.submit_step(step("s2", 1))
    before = state(core)
    err = refused(lambda: core.submit_step(step("s3", 1)), "step_id")
    assert "already runs 2 steps" in str(err) and "max_active_steps" in str(err)
    refused(lambda: core.check_step(step("s3", 1)), "step_id")
    assert state(core) == before
    assert core.submit_step(step("s1", 1)) == []  # resuming a running step is not a new one
    complete(core, first[0])  # s1 finishes: room for one more
    assert "s1" in core.steps and not core.steps["s1"].active
    core.submit_step(step("s3", 1))
    assert core.steps["s3"].active


def test_announce_beyond_max_announced_prompts_is_refused_and_announces_nothing():
    core, _ = make_core(max_announced_prompts=3)
    assert core.announce([(7, 1), (7, 2)], GREEDY) == 2
    before = state(core)
    err = refused(lambda: core.announce([(7, 3), (7, 4)], GREEDY), "prompts")
    assert "4 announced prompts" in str(err) and "limit of 3" in str(err)
    assert state(core) == before
    assert core.announce([(7, 1), (7, 2), (7, 3)], GREEDY) == 3  # already announced ones are not new


def test_lookahead_beyond_the_cap_refuses_the_step_but_its_own_prompts_make_room():
    core, _ = make_core(max_announced_prompts=3)
    core.add_worker(hello("a"))
    core.announce([(5, 6), (5, 7), (9, 9)], GREEDY)  # (5, 6) and (5, 7) are the prompts of step "s"
    before = state(core)
    refused(lambda: core.submit_step(step("big", 1, lookahead=[(8, 1), (8, 2), (8, 3), (8, 4)])), "lookahead")
    assert state(core) == before
    # step "s" forgets its two prompts, so two lookahead prompts fit beside (9, 9)
    core.submit_step(step("s", 2, lookahead=[(8, 1), (8, 2)]))
    assert set(core.planner.upcoming) == {(9, 9), (8, 1), (8, 2)}
