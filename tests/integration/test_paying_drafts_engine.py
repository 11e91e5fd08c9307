"""Draft length by cost on real vLLM CPU engines (``EngineSettings.draft_token_seconds``): the
setting reaches the proposer in the engine's process; with a cheap draft token the engine drafts
and greedy outputs stay token-identical to speculation off (every arm of
``check_greedy_identity``); with a draft token that costs more than a whole pass saves, the
engine drafts nothing even from perfect drafts, and the outputs are the same. With no cost given,
an engine measures it from its own passes (on a model large enough for the clock to see it)."""

from __future__ import annotations

import pytest

from bubblespec.bench.tiny_model import build_tiny_model
from bubblespec.client import SamplingParams
from bubblespec.worker.engine import EngineSettings, VllmEngine
from tests.factories import token_prompts
from tests.integration.conftest import engine_settings
from tests.support.exactness import check_greedy_identity, check_provenance, run_engine

pytestmark = pytest.mark.vllm
CPU_TINY_DRAFT_TOKEN = 6.24e-5  # a draft token of the bench's model, by the 2026-11-22 calibration (bench/sim/costs.py)


@pytest.fixture(scope="module")
async def paying_engine(tiny_model):
    """Speculation with the paying rule at the cost measured on this machine (memory-bound)."""
    engine = VllmEngine(engine_settings(tiny_model, num_speculative_tokens=8, draft_token_seconds=CPU_TINY_DRAFT_TOKEN))
    await engine.start()
    yield engine
    await engine.shutdown()


async def test_greedy_is_token_identical_with_the_paying_rule_on(reference_engine, paying_engine, tiny_model, tmp_path):
    await check_greedy_identity(reference_engine, paying_engine, tiny_model, tmp_path)


async def test_a_draft_token_that_never_pays_turns_drafting_off(reference_engine, tiny_model):
    # one second per draft token: cost x tokens/s is far above 1, so no draft token can pay
    engine = VllmEngine(engine_settings(tiny_model, num_speculative_tokens=8, draft_token_seconds=1.0))
    await engine.start()
    try:
        prompts = token_prompts(8, seed=31)
        sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        expected = [o.token_ids for o in await run_engine(reference_engine, prompts, sp, tag="ref")]
        perfect = [[("future", e)] for e in expected]
        # until the engine has measured a step it drafts by acceptance alone: a first batch measures it
        await run_engine(engine, prompts[:2], sp, perfect[:2], tag="warm")
        outs = await run_engine(engine, prompts, sp, perfect, tag="dear")
        assert [o.token_ids for o in outs] == expected
        drafted, _ = check_provenance(outs, drafts_on=True, arm="dear")
        assert drafted == 0, f"{drafted} draft tokens proposed where none could pay"
        assert [o.provenance.forward_passes for o in outs] == [len(e) for e in expected]  # one token per pass
    finally:
        await engine.shutdown()


@pytest.fixture(scope="module")
def measurable_model(tmp_path_factory) -> str:
    """A model whose draft token the clock can see: on the tiny test model (361k parameters) a
    draft token adds 1-4e-5 s to a pass that jitters by ~1 ms on these cores, so over the fit's
    ~200-pass memory its estimate stays sure (25%) only now and then (a CI run saw 759 clean
    passes without one). Three times the width and twice the depth (6.0M parameters) make a
    draft token 3.5e-5 to 1.2e-4 s, sure at 15 of 16 refits here (1.5-2.1e-4 s and sure at
    every refit with a core taken by another process)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("measurable") / "model", hidden_size=384, num_layers=4))


async def test_an_engine_measures_its_draft_tokens_cost_and_stays_exact(measurable_model):
    """An engine at the worker's defaults (no cost given: ``measure_draft_cost``; the default
    draft length) fits what a draft token adds to its passes from its own clean passes, and says
    so (``draft_cost``); the outputs stay token-identical to an engine without speculation
    throughout."""
    reference = VllmEngine(engine_settings(measurable_model, num_speculative_tokens=0))
    engine = VllmEngine(engine_settings(measurable_model, measure_draft_cost=True,
                                        num_speculative_tokens=EngineSettings.num_speculative_tokens))
    await reference.start()
    try:
        await engine.start()
        try:
            await _measures_and_stays_exact(reference, engine)
        finally:
            await engine.shutdown()
    finally:
        await reference.shutdown()


async def _measures_and_stays_exact(reference_engine, engine) -> None:
    prompts = token_prompts(24, seed=37)
    sp = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    expected = [o.token_ids for o in await run_engine(reference_engine, prompts, sp, tag="ref")]
    # drafts of a quarter of the requests cover nothing, the others a third, two thirds, all of
    # the response: the steps' draft tokens vary apart from their batch sizes
    drafts = [[("future", e[: len(e) * (i % 4) // 3])] for i, e in enumerate(expected)]
    cost: dict = {}
    for attempt in range(8):
        await engine.control("reset_prefix_cache", {})  # the drafts above only, not the last attempt's responses
        outs = await run_engine(engine, prompts, sp, drafts, tag=f"cost{attempt}")
        assert [o.token_ids for o in outs] == expected, f"attempt {attempt}: a measured cost changed an output"
        check_provenance(outs, drafts_on=True, arm=f"cost{attempt}")
        cost = await engine.draft_cost()
        if cost["draft_token_seconds"] > 0:
            break
    print(f"measured draft token cost: {cost}")
    assert cost["source"] == "measured" and cost["steps"] >= 64, cost
    # 3.5e-5 to 1.2e-4 s a draft token here (1.5-2.1e-4 with a core taken); a figure off by
    # orders of magnitude is a broken fit, not a slow machine
    assert 1e-6 < cost["draft_token_seconds"] < 1e-3, cost
