"""A cluster left with no worker (``core/liveness.py``), on the core with a fake clock: past
``no_worker_timeout_seconds`` running steps and queued calls fail UNAVAILABLE naming the cause,
once each; new ones are refused the same way; a worker that connects resumes service, and a
failed step's id runs again.

Before: with every worker gone, steps and calls waited forever, and new ones were taken."""

from __future__ import annotations

import pytest

from bubblespec.common.types import Completion, FinishReason, Prompt, SamplingParams
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.types import (
    Assign,
    ErrorCode,
    InvalidRequest,
    ModelLimits,
    RequestFailed,
    StepFailed,
    StepFinished,
    WorkerHello,
)
from bubblespec.scheduler.core.validate import Limits, build_step
from tests.support.clock import FakeClock

LIMITS = ModelLimits(max_model_len=256, vocab_size=100)


def spec(step_id: str, prompts: int = 2, n: int = 1):
    return build_step(step_id=step_id, policy_version=0,
                      prompts=[Prompt(f"p{i}", token_ids=(5, i + 6)) for i in range(prompts)],
                      sampling=SamplingParams(temperature=0.0, max_tokens=8, n=n), limits=Limits(), model=LIMITS)


def core_with(timeout: float | None = 60.0) -> tuple[SchedulerCore, FakeClock]:
    clock = FakeClock(0.0)
    core = SchedulerCore(CoreSettings(no_worker_timeout_seconds=timeout, drafting=False), clock)
    core.add_worker(WorkerHello("w", 4, 0, LIMITS))
    return core, clock


def finish(core: SchedulerCore, a: Assign) -> list:
    r = a.request
    c = Completion(r.step_id, r.prompt_id, r.sample_index, (1, 2), (0.0, 0.0), "", FinishReason.STOP, 0)
    return core.on_completion(a.worker_id, r.key, c)


def refused(call, field: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        call()
    assert err.value.code == ErrorCode.UNAVAILABLE and err.value.field == field, err.value
    assert "no worker has been connected for" in str(err.value) and "no_worker_timeout_seconds" in str(err.value)
    return err.value


def test_past_the_timeout_running_steps_and_calls_fail_unavailable_once_and_new_ones_are_refused():
    core, clock = core_with(60.0)
    core.submit_step(spec("s1", prompts=6))  # 4 run on the worker, 2 wait
    keys, _ = core.submit_requests(spec("call", prompts=1, n=2))
    core.remove_worker("w", "its stream ended")  # every engine gone: the work waits for a worker
    clock.now = 60.0
    assert [a for a in core.tick() if isinstance(a, (StepFailed, RequestFailed))] == []
    assert core.step("s1").active
    core.submit_step(spec("s2"))  # within the timeout a new step still queues (a worker may come back)

    clock.now = 60.5
    actions = core.tick()
    failed = [a for a in actions if isinstance(a, StepFailed)]
    assert sorted(f.step_id for f in failed) == ["s1", "s2"]
    for f in failed:
        assert f.code == ErrorCode.UNAVAILABLE and f.field == "workers" and "for 60s" in f.message, f
    requests = [a for a in actions if isinstance(a, RequestFailed)]
    assert sorted(r.key for r in requests) == sorted(keys)
    assert all(r.code == ErrorCode.UNAVAILABLE and r.field == "workers" for r in requests)
    assert not core.step("s1").active and core.stats().requests_waiting == 0
    clock.now = 90.0
    assert [a for a in core.tick() if isinstance(a, (StepFailed, RequestFailed))] == []  # answered once

    refused(lambda: core.submit_step(spec("s3")), "workers")
    refused(lambda: core.submit_requests(spec("call2")), "workers")


def test_a_worker_that_connects_resumes_service_and_a_failed_step_runs_again_under_its_id():
    core, clock = core_with(10.0)
    core.submit_step(spec("s1", prompts=2))
    core.remove_worker("w")
    clock.now = 11.0
    assert [a.step_id for a in core.tick() if isinstance(a, StepFailed)] == ["s1"]
    refused(lambda: core.check_step(spec("s1")), "workers")  # its retry, while still no worker

    clock.now = 20.0
    core.add_worker(WorkerHello("w2", 4, 0, LIMITS))
    assert not any(isinstance(a, (StepFailed, RequestFailed)) for a in core.tick())
    assert core.check_step(spec("s1")) is None  # the failed step is forgotten: its retry is a new step
    assigns = [a for a in core.submit_step(spec("s1")) if isinstance(a, Assign)]
    assert len(assigns) == 2 and {a.worker_id for a in assigns} == {"w2"}
    done = [a for a in assigns for a in finish(core, a)]
    assert [a.step_id for a in done if isinstance(a, StepFinished)] == ["s1"]
    keys, actions = core.submit_requests(spec("call"))
    assert len(keys) == 2 and len([a for a in actions if isinstance(a, Assign)]) == 2

    # the clock starts again when the last worker leaves, not from the first outage
    core.remove_worker("w2")
    clock.now = 29.0
    core.submit_step(spec("s4"))
    assert not any(isinstance(a, StepFailed) for a in core.tick())


def test_a_step_that_failed_for_other_reasons_is_not_run_again_and_none_means_wait_forever():
    core, clock = core_with(None)
    core.submit_step(spec("s1"))
    core.remove_worker("w")
    clock.now = 1e6
    assert not any(isinstance(a, (StepFailed, RequestFailed)) for a in core.tick())
    core.submit_step(spec("s2"))  # taken: it waits for a worker
    core.submit_requests(spec("call"))
    assert core.step("s1").active and core.step("s2").active


def test_the_setting_is_checked():
    for bad in (0, -1.0, float("nan"), "60", True):
        with pytest.raises(ValueError, match="no_worker_timeout_seconds"):
            CoreSettings(no_worker_timeout_seconds=bad)
