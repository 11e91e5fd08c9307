"""Shared-queue dispatch by predicted work (core/balance.py), with the in-process core."""

from __future__ import annotations

from bubblespec.common.types import Prompt, SamplingParams, SchedulingPolicy
from bubblespec.scheduler.core.types import Assign, StartDraft, StepFinished
from bubblespec.scheduler.core.validate import Limits, build_step

from tests.unit.test_core import LIMITS, complete, hello, make_core, of


def prompts_step(step_id: str, token_ids: list[tuple[int, ...]], n: int = 1, policy=SchedulingPolicy.QUEUE):
    return build_step(step_id=step_id, policy_version=0,
                      prompts=[Prompt(f"p{i}", token_ids=t) for i, t in enumerate(token_ids)],
                      sampling=SamplingParams(temperature=0.0, max_tokens=200, n=n),
                      policy=policy, limits=Limits(), model=LIMITS)


def split(assigns: list[Assign]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in assigns:
        out.setdefault(a.worker_id, []).append(a.request.prompt_id)
    return out


def test_worker_holding_a_long_predicted_response_takes_fewer_others():
    """Room for the whole step on each worker: by request count the long response's worker
    took half the step; by predicted tokens it takes the long one alone."""
    core, _ = make_core()
    core.add_worker(hello("a", capacity=8))
    core.add_worker(hello("b", capacity=8))
    prompts = [(5, 6), (5, 7), (5, 8), (5, 9)]
    for a in of(core.submit_step(prompts_step("s1", prompts)), Assign):  # history: p0 runs 100 tokens, the rest 10
        complete(core, a, tokens=100 if a.request.prompt_id == "p0" else 10)
    per = split(of(core.submit_step(prompts_step("s2", prompts)), Assign))
    long_worker = next(w for w, ids in per.items() if "p0" in ids)
    assert per[long_worker] == ["p0"]
    assert sorted(per["b" if long_worker == "a" else "a"]) == ["p1", "p2", "p3"]


def test_before_any_history_longer_prompts_are_spread_by_prompt_length():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=8))
    core.add_worker(hello("b", capacity=8))
    long_prompt = tuple(range(5, 45))  # 40 tokens; the others 2
    per = split(of(core.submit_step(prompts_step("s", [long_prompt, (5, 6), (5, 7), (5, 8)])), Assign))
    long_worker = next(w for w, ids in per.items() if "p0" in ids)
    assert per[long_worker] == ["p0"]


def _run_to_the_end(core, assigns) -> list[str]:
    pending, finished, seen = list(assigns), [], []
    while pending:
        a = pending.pop(0)
        seen.append(a.request.key)
        actions = complete(core, a)
        pending += of(actions, Assign)
        finished += of(actions, StepFinished)
    assert finished
    return seen


def _place_six_prompts_of_two_samples(**settings):
    """A step of 6 prompts x 2 samples on two workers with room for all 12: the assignments and
    each prompt's workers."""
    core, _ = make_core(**settings)
    core.add_worker(hello("a", capacity=6))
    core.add_worker(hello("b", capacity=6))
    prompts = [tuple(range(5, 5 + 2 + 3 * i)) for i in range(6)]
    assigns = of(core.submit_step(prompts_step("s", prompts, n=2)), Assign)
    assert len(assigns) == 12 and {w: len(ids) for w, ids in split(assigns).items()} == {"a": 6, "b": 6}
    workers: dict[str, set[str]] = {}
    for a in assigns:
        workers.setdefault(a.request.prompt_id, set()).add(a.worker_id)
    return core, assigns, workers


def test_where_the_step_fits_sample_groups_stay_together_and_every_request_runs_once():
    core, assigns, workers = _place_six_prompts_of_two_samples()
    assert all(len(ws) == 1 for ws in workers.values())  # a prompt's samples on one worker
    seen = _run_to_the_end(core, assigns)
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 12


def test_spread_samples_places_each_prompts_samples_on_different_workers():
    """``spread_samples``: the queue is handed out a request at a time, so a prompt's samples
    (whose lengths go together) land on different workers; every request still runs once."""
    core, assigns, workers = _place_six_prompts_of_two_samples(spread_samples=True)
    assert all(ws == {"a", "b"} for ws in workers.values())  # one sample of every prompt on each worker
    seen = _run_to_the_end(core, assigns)
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 12


def test_where_the_step_does_not_fit_one_sample_of_every_prompt_starts_first_and_every_request_runs_once():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=4))
    core.add_worker(hello("b", capacity=4))
    prompts = [tuple(range(5, 5 + 2 + 3 * i)) for i in range(6)]  # 6 prompts x 2 samples, room for 8
    assigns = of(core.submit_step(prompts_step("s", prompts, n=2)), Assign)
    assert len(assigns) == 8 and {w: len(ids) for w, ids in split(assigns).items()} == {"a": 4, "b": 4}
    assert {a.request.prompt_id for a in assigns} == {f"p{i}" for i in range(6)}  # every prompt's probe runs
    seen = _run_to_the_end(core, assigns)
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 12


def test_where_the_whole_queue_starts_now_the_longest_is_placed_first():
    """FIFO placement put the long response (last in the queue) on a worker that already held
    work; placed first, it runs alone."""
    core, _ = make_core()
    core.add_worker(hello("a", capacity=8))
    core.add_worker(hello("b", capacity=8))
    prompts = [(5, 6), (5, 7), (5, 8)]
    for a in of(core.submit_step(prompts_step("s1", prompts)), Assign):  # history: p2 runs 100 tokens
        complete(core, a, tokens=100 if a.request.prompt_id == "p2" else 10)
    per = split(of(core.submit_step(prompts_step("s2", prompts)), Assign))
    long_worker = next(w for w, ids in per.items() if "p2" in ids)
    assert per[long_worker] == ["p2"]


def test_drafting_is_narrow_while_a_step_runs_and_widens_in_the_gap():
    core, _ = make_core(max_draft_jobs_during_step=1, max_draft_jobs_beside_requests=0)
    core.add_worker(hello("a", capacity=4))
    core.add_worker(hello("b", capacity=4))
    lookahead = [(7, 8), (9, 10, 11), (12, 13, 14, 15)]
    assigns = of(core.submit_step(prompts_step_with_lookahead("s", [(5, 6), (5, 7)], lookahead)), Assign)
    first, second = assigns
    during = of(complete(core, first), StartDraft)
    assert len(during) == 1 and during[0].worker_id == first.worker_id
    after = complete(core, second)
    assert of(after, StepFinished)
    widened = of(after, StartDraft)
    assert {d.job.prompt_token_ids for d in widened} == set(lookahead) - {during[0].job.prompt_token_ids}  # the rest, at once


def prompts_step_with_lookahead(step_id: str, token_ids, lookahead):
    return build_step(step_id=step_id, policy_version=0,
                      prompts=[Prompt(f"p{i}", token_ids=t) for i, t in enumerate(token_ids)],
                      sampling=SamplingParams(temperature=0.0, max_tokens=200, n=1),
                      lookahead=[Prompt(f"l{i}", token_ids=t) for i, t in enumerate(lookahead)],
                      policy=SchedulingPolicy.QUEUE, limits=Limits(), model=LIMITS)


def test_no_drafting_while_a_step_runs_when_its_width_is_zero():
    core, _ = make_core(max_draft_jobs_during_step=0, max_draft_jobs_beside_requests=0)
    core.add_worker(hello("a", capacity=4))
    core.add_worker(hello("b", capacity=4))
    lookahead = [(7, 8), (9, 10, 11)]
    first, second = of(core.submit_step(prompts_step_with_lookahead("s", [(5, 6), (5, 7)], lookahead)), Assign)
    assert of(complete(core, first), StartDraft) == []  # the other worker still runs the step
    after = complete(core, second)
    assert of(after, StepFinished)
    assert {d.job.prompt_token_ids for d in of(after, StartDraft)} == set(lookahead)


def test_the_queued_samples_of_a_prompt_whose_probe_runs_long_go_first():
    """One worker with room for 3 of 3 prompts x 2 samples: the probes run; p2's has made 50
    tokens, p1's 30, p0's none. The freed slots go to p2's sibling, then p1's, though p0's
    sibling is first in the submitted order."""
    from bubblespec.scheduler.core.events import Progress

    core, _ = make_core()
    core.add_worker(hello("a", capacity=3))
    first = of(core.submit_step(prompts_step("s", [(5, 6), (5, 7), (5, 8)], n=2)), Assign)
    assert sorted(a.request.prompt_id for a in first) == ["p0", "p1", "p2"]
    probe = {a.request.prompt_id: a for a in first}
    core.handle(Progress("a", probe["p2"].request.key, 50))
    core.handle(Progress("a", probe["p1"].request.key, 30))
    core.tick()
    assert [a.request.prompt_id for a in of(complete(core, probe["p0"], tokens=10), Assign)] == ["p2"]
    assert [a.request.prompt_id for a in of(complete(core, probe["p2"], tokens=60), Assign)] == ["p1"]
    assert [a.request.prompt_id for a in of(complete(core, probe["p1"], tokens=40), Assign)] == ["p0"]


def test_reordering_by_probes_keeps_a_requeued_request_in_front():
    from bubblespec.scheduler.core.events import Progress
    from bubblespec.scheduler.core.probes import by_probes

    core, _ = make_core()
    core.add_worker(hello("a", capacity=3))
    first = of(core.submit_step(prompts_step("s", [(5, 6), (5, 7), (5, 8)], n=2)), Assign)
    probe = {a.request.prompt_id: a for a in first}
    core.handle(Progress("a", probe["p2"].request.key, 50))
    step = core.steps["s"]
    requeued = next(k for k in step.shared if step.requests[k].spec.prompt_id == "p0")  # by probes: last
    step.requests[requeued].failures.append(("b", "engine error"))
    by_probes(step, core.history.predicted, [step.requests[k] for k in core.workers["a"].running], now=0.0)
    assert step.shared[0] == requeued and len(step.shared) == 3


def test_the_queue_is_reordered_at_most_once_per_reorder_interval():
    from bubblespec.scheduler.core.events import Progress
    from bubblespec.scheduler.core.probes import REORDER_SECONDS

    core, clock = make_core()
    core.add_worker(hello("a", capacity=3))
    first = of(core.submit_step(prompts_step("s", [(5, 6), (5, 7), (5, 8)], n=2)), Assign)
    probe = {a.request.prompt_id: a for a in first}
    core.tick()  # nothing reported: the submitted order stays
    core.handle(Progress("a", probe["p2"].request.key, 50))
    core.tick()  # within the interval: not reordered yet
    order = [core.steps["s"].requests[k].spec.prompt_id for k in core.steps["s"].shared]
    assert order == ["p0", "p1", "p2"]
    clock.now += REORDER_SECONDS
    core.handle(Progress("a", probe["p2"].request.key, 60))
    core.tick()
    assert core.steps["s"].requests[core.steps["s"].shared[0]].spec.prompt_id == "p2"
