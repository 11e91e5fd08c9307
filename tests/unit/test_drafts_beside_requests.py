"""Draft jobs beside requests (``CoreSettings.max_draft_jobs_beside_requests``) and the hold on
a prompt whose stopped draft job has not reported yet (``DraftJobs.stop_arrived``)."""

from __future__ import annotations

from bubblespec.common.types import Completion, FinishReason, Prompt, Provenance, SamplingParams, SchedulingPolicy, SourceStats
from bubblespec.scheduler.core.drafting import DraftPlanner
from bubblespec.scheduler.core.drafts import HOLD_SECONDS
from bubblespec.scheduler.core.types import Assign, StartDraft, StopDraft
from bubblespec.scheduler.core.validate import Limits, build_step

from tests.unit.test_core import LIMITS, complete, hello, make_core, of

LONG, LONGER, LONGEST = (7, 8, 9), (7, 8, 9, 10), (7, 8, 9, 10, 11)


def prompts_step_with_lookahead(step_id: str, token_ids, lookahead, policy=SchedulingPolicy.QUEUE):
    return build_step(step_id=step_id, policy_version=0,
                      prompts=[Prompt(f"p{i}", token_ids=t) for i, t in enumerate(token_ids)],
                      sampling=SamplingParams(temperature=0.0, max_tokens=200, n=1),
                      lookahead=[Prompt(f"l{i}", token_ids=t) for i, t in enumerate(lookahead)],
                      policy=policy, limits=Limits(), model=LIMITS)


def paying_core(**settings):
    """A core whose recent completions accepted their future drafts (the gate of jobs beside requests is open)."""
    core, _ = make_core(**settings)
    core.drafts.future_saving = 1.0
    return core


def finish_with_future_drafts(core, a: Assign, drafted: int, accepted: int):
    r = a.request
    c = Completion(r.step_id, r.prompt_id, r.sample_index, tuple(range(20)), (0.0,) * 20, "", FinishReason.STOP, 0,
                   provenance=Provenance(20 - accepted, (SourceStats("future", drafted, accepted),)))
    return core.on_completion(a.worker_id, r.key, c)


def test_jobs_run_beside_the_first_steps_requests_then_only_while_future_drafts_pay() -> None:
    # after the first step: 9 of 20 tokens from future drafts pay, 2 do not, none offered shows nothing
    for drafted, accepted, beside in ((10, 9, 2), (10, 2, 0), (0, 0, 0)):
        core, _ = make_core(max_draft_jobs_beside_requests=2)
        core.add_worker(hello("a", capacity=8))
        first = core.submit_step(prompts_step_with_lookahead("s1", [(5, 6), (5, 7)], [LONG]))
        # the first step: no draft can exist before it, so jobs run beside its requests (one upcoming prompt)
        assert [j.job.prompt_token_ids for j in of(first, StartDraft)] == [LONG]
        a, b = of(first, Assign)
        complete(core, a)  # no future draft offered: the gate stays as it was
        assert len(core.workers["a"].drafts) == 1
        finish_with_future_drafts(core, b, drafted, accepted)  # ends the step; the idle worker drafts in the gap
        core.submit_step(prompts_step_with_lookahead("s2", [(5, 8), (5, 9)], [LONG, LONGER, LONGEST]))
        assert len(core.workers["a"].drafts) == beside, (drafted, accepted)


def with_history(core) -> None:
    """One finished step, so that unseen prompts are predicted by their length (5 tokens per prompt token)."""
    (a,) = of(core.submit_step(prompts_step_with_lookahead("s0", [(5, 6)], [])), Assign)
    complete(core, a, tokens=10)


def test_a_busy_worker_drafts_beside_its_requests_and_zero_turns_it_off() -> None:
    for beside, expected in ((2, 2), (0, 0)):
        core = paying_core(max_draft_jobs_beside_requests=beside)
        core.add_worker(hello("a", capacity=8))
        actions = core.submit_step(prompts_step_with_lookahead("s", [(5, 6)], [LONG, LONGER, LONGEST]))
        assert len(of(actions, Assign)) == 1
        assert len(of(actions, StartDraft)) == expected
        assert len(core.workers["a"].drafts) == expected


def test_work_arriving_keeps_the_longest_predicted_jobs_and_never_a_requests_slot() -> None:
    core = paying_core()
    core.add_worker(hello("a", capacity=3))
    with_history(core)
    first = core.submit_step(prompts_step_with_lookahead("s1", [(5, 6)], [(7, 8), LONG, LONGER, LONGEST]))
    (a,) = of(first, Assign)
    complete(core, a)  # the step ends: the idle worker drafts at full width (its capacity, 3)
    assert set(core.workers["a"].drafts.values()) == {LONG, LONGER, LONGEST}
    jobs = {prompt: job for job, prompt in core.workers["a"].drafts.items()}
    # two requests on a worker of capacity 3: one slot is left, for the longest prompt's job
    actions = core.submit_step(prompts_step_with_lookahead("s2", [(5, 6), (5, 7)], [(7, 8), LONG, LONGER, LONGEST]))
    assert len(of(actions, Assign)) == 2
    assert {s.job_id for s in of(actions, StopDraft)} == {jobs[LONG], jobs[LONGER]}
    assert list(core.workers["a"].drafts.values()) == [LONGEST]
    assert not of(actions, StartDraft)  # (7, 8) waits: no slot beside two requests on this worker


def drafting_beside():
    """Workers a and b; step s0 runs one prompt and announces ``LONGEST``, whose draft job then
    runs beside the request and on through the gap; the job's worker and the job."""
    core = paying_core()
    core.add_worker(hello("a", capacity=4))
    core.add_worker(hello("b", capacity=4))
    actions = core.submit_step(prompts_step_with_lookahead("s0", [(5, 6)], [LONGEST]))
    (a,) = of(actions, Assign)
    (job,) = of(actions, StartDraft)
    assert job.worker_id == a.worker_id and job.job.prompt_token_ids == LONGEST
    complete(core, a)
    return core, job


def test_a_prompt_waits_for_its_stopped_draft_job_to_report() -> None:
    for policy in (SchedulingPolicy.QUEUE, SchedulingPolicy.STATIC):
        core, job = drafting_beside()
        actions = core.submit_step(prompts_step_with_lookahead("s1", [LONGEST, (5, 6)], [], policy))
        assert [s.job_id for s in of(actions, StopDraft)] == [job.job.job_id]
        # the drafted prompt waits for its partial draft to be stored (and a queue does not move past it)
        before = [a.request.prompt_token_ids for a in of(actions, Assign)]
        assert LONGEST not in before
        released = core.on_draft_result(job.worker_id, job.job.job_id, tokens=40, finished=False)
        after = [a.request.prompt_token_ids for a in of(released, Assign)]
        assert sorted(before + after) == sorted([LONGEST, (5, 6)]) and LONGEST in after


def test_a_hold_whose_draft_result_never_comes_ends_after_hold_seconds() -> None:
    core, job = drafting_beside()
    clock = core.clock
    assert not of(core.submit_step(prompts_step_with_lookahead("s1", [LONGEST], [])), Assign)
    clock.now += HOLD_SECONDS / 2
    assert not of(core.tick(), Assign)
    clock.now += HOLD_SECONDS
    assert [a.request.prompt_token_ids for a in of(core.tick(), Assign)] == [LONGEST]
    late = core.on_draft_result(job.worker_id, job.job.job_id, tokens=40, finished=False)
    assert not of(late, Assign)  # nothing runs twice


def test_a_dead_drafting_worker_releases_the_prompt_it_held() -> None:
    core, job = drafting_beside()
    actions = core.submit_step(prompts_step_with_lookahead("s1", [LONGEST], []))
    assert of(actions, StopDraft) and not of(actions, Assign)
    other = "b" if job.worker_id == "a" else "a"
    released = core.remove_worker(job.worker_id)  # its result never comes
    assert [(a.worker_id, a.request.prompt_token_ids) for a in of(released, Assign)] == [(other, LONGEST)]


def test_no_job_runs_beside_requests_after_a_trainer_gap_as_long_as_the_step() -> None:
    for gap, beside in ((0.1, 2), (1.5, 0)):
        core, clock = make_core(max_draft_jobs_beside_requests=2)
        core.drafts.future_saving = 1.0
        core.add_worker(hello("a", capacity=8))
        (a,) = of(core.submit_step(prompts_step_with_lookahead("s1", [(5, 6)], [LONG, LONGER, LONGEST])), Assign)
        clock.now += 1.0  # a step of 1 s
        complete(core, a)  # the idle worker drafts every upcoming prompt in the gap
        assert len(core.workers["a"].drafts) == 3
        clock.now += gap
        core.submit_step(prompts_step_with_lookahead("s2", [(5, 7)], [LONG, LONGER, LONGEST]))
        assert len(core.workers["a"].drafts) == beside, gap  # the jobs it keeps beside its request


def test_a_placement_plans_draft_jobs_once_after_every_request_is_placed() -> None:
    # the balancer places a step one request at a time per worker: a job planned beside the
    # first request would be stopped by the second (a start and a stop the worker pays for)
    for capacity, jobs in ((2, 0), (3, 1)):
        core = paying_core()
        core.add_worker(hello("a", capacity=capacity))
        core.add_worker(hello("b", capacity=capacity))
        actions = core.submit_step(prompts_step_with_lookahead("s1", [(5, 6), (5, 7), (5, 8), (5, 9)], [LONG, LONGER]))
        assert len(of(actions, Assign)) == 4 and not of(actions, StopDraft), capacity
        assert len(of(actions, StartDraft)) == 2 * jobs, capacity


def test_prompts_announced_before_any_length_was_seen_are_predicted_again_later() -> None:
    planner = DraftPlanner()
    greedy = SamplingParams(temperature=0.0, max_tokens=200, n=1)
    planner.announce((1, 2), greedy, "", 0.0)  # the first step's lookahead: no history, no prediction
    planner.announce((1, 2, 3, 4, 5), greedy, "", 0.0)
    planner.announce((7, 8, 9), greedy, "", 15.0)  # announced once lengths were known
    planner.repredict(lambda ids: 5.0 * len(ids))  # the first step finished
    assert [planner.pick().token_ids for _ in range(3)] == [(1, 2, 3, 4, 5), (7, 8, 9), (1, 2)]


def test_a_finished_step_predicts_its_lookahead_again() -> None:
    core, _ = make_core(max_draft_jobs_beside_requests=0)
    core.add_worker(hello("a", capacity=1))
    (a,) = of(core.submit_step(prompts_step_with_lookahead("s1", [(5, 6)], [(7, 8), (7, 8, 9, 10)])), Assign)
    assert {u.predicted_len for u in core.planner.upcoming.values()} == {0.0}
    done = complete(core, a, tokens=10)  # 5 tokens per prompt token: (7, 8, 9, 10) predicted longest
    assert [j.job.prompt_token_ids for j in of(done, StartDraft)] == [(7, 8, 9, 10)]


def test_no_job_starts_beside_fewer_requests_than_the_minimum_where_one_is_set() -> None:
    """A job beside the few requests of a worker's tail slows what the step's end waits for
    (``CoreSettings.min_requests_beside_draft_jobs``)."""
    few, eight = [(5, 6), (5, 7), (5, 8)], [(5, i) for i in range(6, 14)]
    for prompts, minimum, expected in ((few, 8, 0), (few, 3, 2), (few, 0, 2), (eight, 8, 2)):
        core = paying_core(max_draft_jobs_beside_requests=2, min_requests_beside_draft_jobs=minimum)
        core.add_worker(hello("a", capacity=16))
        actions = core.submit_step(prompts_step_with_lookahead("s", prompts, [LONG, LONGER, LONGEST]))
        assert len(of(actions, Assign)) == len(prompts)
        assert len(of(actions, StartDraft)) == expected, (len(prompts), minimum)
    # eight requests and two jobs: one request done leaves seven, and an ended job is not replaced
    assigns = of(actions, Assign)
    complete(core, assigns[0])
    job = next(iter(core.workers["a"].drafts))
    after = core.on_draft_result("a", job, tokens=30, finished=True)
    assert not of(after, StartDraft) and len(core.workers["a"].drafts) == 1


UPCOMING = [LONG, LONGER, LONGEST, (7, 7)]


def two_busy_workers(at_tail: int = 3, **settings):
    """Workers a and b, each running one request of step s1; the four upcoming prompts' jobs run
    beside one of them. Returns the core, the assignments by worker, and the worker with the jobs."""
    core = paying_core(min_requests_beside_draft_jobs_at_tail=at_tail, **settings)
    core.add_worker(hello("a", capacity=8))
    core.add_worker(hello("b", capacity=8))
    actions = core.submit_step(prompts_step_with_lookahead("s1", [(5, 6), (5, 7)], UPCOMING))
    assigns = {a.worker_id: a for a in of(actions, Assign)}
    assert set(assigns) == {"a", "b"} and not of(actions, StopDraft)
    (drafting,) = {s.worker_id for s in of(actions, StartDraft)}
    assert len(core.workers[drafting].drafts) == 4  # max_draft_jobs_beside_requests
    return core, assigns, drafting


def test_at_the_tail_a_lone_requests_jobs_stop_and_the_idle_worker_drafts_their_prompts() -> None:
    core, assigns, busy = two_busy_workers()
    idle = "b" if busy == "a" else "a"
    jobs = dict(core.workers[busy].drafts)
    # the other worker runs out of the step's work: the tail begins, and one request is fewer than three
    actions = complete(core, assigns[idle])
    assert {s.job_id for s in of(actions, StopDraft) if s.worker_id == busy} == set(jobs)
    assert not core.workers[busy].drafts
    # each stopped job's result hands its prompt to the idle worker, never back to the busy one
    started = []
    for job in jobs:
        result = core.on_draft_result(busy, job, tokens=5, finished=False)
        assert not [s for s in of(result, StartDraft) if s.worker_id == busy]
        started += [s.job.prompt_token_ids for s in of(result, StartDraft) if s.worker_id == idle]
    assert sorted(started) == sorted(UPCOMING)
    assert not core.workers[busy].drafts and len(core.workers[idle].drafts) == 4
    # the next step: jobs beside requests again
    complete(core, assigns[busy])
    core.submit_step(prompts_step_with_lookahead("s2", [(5, 6), (5, 7)], UPCOMING + [(7, 6)]))
    assert any(w.running and w.drafts for w in core.workers.values())


def test_at_the_tail_jobs_stay_beside_fuller_batches_and_none_starts_beside_a_few() -> None:
    # an idle worker drafts 2 jobs at most: prompts are left for a busy worker to start jobs for
    core = paying_core(min_requests_beside_draft_jobs_at_tail=3, max_draft_jobs_per_worker=2)
    core.add_worker(hello("a", capacity=8))
    core.add_worker(hello("b", capacity=8))
    upcoming = UPCOMING + [(6, i) for i in range(16)]
    actions = core.submit_step(prompts_step_with_lookahead("s1", [(5, i) for i in range(7)], upcoming,
                                                           SchedulingPolicy.STATIC))
    by_worker: dict[str, list[Assign]] = {}
    for a in of(actions, Assign):
        by_worker.setdefault(a.worker_id, []).append(a)
    busy, idle = sorted(by_worker, key=lambda w: -len(by_worker[w]))
    assert len(by_worker[busy]) == 4 and len(core.workers[busy].drafts) == 4
    for a in by_worker[idle]:
        actions = complete(core, a)
    # the tail: the busy worker's four requests are at least three, so its jobs stay
    assert not of(actions, StopDraft) and len(core.workers[busy].drafts) == 4
    for a in by_worker[busy][:2]:  # two requests left: its running jobs go on, but a finished one is not replaced
        complete(core, a)
    assert len(core.workers[busy].drafts) == 4
    job = next(iter(core.workers[busy].drafts))
    assert not [s for s in of(core.on_draft_result(busy, job, tokens=9), StartDraft) if s.worker_id == busy]
    assert len(core.workers[busy].drafts) == 3


def test_at_zero_the_default_jobs_stay_beside_a_lone_request_at_the_tail() -> None:
    core, assigns, busy = two_busy_workers(at_tail=0)
    idle = "b" if busy == "a" else "a"
    actions = complete(core, assigns[idle])
    assert not of(actions, StopDraft) and len(core.workers[busy].drafts) == 4


def test_a_step_with_a_worker_idle_from_its_start_runs_no_job_beside_requests() -> None:
    core = paying_core(min_requests_beside_draft_jobs_at_tail=3)
    core.add_worker(hello("a", capacity=8))
    core.add_worker(hello("b", capacity=8))
    actions = core.submit_step(prompts_step_with_lookahead("s1", [(5, 6)], UPCOMING))
    (a,) = of(actions, Assign)
    idle = "b" if a.worker_id == "a" else "a"
    assert not of(actions, StopDraft)  # no job started beside the request and stopped at once
    assert {s.worker_id for s in of(actions, StartDraft)} == {idle} and not core.workers[a.worker_id].drafts
