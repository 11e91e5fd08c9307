"""vLLM's RL control routes on the real cluster (two vLLM CPU workers, real gRPC), over HTTP:
world size, prime-rl's weight update (``pause?mode=keep`` -> ``update_weights {weight_dir}`` ->
``resume``), a step in flight across that sequence, and independent HTTP calls in flight across
each pause mode (``core/pool.py``).

The cluster is shared by the session: every test leaves it resumed, at a fresh version loaded
from the tiny model (what the other modules expect).
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from bubblespec.common.types import Prompt, SamplingParams
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
        waiting = asyncio.create_task(http.post("/v1/completions", json={  # as vllm serve: it waits for /resume
            "prompt": [list(prompts[0])], "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        done = await _post(http, "/update_weights", json={"weight_dir": perturbed})
        assert done == {"status": "ok", "policy_version": v0 + 1, "workers": 2}
        assert await _post(http, "/resume") == {"status": "resumed"}
        changed = await _greedy(http, prompts)
        assert changed != before
        r = await waiting  # it ran after the resume, under the new weights
        assert r.status_code == 200 and tuple(r.json()["choices"][0]["token_ids"]) == changed[0][:4]
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


async def _long_calls(http: httpx.AsyncClient, prompts, max_tokens: int = 480) -> list[asyncio.Task]:
    """One greedy call per prompt on vLLM's token-in/token-out route, started now."""
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return [asyncio.create_task(http.post("/inference/v1/generate", json={"token_ids": list(p),
                                                                          "sampling_params": sampling}))
            for p in prompts]


async def _choice(task: asyncio.Task) -> dict:
    r = await task
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


async def _until_running(core, count: int) -> None:
    """Until ``count`` of the calls run on workers, and a moment more for them to make tokens
    (progress reports come every 0.5 s: too rarely to wait on)."""
    for _ in range(3000):
        pool = core.steps.get("requests")
        if pool is not None and sum(1 for r in pool.requests.values() if r.worker) >= count:
            await asyncio.sleep(0.3)
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the calls never ran")


async def test_calls_kept_across_an_update_go_on_from_their_tokens_and_report_each_spans_version(cluster, tiny_model):
    """pause(keep) -> update_weights -> resume with calls in flight: each goes on from the tokens
    it had, under the new version, and says which version made which tokens (vLLM's
    ``weight_versions``). The new version loads the same weights again, so every token is still
    exactly the greedy reference's (the continuation is exact), and the spans are visible."""
    core = cluster.scheduler.core
    prompts = token_prompts(8, seed=79)
    async with _restored(cluster, tiny_model), _http(cluster) as http:
        v0 = core.version
        expected = [tuple((await _choice(t))["token_ids"]) for t in await _long_calls(http, prompts)]
        calls = await _long_calls(http, prompts)
        await _until_running(core, 8)
        await _post(http, "/pause", params={"mode": "keep"})
        assert (await _post(http, "/update_weights", json={"weight_dir": tiny_model}))["policy_version"] == v0 + 1
        await _post(http, "/resume")
        answers = [await _choice(t) for t in calls]
        assert [tuple(a["token_ids"]) for a in answers] == expected  # exact across the stop and the new version
        versions = [[(s["version"], s["start"], s["end"]) for s in a["weight_versions"]] for a in answers]
        assert sum(len(v) == 2 for v in versions) >= 2, versions  # the ones running at the pause span two
        for v in versions:
            assert v[0][1] == 0 and v[-1][2] == 480  # the whole response
            assert all(a[2] == b[1] for a, b in zip(v, v[1:]))  # contiguous
            # the old version's tokens, then the new one's; a call that ended before the pause took
            # effect (fast cores, 480 tokens) is the old version's alone
            assert [s[0] for s in v] in ([str(v0), str(v0 + 1)], [str(v0)]), versions


async def test_calls_aborted_by_a_pause_answer_with_their_tokens_and_finish_reason_abort(cluster, tiny_model):
    core = cluster.scheduler.core
    prompts = token_prompts(8, seed=83)
    async with _restored(cluster, tiny_model), _http(cluster) as http:
        calls = await _long_calls(http, prompts)
        await _until_running(core, 8)
        await _post(http, "/pause", params={"mode": "abort"})
        choices = [await _choice(t) for t in calls]
        assert all(c["finish_reason"] == "abort" for c in choices)
        assert sum(0 < len(c["token_ids"]) < 480 for c in choices) >= 2  # partials, not nothing
        await _post(http, "/resume")
        full = [tuple((await _choice(t))["token_ids"]) for t in await _long_calls(http, prompts)]
        for c, f in zip(choices, full):
            assert tuple(c["token_ids"]) == f[:len(c["token_ids"])]  # what it had: the greedy output's start
        assert core.steps.get("requests") is None


async def test_a_caller_that_disconnects_mid_stream_frees_its_worker(cluster, tiny_model):
    """A streamed call whose client goes away: its request is aborted on the worker's engine
    (nothing runs on for nobody) and the next call is served as usual."""
    cancelled: list[str] = []
    for agent in cluster.agents:  # what the workers are told to stop, on the way to their engines
        agent.runner.cancel = _recording(agent.runner.cancel, cancelled)
    try:
        await _disconnect_mid_stream(cluster, tiny_model, cancelled)
    finally:
        for agent in cluster.agents:
            del agent.runner.cancel  # the class's own again


async def _disconnect_mid_stream(cluster, tiny_model, cancelled: list[str]) -> None:
    core = cluster.scheduler.core
    [prompt] = token_prompts(1, seed=89)
    body = {"token_ids": list(prompt), "stream": True,
            "sampling_params": {"max_tokens": 480, "temperature": 0.0, "ignore_eos": True}}
    async with _restored(cluster, tiny_model), _http(cluster) as http:
        async with http.stream("POST", "/inference/v1/generate", json=body) as r:
            assert r.status_code == 200
            await _until_running(core, 1)
            [key] = core.steps["requests"].requests
        for _ in range(500):  # the connection is closed: the scheduler aborts the request
            if core.steps.get("requests") is None and not any(w.running for w in core.workers.values()):
                break
            await asyncio.sleep(0.01)
        assert core.steps.get("requests") is None and not any(w.running for w in core.workers.values())

        def in_engines() -> list[str]:  # vLLM's own requests, by their external id (the request key)
            return [state.external_req_id for engine in cluster.engines
                    for state in engine._llm.output_processor.request_states.values() if state.external_req_id == key]

        for _ in range(500):  # and the workers' engines let go of it
            if not in_engines():
                break
            await asyncio.sleep(0.01)
        assert in_engines() == [] and key in cancelled
        short = await _choice((await _long_calls(http, [prompt], max_tokens=4))[0])
        assert len(short["token_ids"]) == 4


def _recording(cancel, into: list[str]):
    async def recorded(key: str) -> None:
        into.append(key)
        await cancel(key)
    return recorded
