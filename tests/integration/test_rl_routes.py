"""vLLM's RL control routes on the real cluster (two vLLM CPU workers, real gRPC), over HTTP:
world size, prime-rl's weight update (``pause?mode=keep`` -> ``update_weights {weight_dir}`` ->
``resume``), and a step in flight across that sequence.

The cluster is shared by the session: every test leaves it resumed, at a fresh version loaded
from the tiny model (what the other modules expect).
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from bubblespec.client.types import Prompt, SamplingParams
from bubblespec.bench.tiny_model import perturb_weights
from tests.factories import token_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _http(cluster) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.scheduler.http_port}", timeout=600)


async def _post(http: httpx.AsyncClient, path: str, **kw) -> dict:
    r = await http.post(path, **kw)
    assert r.status_code == 200, r.text
    return r.json()


async def _greedy(http: httpx.AsyncClient, prompts) -> list[tuple[int, ...]]:
    body = await _post(http, "/v1/completions", json={"prompt": [list(p) for p in prompts], "max_tokens": 16,
                                                     "temperature": 0.0, "return_token_ids": True})
    return [tuple(c["token_ids"]) for c in body["choices"]]


@contextlib.asynccontextmanager
async def _restored(cluster, tiny_model: str):
    """Whatever happens inside: resumed, then a fresh version from the tiny model."""
    try:
        yield
    finally:
        async with _http(cluster) as http:
            await _post(http, "/resume")
            await _post(http, "/update_weights", json={"weight_dir": tiny_model})


async def test_world_size_counts_the_workers_ranks(cluster):
    async with _http(cluster) as http:
        r = await http.get("/get_world_size")
        assert r.json() == {"world_size": len(cluster.scheduler.core.workers)} == {"world_size": 2}
        info = (await http.get("/server_info", params={"config_format": "json"})).json()["vllm_config"]
        assert info["parallel_config"]["world_size"] == 2
        assert info["model_config"]["logprobs_mode"] == "processed_logprobs"


async def test_prime_rl_update_sequence_changes_and_restores_greedy_output(cluster, tiny_model, tmp_path):
    core = cluster.scheduler.core
    prompts = token_prompts(4, seed=71)
    perturbed = str(perturb_weights(tiny_model, tmp_path / "perturbed", scale=0.05, seed=1))
    async with _restored(cluster, tiny_model), _http(cluster) as http:
        v0 = core.version
        before = await _greedy(http, prompts)
        assert await _post(http, "/pause", params={"mode": "keep", "clear_cache": "false"}) == {"status": "paused"}
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
        r = await http.post("/v1/completions", json={"prompt": [list(prompts[0])], "max_tokens": 4})
        assert r.status_code == 503 and "paused" in r.json()["error"]["message"]
        done = await _post(http, "/update_weights", json={"weight_dir": perturbed})
        assert done == {"status": "ok", "policy_version": v0 + 1, "workers": 2}
        assert await _post(http, "/resume") == {"status": "resumed"}
        changed = await _greedy(http, prompts)
        assert changed != before
        await _post(http, "/pause", params={"mode": "keep"})
        assert (await _post(http, "/update_weights", json={"weight_dir": tiny_model}))["policy_version"] == v0 + 2
        await _post(http, "/resume")
        assert await _greedy(http, prompts) == before  # going back restores it token for token
        assert (core.version, core.weights_path) == (v0 + 2, tiny_model)


async def test_a_step_kept_across_an_update_finishes_at_the_new_version(cluster, client, tiny_model, tmp_path):
    core = cluster.scheduler.core
    ids = token_prompts(7, seed=73)
    prompts = [Prompt("short", token_ids=ids[0], max_tokens=1)] + [
        Prompt(f"long{i}", token_ids=t) for i, t in enumerate(ids[1:])]
    sampling = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    perturbed = str(perturb_weights(tiny_model, tmp_path / "perturbed", scale=0.05, seed=2))
    async with _restored(cluster, tiny_model), _http(cluster) as http:
        v0 = core.version
        step = f"rl-keep-v{v0}"
        first = asyncio.Event()
        got = []

        async def consume():
            async for c in client.stream(step, prompts, sampling, policy_version=v0):
                got.append(c)
                first.set()

        stream = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 300)  # the 1-token prompt is done; the others run
        await _post(http, "/pause", params={"mode": "keep"})
        kept = core.steps[step]
        before = {c.prompt_id for c in kept.completions.values()}  # delivered before the pause
        assert kept.active and len(before) < len(prompts), "the step ended before the pause: nothing was kept"
        assert not any(w.running for w in core.workers.values())  # aborted on the workers, queued again
        assert (await _post(http, "/update_weights", json={"weight_dir": perturbed}))["policy_version"] == v0 + 1
        await _post(http, "/resume")
        await asyncio.wait_for(stream, 600)
        assert sorted(c.prompt_id for c in got) == sorted(p.prompt_id for p in prompts)  # each once
        for c in got:  # delivered before the pause: the old version; the rest ran again under the new one
            assert c.policy_version == (v0 if c.prompt_id in before else v0 + 1)
        assert kept.summary.policy_version == v0 + 1
        reference = await client.generate(f"rl-keep-ref-v{v0 + 1}", prompts, sampling, policy_version=v0 + 1)
        expected = {c.prompt_id: c.token_ids for c in reference.completions}
        rerun = [c for c in got if c.policy_version == v0 + 1]
        assert rerun and all(c.token_ids == expected[c.prompt_id] for c in rerun)  # from scratch at the new weights
