"""Load-generator options of ``bubblespec loadtest`` end to end (real scheduler process, real
gRPC, simulated engines, no Redis): agents without a draft store, and the agents' completion
window set from the load test. No vLLM here."""

from __future__ import annotations

import pytest
from bubblespec.cli.loadtest import LoadSettings, run_loadtest


@pytest.mark.timeout(120)
async def test_agents_without_a_draft_store_deliver_every_completion_once():
    settings = LoadSettings(workers=8, steps=2, prompts=32, samples=2, capacity=2, max_tokens=32, median_tokens=8,
                            step_seconds=0.002, batch_slope_seconds=0.0, worker_processes=2, redis_url="memory",
                            worker_store="none", completion_batch_seconds=0.0)
    result = await run_loadtest(settings)
    per_step = settings.prompts * settings.samples
    for r in result.steps:
        assert (r.completions, r.duplicates, r.missing) == (per_step, 0, 0)
        assert r.worker_completions_sent == per_step and r.unmatched_assignments == 0
    s = result.summary
    assert s["completions"] == s["metrics_completions_total"] == 2 * per_step
    assert s["worker_store"]["ops"] == 0  # no store: no draft reads, no recorded responses
    assert result.settings["completion_batch_seconds"] == 0.0


@pytest.mark.timeout(60)
async def test_a_negative_completion_window_is_refused_naming_it():
    with pytest.raises(ValueError, match="completion_batch_seconds"):
        await run_loadtest(LoadSettings(workers=2, steps=1, redis_url="memory", completion_batch_seconds=-1.0))
