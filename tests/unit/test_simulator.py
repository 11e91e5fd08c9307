"""Unit tests of the cluster simulator (``bubblespec.bench.sim``): the cost model, the
workload, the simulated engine, and whole simulated runs that drive the real SchedulerCore."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bubblespec.common.types import SchedulingPolicy
from bubblespec.bench.sim.__main__ import main
from bubblespec.bench.pass_cost import fit_context_profile, fit_profile, fit_speculation_profile
from bubblespec.bench.sim.costs import (
    CPU_TINY,
    GPU_H100_7B,
    GPU_H100_7B_CONTEXT,
    GPU_H100_7B_FLASH,
    GPU_H100_7B_GQA,
    GPU_H100_7B_GQA_DERIVED,
    GPU_H100_7B_PUBLISHED,
    PROFILES,
    CostProfile,
)
from bubblespec.bench.sim.engine import Member, SimulatedEngine
from bubblespec.bench.sim.simulator import (
    SimResult,
    SimSettings,
    SimStalled,
    _Simulation,
    simulate,
)
from bubblespec.bench.sim.workload import (
    AcceptanceModel,
    LengthModel,
    Workload,
    expected_accepted,
)

REPO = Path(__file__).resolve().parents[2]
FLAT = CostProfile("flat", base_seconds=0.01, per_seq_seconds=0.0, per_draft_token_seconds=0.0,
                   prefill_per_token_seconds=0.0)
SHORT = Workload(lengths=LengthModel(median_tokens=200, max_tokens=4096))
WAVES = SimSettings(capacity=8, samples=4)  # 4 workers x 8 slots for 512 requests: 16 waves


def run(policy: str, drafting: bool, *, workers: int = 4, requests: int = 512, steps: int = 2, seed: int = 0,
        settings: SimSettings = WAVES, workload: Workload = SHORT) -> SimResult:
    return simulate(policy, workers, requests, steps, GPU_H100_7B, drafting, seed, workload=workload, settings=settings)


def fingerprint(r: SimResult) -> list[tuple]:
    return [(s.summary, s.delivered, s.with_future_draft, s.with_history_draft, s.draft_jobs) for s in r.steps]


# --- cost model -------------------------------------------------------------------------------


def test_step_seconds_is_linear_in_batch_drafts_and_prefill() -> None:
    p = CostProfile("t", base_seconds=1.0, per_seq_seconds=0.1, per_draft_token_seconds=0.01,
                    prefill_per_token_seconds=0.001)
    assert p.step_seconds(0) == 1.0
    assert p.step_seconds(10, 100, 1000) == pytest.approx(1.0 + 1.0 + 1.0 + 1.0)
    assert p.prefill_seconds(500) == pytest.approx(0.5)


def test_profiles_are_named_sourced_and_the_gpu_profile_is_its_measurement() -> None:
    assert PROFILES == {"cpu-tiny": CPU_TINY, "gpu-h100-7b": GPU_H100_7B, "gpu-h100-7b-context": GPU_H100_7B_CONTEXT,
                        "gpu-h100-7b-flash": GPU_H100_7B_FLASH, "gpu-h100-7b-gqa": GPU_H100_7B_GQA,
                        "gpu-h100-7b-gqa-derived": GPU_H100_7B_GQA_DERIVED,
                        "gpu-h100-7b-published": GPU_H100_7B_PUBLISHED}
    assert all(p.source for p in PROFILES.values())
    # gpu-h100-7b is the fit of the H100 report it names, to three significant figures
    report = json.loads((REPO / "bench" / "measurements" / "h100-llama7b-mha.json").read_text())
    assert "H100" in report["device"] and report["shape"]["layers"] == 32 and report["params"] > 6.5e9
    fit = fit_profile(report)
    for name in ("base_seconds", "per_seq_seconds", "per_draft_token_seconds", "prefill_per_token_seconds"):
        assert getattr(GPU_H100_7B, name) == pytest.approx(fit[name], rel=5e-3), name
    # and charges the measured passes inside the draft-length rule's regime within 30%
    for p in report["decode"]:
        if p["ctx"] == report["ctx"] and p["batch"] * p["k"] <= 256:
            assert GPU_H100_7B.step_seconds(p["batch"], p["batch"] * p["k"]) == pytest.approx(p["seconds"], rel=0.3)
    # the published-figures profile it replaced: ~10-15 ms per decode step at batch 64-256
    for batch in (64, 128, 256):
        assert 0.009 <= GPU_H100_7B_PUBLISHED.step_seconds(batch) <= 0.015
    # the calibrated CPU figures (2026-11-24): 2.0 ms at batch 1 and 5.5 ms at batch 48 were measured
    assert 0.0015 <= CPU_TINY.step_seconds(1) <= 0.003 and 0.004 <= CPU_TINY.step_seconds(48) <= 0.007


def test_the_flash_profile_is_the_one_kernel_measurement_and_its_passes_ran_one_kernel() -> None:
    """gpu-h100-7b-flash is the fit of the report measured with every pass's attention pinned to
    the flash kernel, and that report's points say they ran it, with and without drafts; the
    report behind gpu-h100-7b ran cuDNN's kernel without drafts and the flash kernel with them."""
    report = json.loads((REPO / "bench" / "measurements" / "h100-llama7b-mha-flash.json").read_text())
    assert report["attention"] == "flash" and report["shape"]["kv_heads"] == 32 and "H100" in report["device"]
    fit = fit_speculation_profile(report)
    for name in ("base_seconds", "per_seq_seconds", "per_draft_token_seconds", "spec_pass_seconds",
                 "per_drafted_seq_seconds"):
        assert getattr(GPU_H100_7B_FLASH, name) == pytest.approx(fit[name], rel=5e-3), name
    assert GPU_H100_7B_FLASH.prefill_per_token_seconds == pytest.approx(fit_profile(report)["prefill_per_token_seconds"],
                                                                        rel=5e-3)
    assert fit["median_rel_error"] < 0.02 < fit_profile(report)["median_rel_error"] and fit["max_rel_error"] < 0.06
    for p in report["decode"]:  # it charges every measured pass inside the budget within 6%
        if p["ctx"] == report["ctx"] and p["batch"] * p["k"] <= 256:
            seconds = GPU_H100_7B_FLASH.step_seconds(p["batch"], p["batch"] * p["k"],
                                                     drafted_sequences=p["batch"] if p["k"] else 0)
            assert seconds == pytest.approx(p["seconds"], rel=0.06), p
    for p in report["decode"]:
        assert any("flash_fwd" in k for k in p["attention_kernels"]), p
        assert not any("cudnn" in k for k in p["attention_kernels"]), p
    probes = json.loads((REPO / "bench" / "measurements" / "h100-llama7b-attention-probes.json").read_text())
    auto = probes["reports"]["mha-auto"]
    assert auto["attention"] == "auto"
    for p in auto["decode"]:
        kernels = " ".join(p["attention_kernels"])
        assert ("cudnn" in kernels) == (p["k"] == 0) and ("flash_fwd" in kernels) == (p["k"] > 0), p
    # at batch 64 the first draft token of each sequence added 6.3 ms across the change of kernel,
    # 3.6 ms within the flash kernel and 0.9 ms within the memory-efficient one
    efficient = json.loads((REPO / "bench" / "measurements" / "h100-llama7b-mha-efficient.json").read_text())
    first = {name: r[64, 1] - r[64, 0] for name, r in (
        (name, {(p["batch"], p["k"]): p["seconds"] for p in rep["decode"]})
        for name, rep in (("auto", auto), ("flash", report), ("efficient", efficient)))}
    assert first["auto"] > 1.5 * first["flash"] > 1.5 * 2 * first["efficient"] > 0, first


def test_the_context_profile_is_the_context_fit_of_the_same_report_and_charges_its_sweep() -> None:
    report = json.loads((REPO / "bench" / "measurements" / "h100-llama7b-mha.json").read_text())
    fit = fit_context_profile(report)
    for name in ("base_seconds", "per_seq_seconds", "per_context_token_seconds", "per_draft_token_seconds",
                 "per_draft_context_token_seconds"):
        assert getattr(GPU_H100_7B_CONTEXT, name) == pytest.approx(fit[name], rel=5e-3), name
    assert GPU_H100_7B_CONTEXT.prefill_per_token_seconds == GPU_H100_7B.prefill_per_token_seconds
    assert fit["median_rel_error"] < 0.06 and fit["flat_median_rel_error"] > 0.15
    # the sweep's long contexts, which the context-blind profile charges as 1,024 tokens
    for p in report["context"]:
        b, k, ctx = p["batch"], p["k"], p["ctx"]
        if b * k <= 256:
            seconds = GPU_H100_7B_CONTEXT.step_seconds(b, b * k, context_tokens=b * ctx, draft_context_tokens=b * k * ctx)
            assert seconds == pytest.approx(p["seconds"], rel=0.31), p
    b64 = [p for p in report["context"] if p["batch"] == 64 and p["k"] == 0 and p["ctx"] == 8192][0]
    assert GPU_H100_7B.step_seconds(64) < 0.3 * b64["seconds"]  # what the context-blind profile misses


def test_a_context_aware_engine_charges_a_request_its_growing_context() -> None:
    """One request alone: the fluid pass clock, re-costed as the context grows, adds up to the
    sum over its passes of the pass at that pass's context (within 0.01%); a context-blind
    profile takes one event."""
    length, prompt = 4096, 512
    for profile in (GPU_H100_7B_CONTEXT, GPU_H100_7B):
        eng = SimulatedEngine("w", profile, AcceptanceModel())
        eng.add(0.0, Member("a", length=length, prompt_tokens=prompt))
        t, events, done = eng.commit(0.0), 1, []
        while not done:
            done = eng.due(t)
            t = t if done else eng.commit(t)
            events += 0 if done else 1
        per_pass = profile.base_seconds + profile.per_seq_seconds
        exact = (profile.prefill_seconds(prompt) + length * per_pass
                 + profile.per_context_token_seconds * sum(prompt + i for i in range(length)))
        assert t == pytest.approx(exact, rel=1e-4)
        assert (events > 10) == profile.context_aware


def test_a_context_aware_engines_running_sums_match_its_members_at_every_event() -> None:
    """The batch's context and draft-weighted context, kept incrementally through drafts
    running out, re-plans, a removal and members finishing, equal the sums over the members."""
    eng = SimulatedEngine("w", GPU_H100_7B_CONTEXT, AcceptanceModel())
    for i in range(6):
        eng.add(0.0, Member(f"r{i}", length=500 + 400 * i, prompt_tokens=256 + 10 * i, draft_len=300.0 + 100 * i,
                            source="future", alpha=0.6 + 0.05 * i))
    t, finished, checks, drafted = eng.commit(0.0), [], 0, 0.0
    while t is not None:
        finished += [m.key for m in eng.due(t)]
        drafted = max(drafted, eng.kctx)
        if t > 1.0 and "r2" in eng.members:
            eng.remove(t, "r2")
        members = eng.members.values()
        assert eng.ctx == pytest.approx(sum(m.prompt_tokens + m.position(eng.passes) for m in members), abs=1e-6)
        assert eng.kctx == pytest.approx(sum(m.k * (m.prompt_tokens + m.position(eng.passes)) for m in members), abs=1e-6)
        assert eng.krate == pytest.approx(sum(m.k * m.rate for m in members), abs=1e-9)
        checks += 1
        t = eng.commit(t)
    assert sorted(finished) == ["r0", "r1", "r3", "r4", "r5"] and checks > 20 and drafted > 0


def test_an_engine_charges_a_pass_with_drafts_its_fixed_and_per_sequence_costs() -> None:
    """Under a profile with costs of speculation, the engine's count of drafting members stays
    the members with k > 0 through drafts running out, re-plans, a removal and members
    finishing, and every stretch is charged at the pass those members make; a profile without
    them charges the same members' passes as before."""
    eng = SimulatedEngine("w", GPU_H100_7B_FLASH, AcceptanceModel())
    for i in range(6):
        eng.add(0.0, Member(f"r{i}", length=500 + 400 * i, prompt_tokens=256, draft_len=300.0 + 100 * i,
                            source="future", alpha=0.6 + 0.05 * i))
    t, finished, with_drafts, without = eng.commit(0.0), [], 0, 0
    while t is not None:
        finished += [m.key for m in eng.due(t)]
        if t > 1.0 and "r2" in eng.members:
            eng.remove(t, "r2")
        t = eng.commit(t)
        if t is None:
            break
        members = list(eng.members.values())
        drafting = sum(1 for m in members if m.k > 0)
        assert eng.drafting == drafting
        expected = GPU_H100_7B_FLASH.step_seconds(len(members), sum(m.k for m in members), drafted_sequences=drafting)
        assert eng.pass_seconds == pytest.approx(expected, rel=1e-12)
        plain = GPU_H100_7B_FLASH.step_seconds(len(members), sum(m.k for m in members))
        if drafting:
            with_drafts += 1
            gap = GPU_H100_7B_FLASH.spec_pass_seconds + GPU_H100_7B_FLASH.per_drafted_seq_seconds * drafting
            assert eng.pass_seconds - plain == pytest.approx(gap)
        else:
            without += 1
            assert eng.pass_seconds == plain
    assert sorted(finished) == ["r0", "r1", "r3", "r4", "r5"] and with_drafts > 3 and without > 0
    # the other profiles leave the two terms out, whatever the count
    assert GPU_H100_7B.step_seconds(8, 32, drafted_sequences=8) == GPU_H100_7B.step_seconds(8, 32)


@pytest.mark.parametrize("field", ["base_seconds", "per_seq_seconds", "per_draft_token_seconds",
                                   "prefill_per_token_seconds", "per_context_token_seconds",
                                   "per_draft_context_token_seconds", "spec_pass_seconds",
                                   "per_drafted_seq_seconds"])
def test_profile_refuses_negative_constants(field: str) -> None:
    kwargs = {"base_seconds": 0.01, "per_seq_seconds": 0.0, "per_draft_token_seconds": 0.0,
              "prefill_per_token_seconds": 0.0}
    kwargs[field] = -1.0
    with pytest.raises(ValueError, match=field):
        CostProfile("bad", **kwargs)


# --- workload ---------------------------------------------------------------------------------


def test_workload_is_deterministic_by_seed_and_step() -> None:
    w = Workload()
    a, b = w.step(7, 3, 64, 4), w.step(7, 3, 64, 4)
    assert [(p.token_ids, p.lengths, p.accept_z) for p in a] == [(p.token_ids, p.lengths, p.accept_z) for p in b]
    assert [p.lengths for p in w.step(8, 3, 64, 4)] != [p.lengths for p in a]
    assert {p.token_ids for p in w.step(7, 4, 64, 4)}.isdisjoint({p.token_ids for p in a})


def test_lengths_are_long_tailed_and_capped() -> None:
    lm = LengthModel(median_tokens=400, max_tokens=8192)
    lengths = sorted(n for p in Workload(lengths=lm).step(0, 0, 4096, 4) for n in p.lengths)
    median = lengths[len(lengths) // 2]
    assert 300 <= median <= 550
    assert lengths[int(0.99 * len(lengths))] >= 5 * median  # a few run 5-20x the median
    assert 1 <= lengths[0] and lengths[-1] == 8192  # the cap is reached, never passed


def test_expected_accepted_follows_the_chain_rule() -> None:
    assert expected_accepted(0.7, 0) == 0.0
    assert expected_accepted(0.7, 1) == pytest.approx(0.7)
    assert expected_accepted(0.7, 3) == pytest.approx(0.7 + 0.49 + 0.343)
    assert expected_accepted(1.0, 5) == 5.0


def test_draft_length_rule_mirrors_the_worker() -> None:
    from bubblespec.worker.draft_index import DraftLength

    rule = DraftLength()
    model = AcceptanceModel(max_draft_tokens=rule.max_tokens, paying=False)  # the worker's fixed rule
    for batch in (1, 16, 64, 100, 256, 300):
        assert model.batch_cap(batch) == rule.batch_cap(batch)
        for alpha in (0.3, 0.45, 0.6, 0.7, 0.8, 0.9, 0.95):
            assert model.draft_tokens(alpha, model.batch_cap(batch)) == rule.for_request(alpha, 1, rule.batch_cap(batch))


def test_acceptance_spreads_around_the_source_mean() -> None:
    m = AcceptanceModel(future=0.7, history=0.6)
    assert m.alpha("future", 0.0) == pytest.approx(0.7)
    assert m.alpha("history", 0.0) == pytest.approx(0.6)
    assert m.alpha("future", -2.0) < 0.7 < m.alpha("future", 2.0) < 1


# --- simulated engine -------------------------------------------------------------------------


def engine(profile: CostProfile = FLAT) -> SimulatedEngine:
    return SimulatedEngine("w0", profile, AcceptanceModel(max_draft_tokens=8, paying=False))  # the fixed rule's k


def test_engine_runs_a_request_one_token_per_pass_without_a_draft() -> None:
    e = engine()
    e.add(0.0, Member("r", 100))
    assert e.commit(0.0) == pytest.approx(1.0)  # 100 passes x 10 ms
    (done,) = e.due(1.0)
    assert done.key == "r" and done.forward_passes(e.passes) == 100 and e.idle


def test_engine_drafts_only_while_the_draft_lasts() -> None:
    e = engine()
    e.add(0.0, Member("r", 200, draft_len=100, source="future", alpha=0.7))
    t = e.commit(0.0)
    rate = 1 + expected_accepted(0.7, 3)
    assert t == pytest.approx(0.01 * 100 / rate)  # first boundary: the draft runs out
    assert e.due(t) == [] and e.draft_tokens == 0  # now undrafted
    t2 = e.commit(t)
    assert t2 == pytest.approx(t + 0.01 * 100)
    (done,) = e.due(t2)
    assert done.accepted == pytest.approx(100 - 100 / rate)
    assert done.forward_passes(e.passes) + round(done.accepted) == 200


def test_engine_boundaries_stay_ordered_when_the_batch_changes() -> None:
    p = CostProfile("b", base_seconds=0.01, per_seq_seconds=0.01, per_draft_token_seconds=0.0,
                    prefill_per_token_seconds=0.0)
    e = engine(p)
    e.add(0.0, Member("long", 100))
    assert e.commit(0.0) == pytest.approx(100 * 0.02)
    e.add(0.5, Member("short", 10))  # 25 passes done; now 30 ms per pass
    t = e.commit(0.5)
    assert t == pytest.approx(0.5 + 10 * 0.03)
    assert [m.key for m in e.due(t)] == ["short"]
    t = e.commit(t)
    assert t == pytest.approx(0.8 + 65 * 0.02)
    (done,) = e.due(t)
    assert done.key == "long" and done.forward_passes(e.passes) == 100


def test_a_stopped_draft_job_keeps_its_partial_draft_and_a_kept_one_runs_beside_a_request() -> None:
    e = engine()
    e.add(0.0, Member("d1", 500, job=True))
    e.add(0.0, Member("d2", 500, job=True))
    e.commit(0.0)
    assert e.jobs
    stopped = e.remove(1.0, "d1")  # the core stops the jobs it does not keep (StopDraft)
    assert stopped is not None and int(stopped.pos0) == 100  # 1 s at 10 ms per pass
    e.add(1.0, Member("r", 10))  # the kept job and the request share the batch
    e.commit(1.0)
    assert sorted(e.members) == ["d2", "r"] and not e.jobs and e.job_count == 1
    (done,) = e.due(1.0 + 10 * 0.01)  # the request's 10 tokens, one per pass
    assert done.key == "r" and e.jobs and e.tokens("d2", 1.1) == 110


def test_prefill_delays_the_first_token() -> None:
    p = CostProfile("p", base_seconds=0.01, per_seq_seconds=0.0, per_draft_token_seconds=0.0,
                    prefill_per_token_seconds=0.001)
    e = engine(p)
    e.add(0.0, Member("r", 10, prompt_tokens=500))
    assert e.commit(0.0) == pytest.approx(0.5 + 0.1)


# --- whole runs against the real SchedulerCore ------------------------------------------------


def test_runs_are_deterministic_by_seed() -> None:
    a, b = run("queue", True, seed=5), run("queue", True, seed=5)
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(run("queue", True, seed=6)) != fingerprint(a)


@pytest.mark.parametrize("policy,drafting", [("static", False), ("queue", False), ("queue", True),
                                             ("static", True), ("longest-first", True)])
def test_every_request_completes_exactly_once(policy: str, drafting: bool) -> None:
    r = run(policy, drafting, settings=SimSettings(capacity=8, samples=4, policy_updates=True, load_seconds=12.0))
    assert len(r.steps) == 2
    for i, s in enumerate(r.steps):
        assert s.requests == 512 and s.delivered == 512 and s.duplicates == 0
        assert s.summary.completions == 512 and s.summary.policy_version == i


@pytest.mark.parametrize("seed", range(5))
def test_queue_makespan_is_not_above_static_with_long_tails(seed: int) -> None:
    static = run("static", False, steps=1, seed=seed)
    queue = run("queue", False, steps=1, seed=seed)
    assert queue.steps[0].makespan_seconds <= static.steps[0].makespan_seconds


def test_drafting_lowers_forward_passes_per_token() -> None:
    one_wave = SimSettings(capacity=64, samples=4)  # 16 workers x 64 slots: bubbles from the first finish
    plain = run("queue", False, workers=16, settings=one_wave)
    drafted = run("queue", True, workers=16, settings=one_wave)
    for s in plain.steps:
        assert s.forward_passes_per_token == 1.0 and s.drafting_share == 0.0 and s.accepted_per_pass == 0.0
    first, second = drafted.steps
    assert first.drafting_share > 0 and first.with_future_draft == 0  # drafts for step 1 are made here
    assert second.with_future_draft > 0.9 * second.requests
    assert second.forward_passes_per_token < 0.8 * plain.steps[1].forward_passes_per_token
    assert second.accepted_per_pass > 0.3
    p = second.summary.provenance
    assert p.forward_passes + p.accepted() == second.summary.generated_tokens
    assert p.accepted("future") > 0 and p.drafted("future") >= p.accepted("future")


def test_time_between_steps_passes_without_losing_workers() -> None:
    r = run("queue", True, settings=SimSettings(capacity=8, samples=4, train_seconds=45.0))
    assert [s.delivered for s in r.steps] == [512, 512]
    assert r.steps[1].summary.requests_requeued == 0  # no worker was declared dead in the gap


def test_drafting_through_the_trainer_gap_covers_more_of_the_next_step() -> None:
    without = run("queue", True, settings=SimSettings(capacity=8, samples=4))
    with_gap = run("queue", True, settings=SimSettings(capacity=8, samples=4, train_seconds=45.0))
    assert with_gap.steps[1].with_future_draft > without.steps[1].with_future_draft
    assert with_gap.steps[1].summary.forward_passes_per_token < without.steps[1].summary.forward_passes_per_token


def test_stopped_draft_jobs_report_their_partial_result_to_the_core() -> None:
    sim = _Simulation(SchedulingPolicy.QUEUE, 16, 128, GPU_H100_7B, True, 0, SHORT, AcceptanceModel(),
                      SimSettings(capacity=64, samples=4))
    first = sim.run_step(0)
    assert first.draft_jobs > 0
    before = {job for w in sim.core.workers.values() for job in w.drafts}
    assert before, "drafting stopped at the step's end instead of going on through the gap"
    sim.update_policy()  # the weight push stops every draft job made under the old policy
    after = {job for w in sim.core.workers.values() for job in (*w.drafts, *w.stopping)}
    assert not before & after
    assert sum(up.in_flight for up in sim.core.planner.upcoming.values()) == len(after)


def test_silent_workers_are_disconnected_and_a_stuck_step_is_reported() -> None:
    long = Workload(lengths=LengthModel(median_tokens=4000, prompt_sigma=0, sample_sigma=0))
    # no heartbeat after t=1 s and no progress report: any message of a worker proves it alive (``core.handle``)
    silent = SimSettings(capacity=64, samples=4, heartbeat_seconds=1000, progress_seconds=1000)
    with pytest.raises(SimStalled, match="64 requests undelivered"):
        simulate("queue", 4, 64, 1, GPU_H100_7B, False, workload=long, settings=silent)


def test_finished_siblings_serve_as_history_drafts() -> None:
    first = run("queue", True, steps=1).steps[0]
    assert first.with_history_draft > 0
    assert first.summary.provenance.accepted("history") > 0


def test_bubble_shares_come_from_the_core_summary() -> None:
    s = run("static", False, workers=16, requests=256, steps=1, settings=SimSettings(capacity=64, samples=4)).steps[0]
    total = s.summary.busy_worker_seconds + s.summary.idle_worker_seconds + s.summary.drafting_worker_seconds
    assert total == pytest.approx(16 * s.makespan_seconds, rel=1e-6)
    assert 0 < s.bubble_share < 1 and s.bubble_share == s.summary.bubble_share


def test_simulate_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of samples"):
        simulate("queue", 2, 10, 1, GPU_H100_7B, False, settings=SimSettings(samples=4))
    with pytest.raises(ValueError):
        simulate("fastest", 2, 16, 1, GPU_H100_7B, False)
    assert run("queue", False, steps=1).policy is SchedulingPolicy.QUEUE


def test_a_64_worker_run_delivers_every_request_of_every_step() -> None:
    r = simulate("queue", 64, 4096, 2, CPU_TINY, True, seed=1)  # its speed is LOAD.md's / SIMULATOR.md's, not a test's
    assert [s.delivered for s in r.steps] == [4096, 4096]
    assert math.isfinite(r.mean("makespan_seconds"))


def test_cli_prints_a_table_with_speedups_against_static(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workers", "2,4", "--requests", "64", "--samples", "4", "--steps", "2",
                 "--max-tokens", "1024", "--policies", "queue,queue+drafts,static+drafts"]) == 0
    out = capsys.readouterr().out
    table = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    header, rows = table[0], [dict(zip(table[0], r)) for r in table[1:]]
    assert "requests" in header and "per_seed" in header
    assert [r["policy"] for r in rows] == ["static", "queue", "queue+drafts", "static+drafts"] * 2
    assert all(r["speedup"] == "1.00x" for r in rows if r["policy"] == "static")


def test_trace_workload_replays_recorded_lengths() -> None:
    from bubblespec.bench.sim.workload import TraceWorkload

    trace = TraceWorkload(((30, 30, 300, 30), (40, 250, 40, 40)), max_tokens=512)
    r = simulate("queue", 2, 8, 2, CPU_TINY, False, 0, workload=trace, settings=SimSettings(capacity=8, samples=2))
    assert [s.summary.generated_tokens for s in r.steps] == [2 * 390, 2 * 370]
    with pytest.raises(ValueError):
        TraceWorkload(((30, 0),))


# --- makespan attribution, CLI defaults ---------------------------------------------------------


def test_tail_attribution_names_the_requests_that_end_the_step() -> None:
    settings = SimSettings(capacity=64, samples=4, tail_requests=3)
    r = run("queue", True, workers=16, settings=settings)
    for s in r.steps:
        assert len(s.tail) == 3
        last = s.tail[0]
        assert last.finished_seconds == pytest.approx(s.makespan_seconds)
        assert [t.finished_seconds for t in s.tail] == sorted((t.finished_seconds for t in s.tail), reverse=True)
        for t in s.tail:
            assert 0 <= t.started_seconds <= t.finished_seconds and 0.0 <= t.coverage <= 1.0
            assert t.forward_passes >= t.drafted_passes >= 0 and t.batch_at_start >= 1 and t.batch_at_finish >= 1
            assert t.tokens_per_pass == pytest.approx(t.length / t.forward_passes)
    assert any(t.source == "future" and t.draft_tokens > 0 and t.max_k >= 1 for t in r.steps[1].tail)
    assert run("queue", True, workers=16, settings=SimSettings(capacity=64, samples=4)).steps[1].tail == ()


def test_cli_prints_the_tail_of_every_reported_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workers", "4", "--requests", "64", "--samples", "4", "--steps", "2", "--max-tokens", "1024",
                 "--policies", "queue+drafts", "--tail", "2", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("last 2 requests") == 4  # 2 policies x 2 seeds x 1 reported step
    assert "undrafted_passes" in out and "s1/p" in out
    rows = [line for line in out.splitlines() if line.startswith("| 4 ")]
    assert all(len(r.split("|")[6].strip().split("/")) == 2 for r in rows)  # each seed's speedup


def test_cli_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    with pytest.raises(SystemExit):
        main(["--help"])
    options = capsys.readouterr().out.split("options:", 1)[1]
    blocks = {b.split()[0].rstrip(","): " ".join(b.split()) for b in re.split(r"\n  (?=-)", options) if b.strip()}
    blocks.pop("-h")
    assert len(blocks) >= 16 and "--tail" in blocks and "--seeds" in blocks
    for option, text in blocks.items():
        assert "(default:" in text, option


def test_default_requests_grow_with_the_worker_count() -> None:
    from bubblespec.bench.sim.__main__ import requests_for

    assert requests_for(8, "auto", 8) == 16384
    assert requests_for(512, "auto", 8) == 32768
    assert requests_for(4096, "auto", 8) == 262144
    assert requests_for(100, "auto", 3) % 3 == 0
    assert requests_for(4096, "1000", 8) == 1000
    with pytest.raises(SystemExit, match="--requests"):
        requests_for(8, "many", 8)


def test_engine_self_drafts_past_the_draft_only_in_the_what_if() -> None:
    e = engine()
    e.add(0.0, Member("r", 200, draft_len=100, source="future", alpha=0.7, suffix_alpha=0.5))
    t = e.commit(0.0)
    assert e.due(t) == [] and e.draft_tokens == 1  # past the draft: self-drafts, k = 1 at acceptance 0.5
    t2 = e.commit(t)
    assert t2 == pytest.approx(t + 0.01 * 100 / 1.5)
    (done,) = e.due(t2)
    assert done.accepted == pytest.approx(100 - 100 / (1 + expected_accepted(0.7, 3)))
    assert done.suffix_accepted == pytest.approx(100 - 100 / 1.5) and done.suffix_drafted == pytest.approx(100 / 1.5)
    assert done.forward_passes(e.passes) + round(done.accepted + done.suffix_accepted) == 200


def test_self_drafting_is_a_what_if_that_is_off_by_default() -> None:
    assert AcceptanceModel().suffix == 0.0
    plain = run("queue", True, steps=1)
    what_if = simulate("queue", 4, 512, 1, GPU_H100_7B, True, 0, workload=SHORT, settings=WAVES,
                       acceptance=AcceptanceModel(suffix=0.6))
    assert plain.steps[0].summary.provenance.accepted("suffix") == 0
    p = what_if.steps[0].summary.provenance
    assert p.accepted("suffix") > 0 and p.forward_passes + p.accepted() == what_if.steps[0].summary.generated_tokens
    assert what_if.steps[0].makespan_seconds < plain.steps[0].makespan_seconds


def test_a_draft_job_started_again_verifies_its_prompts_stored_partial_first() -> None:
    """As a real worker's job does (``worker/proposer.py``): the simulator hands a job its
    prompt's stored draft (``Simulator._start_draft``); past it, one token a pass."""
    e = engine()
    e.add(0.0, Member("again", 500, job=True, draft_len=200, source="future", alpha=0.9))
    e.add(0.0, Member("fresh", 500, job=True))
    e.commit(0.0)
    passes = e.passes
    t = 0.5
    fresh, again = e.tokens("fresh", t), e.tokens("again", t)
    assert fresh == round(e.passes - passes) and fresh < 60
    assert again >= 200 > 2 * fresh  # its 200 tokens verified many a pass, then one a pass


@pytest.mark.parametrize("drafting", [False, True])
def test_long_requests_move_to_idle_workers_once_and_every_token_is_counted(drafting: bool) -> None:
    from bubblespec.scheduler.core.settings import CoreSettings

    one_wave = SimSettings(capacity=64, samples=4, core=CoreSettings(move_long_requests=True, min_tokens_to_move=64))
    still = run("queue", drafting, workers=16, settings=SimSettings(capacity=64, samples=4))
    moved = run("queue", drafting, workers=16, settings=one_wave)
    for s, before in zip(moved.steps, still.steps):
        assert s.requests == 512 and s.delivered == 512 and s.duplicates == 0
        assert s.summary.requests_moved > 0  # idle workers took over long requests
        assert s.summary.generated_tokens == before.summary.generated_tokens  # the same responses, continued
        p = s.summary.provenance
        assert p.forward_passes + p.accepted() == s.summary.generated_tokens  # the partials' passes counted once
