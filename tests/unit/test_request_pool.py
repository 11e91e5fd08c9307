"""Independent calls in the core's pool (``core/pool.py``): no step cap, groups by prompt,
limits with a retry hint, vLLM's pause modes, version spans, failures and callers that leave."""

from __future__ import annotations

import pytest
from bubblespec.common.types import Completion, FinishReason, Prompt, SamplingParams
from bubblespec.scheduler.core.pool import POOL, version_spans
from bubblespec.scheduler.core.types import (
    Abort,
    Assign,
    Deliver,
    ErrorCode,
    InvalidRequest,
    LoadPolicy,
    PolicyReady,
    RequestFailed,
)
from bubblespec.scheduler.core.validate import Limits, build_step

from tests.unit.test_core import LIMITS, complete, hello, make_core, of


def call(*prompts: tuple[int, ...], n: int = 1, max_tokens: int = 16, seed: int | None = None):
    return build_step(step_id="http-x", policy_version=0,
                      prompts=[Prompt(f"p{i}", token_ids=p) for i, p in enumerate(prompts)],
                      sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, seed=seed),
                      limits=Limits(), model=LIMITS)


def partial(a: Assign, tokens: int, version: int | None = None) -> Completion:
    r = a.request
    return Completion(r.step_id, r.prompt_id, r.sample_index, tuple(range(1, tokens + 1)), (-0.5,) * tokens,
                      "x" * tokens, FinishReason.LENGTH, r.policy_version if version is None else version)


def test_calls_beyond_the_step_cap_all_run_and_each_is_answered_once():
    core, _ = make_core(max_active_steps=2)
    core.add_worker(hello("a", capacity=4))
    keys, assigns = [], []
    for i in range(40):  # 40 calls, 20x the step cap
        k, actions = core.submit_requests(call((5, 6 + i % 3)))
        keys += k
        assigns += of(actions, Assign)
    assert len(set(keys)) == 40 and len(assigns) == 4  # capacity 4: the rest wait in the queue
    delivered = []
    while assigns:
        a = assigns.pop(0)
        actions = complete(core, a)
        delivered += [d.completion for d in of(actions, Deliver)]
        assigns += of(actions, Assign)
    assert sorted(f"{POOL}/{c.prompt_id}/{c.sample_index}" for c in delivered) == sorted(keys)
    assert core.step(POOL) is None and core.pool.pending == 0  # nothing kept once answered


def test_same_prompt_calls_share_a_group_and_count_samples_on():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=8))
    k1, _ = core.submit_requests(call((5, 6), n=2))
    k2, _ = core.submit_requests(call((5, 6)))
    k3, _ = core.submit_requests(call((5, 7)))
    assert k1 == [f"{POOL}/g0/0", f"{POOL}/g0/1"] and k2 == [f"{POOL}/g0/2"] and k3 == [f"{POOL}/g1/0"]


def test_seeds_offset_per_sample_within_a_call():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=8))
    core.submit_requests(call((5, 6), seed=7))
    _, actions = core.submit_requests(call((5, 6), n=3, seed=7))
    assert [a.request.sampling.seed for a in of(actions, Assign)] == [7, 8, 9]


def test_a_full_pool_refuses_with_a_retry_hint_and_changes_nothing():
    core, _ = make_core(max_pending_requests=3)
    core.add_worker(hello("a", capacity=1))
    core.submit_requests(call((5, 6), n=2))
    with pytest.raises(InvalidRequest) as err:
        core.submit_requests(call((5, 7), n=2))
    assert err.value.code == ErrorCode.RESOURCE_EXHAUSTED and err.value.retry_after == 1.0
    assert "max_pending_requests" in str(err.value)
    assert core.pool.pending == 2
    core.submit_requests(call((5, 7)))  # one more fits


def test_prompt_token_limit():
    core, _ = make_core(max_pending_prompt_tokens=5)
    core.add_worker(hello("a"))
    core.submit_requests(call((5, 6, 7), n=1))
    with pytest.raises(InvalidRequest, match="max_pending_prompt_tokens"):
        core.submit_requests(call((5, 6, 7)))


def test_a_caller_that_leaves_aborts_its_running_requests_and_unqueues_the_rest():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=1))
    keys, actions = core.submit_requests(call((5, 6), n=3))
    [running] = of(actions, Assign)
    out = core.cancel_requests(keys)
    assert of(out, Abort) == [Abort("a", running.request.key)]
    assert core.step(POOL) is None and core.pool.pending == 0
    assert of(complete(core, running), Deliver) == []  # a late completion is stale, not delivered
    keys2, actions = core.submit_requests(call((5, 7)))
    assert of(actions, Assign)[0].request.key == keys2[0]  # the worker is free for new work


def test_a_request_that_fails_every_attempt_fails_alone():
    core, _ = make_core(max_attempts=2)
    core.add_worker(hello("a", capacity=2))
    core.add_worker(hello("b", capacity=2))
    bad, actions = core.submit_requests(call((5, 6)))
    good, more = core.submit_requests(call((5, 7)))
    assigns = {a.request.key: a for a in of(actions + more, Assign)}
    first = assigns[bad[0]]
    retry = of(core.on_aborted(first.worker_id, bad[0], "engine error"), Assign)
    assert [a.request.key for a in retry] == bad and retry[0].worker_id != first.worker_id
    failed = of(core.on_aborted(retry[0].worker_id, bad[0], "engine error"), RequestFailed)
    assert [f.key for f in failed] == bad and "failed 2 attempts" in failed[0].message
    assert of(complete(core, assigns[good[0]]), Deliver)  # the other call is untouched


def test_pause_parks_new_calls_until_resume():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=4))
    core.pause("wait")
    keys, actions = core.submit_requests(call((5, 6)))
    assert of(actions, Assign) == [] and core.pause_waiting() == []
    assert [a.request.key for a in of(core.resume(), Assign)] == keys


def test_pause_wait_lets_admitted_requests_finish():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=1))
    keys, actions = core.submit_requests(call((5, 6), n=2))
    core.pause("wait")
    assert core.pause_waiting() == [POOL]
    nxt = of(complete(core, of(actions, Assign)[0]), Assign)
    assert [a.request.key for a in nxt] == keys[1:]  # admitted before the pause: it still runs
    complete(core, nxt[0])
    assert core.pause_waiting() == []


def test_pause_abort_answers_running_with_partial_and_queued_with_nothing():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=1))
    keys, actions = core.submit_requests(call((5, 6), n=2))
    [running] = of(actions, Assign)
    out = core.pause("abort")
    assert of(out, Abort) == [Abort("a", keys[0], keep_partial=True)]
    [queued] = [d.completion for d in of(out, Deliver)]
    assert queued.finish_reason is FinishReason.ABORT and queued.token_ids == () and queued.sample_index == 1
    [answer] = of(core.on_aborted("a", keys[0], "paused", partial(running, 5)), Deliver)
    assert answer.completion.finish_reason is FinishReason.ABORT and answer.completion.token_ids == (1, 2, 3, 4, 5)
    assert core.step(POOL) is None
    later, actions = core.submit_requests(call((5, 6)))  # paused: parked, not aborted
    assert of(actions, Assign) == [] and of(core.resume(), Assign)[0].request.key == later[0]


def _keep_then_update(core, single_version: bool = False):
    core.add_worker(hello("a", capacity=2))
    keys, actions = core.submit_requests(call((5, 6), max_tokens=32), single_version=single_version)
    [running] = of(actions, Assign)
    out = core.pause("keep")
    assert of(out, Abort) == [Abort("a", keys[0], keep_partial=True)]
    load = of(core.update_policy(1, "/w1"), LoadPolicy)  # a held request does not block the update
    assert load
    core.on_aborted("a", keys[0], "paused", partial(running, 4))  # the stop's answer comes first
    assert of(core.on_policy_loaded("a", 1, True), PolicyReady)
    [resumed] = of(core.resume(), Assign)
    return resumed


def test_pause_keep_goes_on_from_its_tokens_under_the_new_version_and_reports_spans():
    core, _ = make_core()
    resumed = _keep_then_update(core)
    assert resumed.request.policy_version == 1 and resumed.resume.token_ids == (1, 2, 3, 4)
    tokens = (1, 2, 3, 4, 9, 9)  # the worker joins the partial and what followed it
    c = Completion(POOL, resumed.request.prompt_id, resumed.request.sample_index, tokens, (0.0,) * 6, "",
                   FinishReason.STOP, 1)
    [d] = of(core.on_completion("a", resumed.request.key, c), Deliver)
    assert d.completion.version_spans == ((0, 0), (4, 1)) and d.completion.policy_version == 1


def test_single_version_requests_restart_from_scratch_across_an_update():
    core, _ = make_core()
    resumed = _keep_then_update(core, single_version=True)
    assert resumed.request.policy_version == 1 and resumed.resume is None


def test_version_spans_of_one_version_are_empty():
    c = Completion(POOL, "g0", 0, (1, 2), (0.0, 0.0), "", FinishReason.STOP, 3)
    assert version_spans(None, c) == () and version_spans(c, c) == ()


def test_queued_requests_run_under_the_version_an_update_set():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=1))
    core.update_policy(1, "/w1")
    keys, actions = core.submit_requests(call((5, 6)))  # while the update loads: queued
    assert of(actions, Assign) == []
    out = core.on_policy_loaded("a", 1, True)
    [a] = of(out, Assign)
    assert a.request.key == keys[0] and a.request.policy_version == 1


def test_a_worker_lost_while_aborting_still_answers_the_caller():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=1))
    keys, _ = core.submit_requests(call((5, 6)))
    core.pause("abort")
    [d] = of(core.remove_worker("a"), Deliver)
    assert d.completion.finish_reason is FinishReason.ABORT and core.step(POOL) is None


def test_steps_and_calls_share_the_workers():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=2))
    from tests.unit.test_core import step

    s = of(core.submit_step(step("s1", 1)), Assign)
    _, actions = core.submit_requests(call((5, 6)))
    assert len(s) == 1 and len(of(actions, Assign)) == 1


def test_calls_of_one_prompt_go_to_the_worker_running_their_group():
    """One call per rollout (GRPO through HTTP): the prompt's samples meet on one worker, where
    they draft from each other, while that worker has room."""
    core, _ = make_core()
    core.add_worker(hello("a", capacity=4))
    core.add_worker(hello("b", capacity=4))
    placed = {}
    for _ in range(4):
        for prompt in ((5, 6), (5, 7)):
            _, actions = core.submit_requests(call(prompt))
            for a in of(actions, Assign):
                placed.setdefault(a.request.prompt_token_ids, set()).add(a.worker_id)
    assert [len(w) for w in placed.values()] == [1, 1] and placed[(5, 6)] != placed[(5, 7)]
    _, actions = core.submit_requests(call((5, 6)))  # every worker is full: it waits in the queue
    assert of(actions, Assign) == []


def test_n_up_to_vllms_limit_and_requests_per_call_bounded():
    spec = build_step(step_id="c", policy_version=0, prompts=[Prompt("p0", token_ids=(5, 6))],
                      sampling=SamplingParams(n=16_384, max_tokens=4), limits=Limits(), model=LIMITS)
    assert spec.num_requests == 16_384  # vLLM's VLLM_MAX_N_SEQUENCES
    with pytest.raises(InvalidRequest, match="sampling.n"):
        build_step(step_id="c", policy_version=0, prompts=[Prompt("p0", token_ids=(5, 6))],
                   sampling=SamplingParams(n=16_385, max_tokens=4), limits=Limits(), model=LIMITS)
    with pytest.raises(InvalidRequest, match="at most 8 per step or call"):
        build_step(step_id="c", policy_version=0, prompts=[Prompt(f"p{i}", token_ids=(5, 6)) for i in range(3)],
                   sampling=SamplingParams(n=3, max_tokens=4), limits=Limits(max_requests=8), model=LIMITS)


def test_calls_parked_by_a_pause_count_as_waiting():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=1))
    core.submit_requests(call((5, 6), n=2))
    core.pause("wait")
    core.submit_requests(call((5, 7), n=3))
    stats = core.stats()
    assert (stats.requests_running, stats.requests_waiting) == (1, 1 + 3)
