"""Long requests moved to idle workers with what they generated (``scheduler/core/moves.py``,
``worker/resume.py``), on real vLLM CPU engines: a response continued from its partial is the
response generated in one go (tokens, text, logprobs), and a step whose idle worker takes
over a long request returns what the same weights return without speculation. The ground
truth is the cluster's own engine with drafts off: earlier tests of the session may have
loaded other weights into the cluster (speculation against no speculation on the same weights
is docs/EXACTNESS.md's, tests/integration/test_drafting.py)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from bubblespec.client import Prompt, SamplingParams, SchedulingPolicy
from bubblespec.common.types import Completion
from bubblespec.worker.engine import EngineRequest
from bubblespec.worker.resume import joined, resumed
from tests.factories import token_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


async def _final(engine, request: EngineRequest):
    final = None
    async for out in engine.generate(request):
        final = out
    return final


async def test_a_response_continued_from_its_partial_is_the_one_generated_in_one_go(cluster):
    speculative = cluster.engines[0]
    for i, prompt in enumerate(token_prompts(4, seed=131)):
        full = await _final(speculative, EngineRequest(f"mv-full-{i}", prompt, GREEDY, use_drafts=False))
        for t in (1, 9, 27):
            head = await _final(speculative, EngineRequest(f"mv-head-{i}-{t}", prompt, replace(GREEDY, max_tokens=t),
                                                           use_drafts=False))
            assert head.token_ids == full.token_ids[:t]
            before = Completion("s", "p", 0, head.token_ids, head.logprobs, head.text, head.finish_reason, 0, "w",
                                len(prompt), head.provenance)
            # on the speculative engine, with the whole response as a stored draft (shifted to position t)
            request = resumed(EngineRequest(f"mv-rest-{i}-{t}", prompt, GREEDY, (("history", full.token_ids),)), before)
            rest = await _final(speculative, request)
            ids, logprobs, text, provenance = joined(before, rest)
            assert ids == full.token_ids, (i, t)
            assert text == full.text, (i, t)
            assert logprobs == pytest.approx(full.logprobs, abs=1e-3)
            # a pass keeps at least one token, at most 1 + its accepted drafts (max_tokens may cut the last)
            assert provenance.forward_passes <= len(ids) <= provenance.forward_passes + provenance.accepted()
            assert rest.provenance.accepted("history") > 0  # the shifted draft lined up with where it went on


async def test_an_idle_worker_takes_over_a_long_request_and_the_step_returns_the_reference_output(cluster, client):
    core = cluster.scheduler.core
    kept, agents = core.settings, {a: a.settings for a in cluster.agents}
    core.settings = replace(kept, move_long_requests=True, min_tokens_to_move=8, max_draft_jobs_beside_requests=0)
    for a in agents:  # progress reports every 50 ms: the scheduler learns which requests are long within a step
        a.settings = replace(a.settings, progress_seconds=0.05)
    try:
        long_sp = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
        ids = token_prompts(5, seed=133)
        # static splits the five in order, two and three: one worker gets the two short ones and
        # idles at once, the other the three long ones
        assert len(core.workers) == 2, sorted(core.workers)
        prompts = [Prompt(f"short-{i}", token_ids=ids[i], max_tokens=4) for i in range(2)]
        prompts += [Prompt(f"long-{i}", token_ids=ids[i]) for i in range(2, 5)]
        result = await asyncio.wait_for(client.generate("moves-1", prompts, long_sp, policy_version=core.version,
                                                        policy=SchedulingPolicy.STATIC), 300)
    finally:
        core.settings = kept
        for a, settings in agents.items():
            a.settings = settings
    assert result.summary.requests_moved >= 1, result.summary
    for c, p in zip(result.completions, prompts):
        want = await _final(cluster.engines[1], EngineRequest(f"mv-ref-{p.prompt_id}", p.token_ids,
                                                               replace(long_sp, max_tokens=p.max_tokens or 480),
                                                               use_drafts=False))
        assert c.token_ids == want.token_ids, p.prompt_id
        assert c.text == want.text, p.prompt_id
        assert c.provenance.forward_passes <= len(c.token_ids) <= c.provenance.forward_passes + c.provenance.accepted()
    short_worker = result.completions[0].worker_id
    assert any(c.worker_id == short_worker for c in result.completions if c.prompt_id.startswith("long"))
