"""TRL's own server-mode client (``trl.generation.vllm_client.VLLMClient``, unmodified) pointed at
the real cluster's HTTP port, as ``GRPOTrainer(vllm_mode="server")`` uses it.

TRL's client is blocking (``requests``) and the scheduler runs on this test's event loop, so
every TRL call runs in a thread. Greedy outputs are compared token for token with
``bubblespec.client`` at the same policy version and with plain vLLM (no speculation).
"""

from __future__ import annotations

import asyncio

import pytest

from bubblespec.common.types import SamplingParams
from bubblespec.worker.engine import EngineRequest
from tests.factories import token_prompts

pytest.importorskip("trl")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


async def _trl(cluster):
    from trl.generation.vllm_client import VLLMClient

    url = f"http://127.0.0.1:{cluster.scheduler.http_port}"
    return await asyncio.to_thread(VLLMClient, base_url=url, connection_timeout=30)


async def _reference(engine, prompts) -> list[list[int]]:
    async def one(i, p):
        final = None
        async for out in engine.generate(EngineRequest(f"trl-ref-{i}", tuple(p), GREEDY)):
            final = out
        return list(final.token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def _serves_start_weights(cluster, tiny_model) -> bool:
    return cluster.scheduler.core.weights_path in ("", tiny_model)


async def test_construction_world_size_and_server_info(cluster):
    trl = await _trl(cluster)  # GET /health, then GET /v1/models for the model name
    assert trl.model == cluster.scheduler.settings.model_name()
    assert await asyncio.to_thread(trl.get_world_size) == len(cluster.scheduler.core.workers) == 2
    info = await asyncio.to_thread(trl.get_server_info)
    # what GRPOTrainer reads before enabling its importance-sampling correction
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"


async def test_greedy_token_id_prompts_match_bubblespec_client_and_plain_vllm(cluster, client, reference_engine,
                                                                             tiny_model):
    prompts = [list(p) for p in token_prompts(4, seed=911)]
    trl = await _trl(cluster)
    v = cluster.scheduler.core.version
    out = await asyncio.to_thread(trl.generate, prompts, n=2, temperature=0.0, max_tokens=GREEDY.max_tokens,
                                  logprobs=0)
    assert out["prompt_ids"] == prompts  # one per prompt: TRL takes choices[::n]
    assert len(out["completion_ids"]) == 8  # prompt-major, n per prompt
    greedy = out["completion_ids"][::2]
    assert out["completion_ids"][1::2] == greedy  # greedy: every sample of a prompt is the same
    ref = await client.generate(f"trl-greedy-ref-v{v}", prompts, GREEDY, policy_version=v)
    assert greedy == [list(c.token_ids) for c in ref.completions]
    # logprobs=0: the sampled token's logprob only, as [[lp], ...] with its id (TRL parses "token_id:<id>")
    for ids, lps, lp_ids, c in zip(out["completion_ids"][::2], out["logprobs"][::2], out["logprob_token_ids"][::2],
                                   ref.completions):
        assert lp_ids == [[t] for t in ids]
        assert [x[0] for x in lps] == pytest.approx(list(c.logprobs), abs=1e-5)
    if _serves_start_weights(cluster, tiny_model):  # plain vLLM (no speculation) runs the start weights
        assert greedy == await _reference(reference_engine, prompts)


async def test_text_prompts_and_sampling_with_generation_kwargs(cluster, client):
    trl = await _trl(cluster)
    texts = ["The quick brown fox", "Once upon a time"]
    v = cluster.scheduler.core.version
    out = await asyncio.to_thread(trl.generate, texts, n=1, temperature=0.0, max_tokens=GREEDY.max_tokens)
    ref = await client.generate(f"trl-text-ref-v{v}", texts, GREEDY, policy_version=v)
    assert out["completion_ids"] == [list(c.token_ids) for c in ref.completions]
    assert out["prompt_ids"] == [list(cluster.scheduler.service.tokenize(t)) for t in texts]
    # sampling, seeded through generation_kwargs (sent as-is in the body), n = 3
    sampled = await asyncio.to_thread(trl.generate, [[5, 17, 23]], n=3, temperature=1.0, max_tokens=6,
                                      generation_kwargs={"seed": 123, "ignore_eos": True})
    assert [len(c) for c in sampled["completion_ids"]] == [6, 6, 6]
    assert all(lp[0] is not None and lp[0] <= 0 for seq in sampled["logprobs"] for lp in seq)
