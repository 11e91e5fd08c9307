"""Exact speculative drafting: future / history / sibling drafts through vLLM verification."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import redis.asyncio

from bubblespec.client import Prompt, SamplingParams, SchedulingPolicy
from bubblespec.store import prompt_key
from bubblespec.bench.tiny_model import perturb_weights
from tests.factories import token_prompts
from tests.support.exactness import check_greedy_identity

pytestmark = pytest.mark.vllm
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


async def test_greedy_is_token_identical_with_any_drafts(cluster, reference_engine, tiny_model, tmp_path):
    """Drafts off, perfect, garbage, from another policy (the reference loaded other weights and
    back in between): the same tokens as without speculation (tests/support/exactness.py; the GPU
    tier runs the same check)."""
    await check_greedy_identity(reference_engine, cluster.engines[0], tiny_model, tmp_path)


def _long_tail(rng: random.Random, count: int) -> list[int]:
    """Most responses short, one 10x longer: the long tail of RL rollouts."""
    lengths = [rng.randrange(12, 32) for _ in range(count)]
    lengths[rng.randrange(count)] = 320
    return lengths


async def test_three_steps_with_weight_updates_use_future_drafts_exactly(cluster, client, tiny_model, tmp_path):
    rng = random.Random(3)
    steps = [token_prompts(12, seed=300 + s) for s in range(3)]
    lengths = [_long_tail(rng, 12) for _ in steps]
    sp = SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True)
    base = cluster.scheduler.core.version
    weights = tiny_model
    report = []
    try:
        for s, ids in enumerate(steps):
            version = base + 1 + s
            weights = str(perturb_weights(weights, tmp_path / f"v{version}", scale=0.0005, seed=version))
            assert await client.update_policy(version, weights) == 2
            prompts = [Prompt(f"p{i}", token_ids=p, max_tokens=m) for i, (p, m) in enumerate(zip(ids, lengths[s]))]
            ahead = steps[s + 1] if s + 1 < len(steps) else []
            on = await client.generate(f"three-{s}", prompts, sp, policy_version=version, lookahead=ahead)
            off = await client.generate(f"three-{s}-off", prompts, sp, policy_version=version, drafts=False)
            assert [c.token_ids for c in on.completions] == [c.token_ids for c in off.completions]
            summ = on.summary
            report.append({
                "step": s + 1, "makespan_s": summ.makespan_seconds, "makespan_off_s": off.summary.makespan_seconds,
                "forward_passes_per_token": summ.forward_passes_per_token,
                "accepted_per_forward_pass": summ.provenance.accepted() / max(1, summ.provenance.forward_passes),
                "by_source": {x.source: [x.accepted_tokens, x.drafted_tokens] for x in summ.provenance.sources},
                "drafting_share": summ.drafting_worker_seconds / max(1e-9, summ.busy_worker_seconds
                                                                      + summ.idle_worker_seconds
                                                                      + summ.drafting_worker_seconds),
                "bubble_share": summ.bubble_share,
            })
    finally:
        await client.update_policy(cluster.scheduler.core.version + 1, tiny_model)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "three_step_run.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    first = report[0]["forward_passes_per_token"]
    for row in report[1:]:
        assert row["by_source"].get("future", [0, 0])[0] > 0, f"step {row['step']}: no accepted future tokens"
        assert row["forward_passes_per_token"] < first
    assert report[0]["drafting_share"] > 0, "step 1 had bubbles but nobody drafted"


async def test_redis_down_mid_step_keeps_results_exact_and_drafting_resumes(cluster, client, redis_server):
    v = cluster.scheduler.core.version
    sp = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    ids = token_prompts(8, seed=77)
    reference = await client.generate("redis-ref", ids, sp, policy_version=v, drafts=False)
    ahead = token_prompts(6, seed=78)
    task = asyncio.create_task(client.generate("redis-down", ids, sp, policy_version=v, lookahead=ahead))
    await asyncio.sleep(0.3)
    redis_server.kill()
    try:
        down = await task
        assert [c.token_ids for c in down.completions] == [c.token_ids for c in reference.completions]
        later = await client.generate("redis-still-down", ahead, sp, policy_version=v)
        assert later.summary.provenance.accepted("future") == 0, "drafts cannot come from a dead store"
    finally:
        redis_server.start()
    await asyncio.sleep(1.5)  # the workers' circuit breaker retries after 1 s
    again_ids = token_prompts(8, seed=79)
    again_ahead = token_prompts(6, seed=80)
    await client.generate("redis-back", again_ids, sp, policy_version=v, lookahead=again_ahead)
    # a worker sends a completion before it stores it as a draft, and a draft job stores its
    # draft when it ends: wait for the first write rather than scan once
    r = redis.asyncio.Redis.from_url(redis_server.url)
    keys: list = []
    for _ in range(300):
        keys = [k async for k in r.scan_iter("bubblespec:*:d")]
        if keys:
            break
        await asyncio.sleep(0.1)
    await r.aclose()
    assert keys, "no draft written to Redis after it came back"
    resumed = await client.generate("redis-resumed", again_ahead, sp, policy_version=v)
    assert resumed.summary.provenance.accepted("future") > 0


async def test_draft_job_yields_at_once_to_current_work(cluster, client):
    core = cluster.scheduler.core
    kept = core.settings
    # no job kept beside requests (else the worker keeps up to 4 of its jobs running beside the new work),
    # and the long request stays where it runs (else the drafting worker, idle, may take it over)
    core.settings = replace(kept, max_draft_jobs_beside_requests=0, move_long_requests=False)
    try:
        await _yields_at_once(cluster, client)
    finally:
        core.settings = kept


async def _yields_at_once(cluster, client):
    core = cluster.scheduler.core
    v = core.version
    long_sp = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    a_prompts = [Prompt("long", token_ids=token_prompts(1, seed=90)[0]),
                 Prompt("short", token_ids=token_prompts(1, seed=91)[0], max_tokens=4)]
    ahead = token_prompts(8, seed=92)
    a = asyncio.create_task(client.generate("yield-a", a_prompts, long_sp, policy_version=v, lookahead=ahead,
                                            policy=SchedulingPolicy.QUEUE))
    agents = {ag.worker_id: ag for ag in cluster.agents}
    for _ in range(6000):  # a worker drafts in the bubble, and its draft has tokens to keep
        drafting = [w for w in core.workers.values() if w.drafts and not w.running
                    and any(agents[w.hello.worker_id].runner.draft_tokens.values())]
        if drafting:
            break
        await asyncio.sleep(0.01)
    assert drafting, "no worker drafted in the bubble"
    worker = drafting[0].hello.worker_id
    b = await client.generate("yield-b", token_prompts(4, seed=93), SamplingParams(temperature=0, max_tokens=4),
                              policy_version=v)
    assert not a.done(), "current work waited for the step-A straggler or the draft jobs"
    assert worker in {c.worker_id for c in b.completions}, "the drafting worker did not take the new work"
    await a
    cands = await cluster.store.get_drafts([prompt_key(p) for p in ahead])
    partial = [e for entries in cands.values() for e in entries if e.source.value == "future" and len(e.tokens) < 480]
    assert partial, "the preempted draft job did not keep its partial draft"


async def test_busy_workers_draft_beside_their_requests_and_the_next_step_uses_it(cluster, client):
    """Both workers busy with a long response each (static split): the announced prompt is
    drafted beside those requests on a real engine, and the next step's request of that prompt
    is exact and takes the draft's tokens."""
    core = cluster.scheduler.core
    v = core.version
    sp = SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True)
    # Jobs run beside requests while the trainer's gaps are short (a step just before this one)
    # and while completions show future drafts paying (CoreSettings.max_draft_jobs_beside_requests;
    # the gate's own tests: tests/unit/test_drafts_beside_requests.py). The gate is opened here as
    # a step of accepted drafts opens it: warming it with real steps left it to timing (with no
    # gap between two steps, their drafts could stay too short to pay).
    await client.generate("beside-warm", token_prompts(2, seed=121), sp, policy_version=v)
    core.drafts.future_saving = max(core.drafts.future_saving, 1.0)
    ahead = token_prompts(1, seed=122)
    agents = {ag.worker_id: ag for ag in cluster.agents}
    step = asyncio.create_task(client.generate("beside-a", token_prompts(2, seed=123), sp, policy_version=v,
                                               lookahead=ahead, policy=SchedulingPolicy.STATIC))
    beside = []
    for _ in range(3000):  # a worker with requests running also runs the draft job, and it makes tokens
        beside = [w for w in core.workers.values() if w.running and w.drafts
                  and any(agents[w.hello.worker_id].runner.draft_tokens.values())]
        if beside or step.done():
            break
        await asyncio.sleep(0.01)
    await step
    assert beside, "no busy worker drafted beside its requests"
    on = await client.generate("beside-b", ahead, sp, policy_version=v)
    off = await client.generate("beside-b-off", ahead, sp, policy_version=v, drafts=False)
    assert [c.token_ids for c in on.completions] == [c.token_ids for c in off.completions]
    assert on.summary.provenance.accepted("future") > 0


async def test_a_prompts_later_sample_drafts_from_its_finished_sibling_on_the_engine(cluster):
    """Grouped drafts on a vLLM engine (worker/groups.py): the second call of a prompt, sent
    after the first finished, drafts from the first's response (source ``sibling``) and returns
    the same greedy tokens; after a cache reset it drafts nothing."""
    from tests.support.exactness import check_provenance, run_engine

    engine = cluster.engines[0]
    prompt = token_prompts(1, seed=4242)
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    await engine.control("reset_prefix_cache", {})
    [first] = await run_engine(engine, prompt, sp, tag="group-first")
    assert first.provenance.forward_passes == 64  # nothing to draft from yet
    [second] = await run_engine(engine, prompt, sp, tag="group-second")
    assert second.token_ids == first.token_ids
    check_provenance([second], drafts_on=True, arm="group-second")
    by_source = {s.source: s for s in second.provenance.sources}
    assert by_source["sibling"].accepted_tokens >= 48, second.provenance
    assert second.provenance.forward_passes <= 20
    await engine.control("reset_prefix_cache", {})
    [third] = await run_engine(engine, prompt, sp, tag="group-third")
    assert third.token_ids == first.token_ids and third.provenance.forward_passes == 64
