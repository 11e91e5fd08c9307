"""Long requests moved to idle workers with what they generated (``scheduler/core/moves.py``)."""

from __future__ import annotations

from dataclasses import replace

from bubblespec.common.rules import DRAFT_SEEDS, RESUME_SEEDS, resume_seed
from bubblespec.common.types import Completion, FinishReason, Provenance, SamplingParams
from bubblespec.scheduler.core.types import Abort, Assign, Deliver, Ignored, RequestsMoved, WorkerHello

from tests.unit.test_core import LIMITS, complete, make_core, of, step


def resumable(wid: str, capacity: int = 4) -> WorkerHello:
    return WorkerHello(wid, capacity, 0, LIMITS, True, accepts_resume=True)


def partial_of(a: Assign, tokens: int, version: int = 0) -> Completion:
    r = a.request
    return Completion(r.step_id, r.prompt_id, r.sample_index, tuple(range(10, 10 + tokens)), (-0.5,) * tokens, "",
                      FinishReason.STOP, version, a.worker_id, provenance=Provenance(tokens))


def finish_then_tick(core, a: Assign) -> list:
    """Complete ``a``; moves are made at the core's next tick."""
    return complete(core, a) + core.tick()


def busy_and_idle(**settings):
    """Worker a runs three requests of one step; worker b ran the fourth and is idle now."""
    core, clock = make_core(move_long_requests=True, min_tokens_to_move=4, **settings)
    core.add_worker(resumable("a", capacity=3))
    core.add_worker(resumable("b", capacity=1))
    assigns = of(core.submit_step(step("s", 4)), Assign)
    on_a = [x for x in assigns if x.worker_id == "a"]
    (on_b,) = [x for x in assigns if x.worker_id == "b"]
    for i, x in enumerate(on_a):
        core.on_progress("a", x.request.key, 5 + i)  # the last one is furthest along
    return core, clock, on_a, on_b


def test_an_idle_worker_takes_over_the_request_furthest_along_and_it_goes_on_from_its_partial():
    core, _, on_a, on_b = busy_and_idle()
    actions = finish_then_tick(core, on_b)  # b runs out of work; the tick finds it idle
    (abort,) = of(actions, Abort)
    longest = on_a[-1].request.key
    assert (abort.worker_id, abort.key, abort.keep_partial) == ("a", longest, True)
    assert core.steps["s"].requests[longest].worker == "a"  # still a's until the partial comes
    partial = partial_of(on_a[-1], 7)
    moved = core.on_aborted("a", longest, "moved", partial)
    (assign,) = of(moved, Assign)
    assert (assign.worker_id, assign.request.key, assign.resume) == ("b", longest, partial)
    assert of(moved, RequestsMoved)[0].keys == (longest,)
    assert longest not in core.workers["a"].running and longest in core.workers["b"].running
    assert core.steps["s"].moved == 1
    # its completion comes from b; a's late word about it is ignored; delivered once
    done = complete(core, assign, tokens=12)
    assert len(of(done, Deliver)) == 1
    assert of(core.on_progress("a", longest, 9), Ignored)


def test_nothing_moves_beside_itself_short_or_when_the_setting_is_off():
    for settings, progress in (({}, 5), ({"move_long_requests": False}, 50)):
        core, _ = make_core(min_tokens_to_move=4, **settings)
        core.add_worker(resumable("a", capacity=3))
        core.add_worker(resumable("b", capacity=1))
        assigns = of(core.submit_step(step("s", 4)), Assign)
        for x in assigns:
            core.on_progress(x.worker_id, x.request.key, progress if x.worker_id == "a" else 1)
        on_b = next(x for x in assigns if x.worker_id == "b")
        if settings:  # off: no move whatever the progress
            assert not of(finish_then_tick(core, on_b), Abort)
            continue
        for x in assigns:  # on, but below min_tokens_to_move: none moves
            core.on_progress(x.worker_id, x.request.key, 3)
        core2, _ = make_core(move_long_requests=True, min_tokens_to_move=10)
        core2.add_worker(resumable("a", capacity=3))
        core2.add_worker(resumable("b", capacity=1))
        assigns2 = of(core2.submit_step(step("s", 4)), Assign)
        for x in assigns2:
            core2.on_progress(x.worker_id, x.request.key, 9)
        assert not of(finish_then_tick(core2, next(x for x in assigns2 if x.worker_id == "b")), Abort)


def test_only_between_workers_that_can_resume_and_never_from_a_request_running_alone():
    core, _ = make_core(move_long_requests=True, min_tokens_to_move=4)
    core.add_worker(WorkerHello("a", 3, 0, LIMITS, True))  # cannot resume
    core.add_worker(resumable("b", capacity=1))
    assigns = of(core.submit_step(step("s", 4)), Assign)
    for x in assigns:
        core.on_progress(x.worker_id, x.request.key, 20)
    assert not of(finish_then_tick(core, next(x for x in assigns if x.worker_id == "b")), Abort)
    core, _ = make_core(move_long_requests=True, min_tokens_to_move=4)
    core.add_worker(resumable("a", capacity=1))
    core.add_worker(resumable("b", capacity=1))
    a, b = of(core.submit_step(step("s", 2)), Assign)
    core.on_progress(a.worker_id, a.request.key, 20)
    assert not of(finish_then_tick(core, b), Abort)  # a runs it alone: moving it gains nothing


def test_steps_a_resume_could_change_are_never_moved():
    def moves(**kw) -> bool:
        core, _ = make_core(move_long_requests=True, min_tokens_to_move=4)
        core.add_worker(resumable("a", capacity=3))
        core.add_worker(resumable("b", capacity=1))
        spec = step("s", 4, **{k: v for k, v in kw.items() if k != "sampling"})
        if "sampling" in kw:
            spec = replace(spec, sampling=kw["sampling"])
        assigns = of(core.submit_step(spec), Assign)
        for x in assigns:
            core.on_progress(x.worker_id, x.request.key, 20)
        return bool(of(finish_then_tick(core, next(x for x in assigns if x.worker_id == "b")), Abort))

    assert moves()
    assert not moves(sampling=SamplingParams(temperature=0.0, max_tokens=16, stop=("</a>",)))  # a stop string could span it
    assert not moves(straggler_watch=False)  # a pure baseline
    assert not moves(use_drafts=False, sampling=SamplingParams(temperature=0.0, max_tokens=16, seed=3))  # bit-reproducible
    assert moves(use_drafts=False)  # unseeded: nothing to reproduce
    assert moves(sampling=SamplingParams(temperature=1.0, max_tokens=16, seed=3))  # seeded with drafts: resume_seed


def test_a_completion_that_comes_first_calls_the_move_off():
    core, _, on_a, on_b = busy_and_idle()
    finish_then_tick(core, on_b)
    longest = on_a[-1]
    assert core.workers["b"].incoming == longest.request.key
    done = complete(core, longest, tokens=9)  # it finished before a read the abort
    assert len(of(done, Deliver)) == 1
    assert core.steps["s"].requests[longest.request.key].moving_to is None
    # b may take over another one at the next tick: the next furthest along
    (abort,) = of(core.tick(), Abort)
    assert abort.key == on_a[-2].request.key == core.workers["b"].incoming
    # an abort without a partial is a failed attempt: the request runs again from the start
    again = core.on_aborted("a", abort.key, "engine error")
    req = core.steps["s"].requests[abort.key]
    assert req.failures and req.resume is None and req.moving_to is None
    assert any(x.request.key == abort.key and x.resume is None for x in of(again, Assign))


def test_a_partial_that_cannot_continue_the_request_is_refused_naming_the_field():
    cases = (
        (lambda c: replace(c, policy_version=3), "aborted.partial.policy_version"),
        (lambda c: replace(c, token_ids=tuple(range(16)), logprobs=()), "aborted.partial.token_ids"),  # max_tokens 16
        (lambda c: replace(c, logprobs=(0.0,)), "aborted.partial.logprobs"),
        (lambda c: replace(c, token_ids=(1, 200)), "aborted.partial.token_ids"),  # outside the vocabulary (100)
        (lambda c: replace(c, sample_index=5), "aborted.partial"),  # another request's
    )
    for spoil, field in cases:
        core, _, on_a, on_b = busy_and_idle()
        finish_then_tick(core, on_b)
        key = on_a[-1].request.key
        actions = core.on_aborted("a", key, "moved", spoil(partial_of(on_a[-1], 7)))
        (ignored,) = of(actions, Ignored)
        assert ignored.field == field, (field, ignored)
        req = core.steps["s"].requests[key]
        assert req.resume is None and req.failures  # runs again from the start
        assert all(x.resume is None for x in of(actions, Assign))


def test_a_moved_request_never_runs_on_a_worker_that_cannot_continue_it_while_one_can():
    core, _, on_a, on_b = busy_and_idle()
    finish_then_tick(core, on_b)
    core.remove_worker("b")  # the worker it was moving to left
    key = on_a[-1].request.key
    core.add_worker(WorkerHello("c", 4, 0, LIMITS, True))  # cannot resume
    actions = core.on_aborted("a", key, "moved", partial_of(on_a[-1], 7))
    assert not [x for x in of(actions, Assign) if x.request.key == key and x.worker_id == "c"]
    assert key in core.steps["s"].shared or any(x.request.key == key for x in of(actions, Assign))
    # once no worker left can resume, it runs from the start on one that cannot
    core.remove_worker("a")
    placed = [x for x in of(core.tick() + core.dispatch(), Assign) if x.request.key == key]
    req = core.steps["s"].requests[key]
    assert req.resume is None and (placed or req.worker == "c")


def test_no_draft_job_runs_beside_a_moved_request():
    core, _, on_a, on_b = busy_and_idle(max_draft_jobs_beside_requests=4)
    core.drafts.future_saving = 1.0
    finish_then_tick(core, on_b)
    key = on_a[-1].request.key
    core.on_aborted("a", key, "moved", partial_of(on_a[-1], 7))
    assert core.workers["b"].moved_in == {key} and core.drafts.beside(core.workers["b"], 1) == 0


def test_resume_seeds_are_fresh_and_never_a_draft_jobs():
    top = 2**63 - 1  # the largest seed validation lets a step have (sample i adds i, modulo 2**64)
    seeds = (0, 1, 2**60, 2**61, -1, -(2**63), top, top + 63)  # a few differing only in their top bits
    seen = {resume_seed(s, t) for s in seeds for t in (1, 2, 1000)}
    assert len(seen) == 3 * len(seeds)
    assert all(RESUME_SEEDS[0] <= x < RESUME_SEEDS[1] for x in seen)
    assert RESUME_SEEDS[1] <= DRAFT_SEEDS[0]


def test_a_move_the_core_called_off_frees_its_worker_for_another():
    core, _, on_a, on_b = busy_and_idle()
    finish_then_tick(core, on_b)
    first = on_a[-1].request.key
    assert core.workers["b"].incoming == first
    core.cancel_step("s")  # the trainer gave up on the step while the move was under way
    core.tick()
    assert core.workers["b"].incoming is None
    assert of(core.on_aborted("a", first, "moved", partial_of(on_a[-1], 7)), Ignored)  # a late partial: ignored


def lightly_loaded(lookahead=(), use_drafts=False, **settings):
    """Worker a runs four requests of one step (the last furthest along), worker b two (it will
    finish one); none of them has the tokens a move needs yet."""
    core, _ = make_core(move_long_requests=True, min_tokens_to_move=4, **settings)
    core.add_worker(resumable("a", capacity=4))
    core.add_worker(resumable("b", capacity=2))
    assigns = of(core.submit_step(step("s", 6, lookahead=lookahead, use_drafts=use_drafts)), Assign)
    on_a = [x for x in assigns if x.worker_id == "a"]
    on_b = [x for x in assigns if x.worker_id == "b"]
    assert (len(on_a), len(on_b)) == (4, 2)
    for i, x in enumerate(on_a):
        core.on_progress("a", x.request.key, 5 + i)
    return core, on_a, on_b


def test_a_lightly_loaded_worker_takes_over_from_a_batch_twice_its_own_and_two_more():
    core, on_a, on_b = lightly_loaded()
    (abort,) = of(finish_then_tick(core, on_b[0]), Abort)  # b runs one, a four
    assert (abort.worker_id, abort.key) == ("a", on_a[-1].request.key)
    moved = core.on_aborted("a", abort.key, "moved", partial_of(on_a[-1], 8))
    (assign,) = of(moved, Assign)
    assert (assign.worker_id, assign.request.key) == ("b", abort.key)
    assert core.workers["b"].running == {on_b[1].request.key, abort.key}
    # 0: only a worker with nothing to run takes one (the rule before)
    core, _, on_b = lightly_loaded(move_to_workers_running_at_most=0)
    assert not of(finish_then_tick(core, on_b[0]), Abort)


def test_no_move_to_a_worker_running_more_than_half_the_batch_or_drafting_or_of_a_drafted_step():
    core, on_a, on_b = lightly_loaded()
    complete(core, on_a[0])  # a runs three
    assert not of(finish_then_tick(core, on_b[0]), Abort)  # beside b's one it would share passes with one of two
    for drafting in (True, False):  # b runs a draft job (another step's upcoming prompt) beside its last request
        core, _, on_b = lightly_loaded()
        complete(core, on_b[0])
        if drafting:
            core.workers["b"].drafts["job-0"] = (7, 8, 9)
        assert bool(of(core.tick(), Abort)) is not drafting  # taking one would stop the job: no
    # a step with drafts: a request moves only to a worker with nothing to run
    core, on_a, on_b = lightly_loaded(use_drafts=True, max_draft_jobs_beside_requests=0)
    assert not of(finish_then_tick(core, on_b[0]), Abort)
    (abort,) = of(finish_then_tick(core, on_b[1]), Abort)
    assert abort.key == on_a[-1].request.key
