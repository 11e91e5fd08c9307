"""Exactness plumbing in the core: draft seeds never a request's, logprobs modes routed and refused."""

from __future__ import annotations

import random

import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.rules import DRAFT_SEEDS, shares_draft_seeds
from bubblespec.common.types import Completion, FinishReason, Prompt, SamplingParams
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.types import Assign, InvalidRequest, ModelLimits, RequestSpec, StartDraft, WorkerHello
from bubblespec.scheduler.core.validate import Limits, build_step, check_sampling
from bubblespec.scheduler.servicers import RolloutServicer
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.worker.engine import EngineSettings

LIMITS = ModelLimits(max_model_len=256, vocab_size=100)


def core(seed: int = 0) -> SchedulerCore:
    return SchedulerCore(CoreSettings(), lambda: 0.0, rng=random.Random(seed))


def hello(wid: str, mode: str = "processed", capacity: int = 4) -> WorkerHello:
    return WorkerHello(wid, capacity, 0, LIMITS, True, mode)


def step(step_id: str, sampling: SamplingParams, prompts=((5, 6),), lookahead=()):
    return build_step(step_id=step_id, policy_version=0,
                      prompts=[Prompt(f"p{i}", token_ids=t) for i, t in enumerate(prompts)], sampling=sampling,
                      lookahead=[Prompt(f"l{i}", token_ids=t) for i, t in enumerate(lookahead)],
                      limits=Limits(), model=LIMITS)


def drafts_after_a_seeded_step(c: SchedulerCore, seed: int) -> tuple[list[StartDraft], set[int]]:
    """Run a seeded step (n = 4) whose lookahead and an announce (same seed) are drafted."""
    c.add_worker(hello("a", capacity=16))
    sampling = SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=seed)
    ahead = [(7, 8), (9, 10)]
    submitted = c.submit_step(step("s", sampling, lookahead=ahead))
    assigns = [a for a in submitted if isinstance(a, Assign)]
    c.announce([(11, 12)], sampling)
    request_seeds = {a.request.sampling.seed for a in assigns}
    out = [x for x in submitted if isinstance(x, StartDraft)]  # the first step's jobs beside its requests
    for a in assigns:
        out += [x for x in c.on_completion("a", a.request.key, _done(a.request)) if isinstance(x, StartDraft)]
    return out, request_seeds


@pytest.mark.parametrize("seed", [0, 2**62 - 1])
def test_draft_jobs_never_get_a_requests_seed(seed):
    jobs, request_seeds = drafts_after_a_seeded_step(core(), seed)
    assert request_seeds == {seed + i for i in range(4)}
    assert len(jobs) >= 3, "every upcoming prompt gets a draft job"
    seeds = [j.job.sampling.seed for j in jobs]
    assert all(s is not None and DRAFT_SEEDS[0] <= s < DRAFT_SEEDS[1] for s in seeds), seeds
    assert not set(seeds) & request_seeds
    assert len(set(seeds)) == len(seeds), "each draft job draws its own noise"
    # a request may have any int64 seed, a draft job's included: such a request verifies no draft job's draft
    for seed in (DRAFT_SEEDS[0], DRAFT_SEEDS[1] - 1, -(2**63)):
        check_sampling(SamplingParams(seed=seed, max_tokens=8), Limits(), LIMITS)
    assert shares_draft_seeds(DRAFT_SEEDS[0]) and shares_draft_seeds(DRAFT_SEEDS[1] - 1)
    assert shares_draft_seeds(DRAFT_SEEDS[0] - 2**64)  # the same seed for torch
    assert not any(shares_draft_seeds(s) for s in (None, 0, DRAFT_SEEDS[0] - 1, -1, -(2**63)))


def test_draft_seeds_are_deterministic_given_the_injected_rng():
    first = [j.job.sampling.seed for j in drafts_after_a_seeded_step(core(7), 3)[0]]
    again = [j.job.sampling.seed for j in drafts_after_a_seeded_step(core(7), 3)[0]]
    other = [j.job.sampling.seed for j in drafts_after_a_seeded_step(core(8), 3)[0]]
    assert first == again and first != other


def test_a_step_asking_for_logprobs_no_worker_returns_is_refused():
    c = core()
    c.add_worker(hello("a", "processed"))
    with pytest.raises(InvalidRequest) as exc:
        c.submit_step(step("s", SamplingParams(max_tokens=8, logprobs_mode="raw")))
    assert exc.value.field == "sampling.logprobs_mode" and exc.value.code == "FAILED_PRECONDITION"
    assert "s" not in c.steps and not c.workers["a"].running  # nothing changed


def test_requests_run_only_on_workers_returning_their_logprobs_mode():
    c = core()
    c.add_worker(hello("p", "processed"))
    c.add_worker(hello("r", "raw"))
    raw = [a for a in c.submit_step(step("s", SamplingParams(max_tokens=8, n=6, logprobs_mode="raw")))
           if isinstance(a, Assign)]
    assert len(raw) == 4 and {a.worker_id for a in raw} == {"r"}  # capacity 4; the processed worker takes none
    assert c.workers["p"].running == set()


def test_draft_jobs_ask_for_the_drafting_workers_mode():
    c = core()
    c.add_worker(hello("r", "raw"))
    submitted = c.submit_step(step("s", SamplingParams(max_tokens=8, logprobs_mode="raw"), lookahead=[(7, 8)]))
    (a,) = [a for a in c.steps["s"].requests.values()]
    jobs = [x for x in (*submitted, *c.on_completion("r", a.spec.key, _done(a.spec))) if isinstance(x, StartDraft)]
    assert jobs and all(j.job.sampling.logprobs_mode == "raw" for j in jobs)


def _done(r: RequestSpec) -> Completion:
    return Completion(r.step_id, r.prompt_id, r.sample_index, (1, 2), (0.0, 0.0), "", FinishReason.STOP, 0)


def test_bad_logprobs_modes_are_refused_naming_the_field():
    with pytest.raises(InvalidRequest) as exc:
        check_sampling(SamplingParams(max_tokens=8, logprobs_mode="processed_logits"), Limits(), LIMITS)
    assert exc.value.field == "sampling.logprobs_mode"
    with pytest.raises(InvalidRequest) as exc:
        core().add_worker(hello("a", "sometimes"))
    assert exc.value.field == "hello.logprobs_mode"
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineSettings(logprobs_mode="raw_logprobs")


def test_logprobs_mode_round_trips_and_defaults_to_the_schedulers_processed():
    assert cv.sampling_from_pb(cv.sampling_to_pb(SamplingParams(logprobs_mode="raw"))).logprobs_mode == "raw"
    assert cv.sampling_from_pb(pb.SamplingParams(max_tokens=4)).logprobs_mode == ""  # unset: the scheduler's default
    assert SamplingParams().logprobs_mode == "" and EngineSettings().logprobs_mode == "processed"
    assert SchedulerSettings().default_logprobs_mode == "processed"
    assert EngineSettings().seed is None  # each engine draws its own


def test_a_step_naming_no_mode_gets_the_schedulers_default():
    class Service:
        core = core()

    msg = cv.sampling_to_pb(SamplingParams(max_tokens=8))
    assert RolloutServicer(Service(), Limits(), None)._sampling(msg).logprobs_mode == "processed"
    assert RolloutServicer(Service(), Limits(), None, None, "raw")._sampling(msg).logprobs_mode == "raw"
    named = cv.sampling_to_pb(SamplingParams(max_tokens=8, logprobs_mode="processed"))
    assert RolloutServicer(Service(), Limits(), None, None, "raw")._sampling(named).logprobs_mode == "processed"
    with pytest.raises(ValueError, match="default_logprobs_mode"):
        RolloutServicer(Service(), Limits(), None, None, "logits")


def test_work_moved_off_the_only_worker_of_its_mode_goes_back_to_it():
    now = [0.0]
    c = SchedulerCore(CoreSettings(stall_seconds=5.0, max_attempts=5), lambda: now[0], rng=random.Random(0))
    c.add_worker(hello("p", "processed"))
    c.add_worker(hello("r", "raw", capacity=1))
    (first,) = [a for a in c.submit_step(step("s", SamplingParams(max_tokens=8, logprobs_mode="raw")))
                if isinstance(a, Assign)]
    assert first.worker_id == "r"
    for w in ("p", "r"):
        c.heartbeat(w, 10.0)
    now[0] = 6.0  # no progress for longer than stall_seconds: moved off r
    for w in ("p", "r"):
        c.heartbeat(w, 10.0)
    again = [a for a in c.tick() if isinstance(a, Assign)]
    assert [a.worker_id for a in again] == ["r"], "the processed worker cannot run it, so r takes it back"


def test_a_draft_jobs_sampling_is_the_prompts_with_its_own_seed_and_the_workers_mode():
    from dataclasses import replace

    from bubblespec.scheduler.core.drafting import Upcoming, job_sampling

    up = Upcoming((1, 2, 3), SamplingParams(temperature=0.8, top_k=5, max_tokens=64, seed=11, n=4), "s1")
    a, b = job_sampling(up, DRAFT_SEEDS[0] + 5, "raw"), job_sampling(up, DRAFT_SEEDS[0] + 6, "processed")
    assert a == replace(up.sampling, seed=DRAFT_SEEDS[0] + 5, logprobs_mode="raw")
    assert hash(a) == hash(replace(up.sampling, seed=DRAFT_SEEDS[0] + 5, logprobs_mode="raw"))
    assert b == replace(up.sampling, seed=DRAFT_SEEDS[0] + 6, logprobs_mode="processed")
    assert up.sampling.seed == 11 and up.sampling.logprobs_mode == ""  # the prompt's own params are untouched
    with pytest.raises(AttributeError):
        a.seed = 1  # type: ignore[misc]  # still frozen
