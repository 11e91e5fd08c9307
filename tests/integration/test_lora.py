"""LoRA adapters served by real vLLM CPU engines through the scheduler's vLLM routes.

A tiny adapter is made here (``bench/tiny_lora.py``: PEFT's format, no PEFT needed) for the tiny
model. One speculative worker with LoRA on (``EngineSettings.enable_lora``) and the Redis draft
store, beside a plain vLLM engine with LoRA on and no speculation: the ground truth. The shared
``cluster`` does not run with LoRA: on a CPU engine LoRA turns torch.compile off, which would
change the engines every other test compares with vLLM. Cost: two engine starts, in parallel.

Checked: greedy completions naming the adapter equal plain vLLM's with the same adapter, and
differ from the base model's; base-model requests are unaffected; a reload is the next version;
drafts never cross adapters or versions (history drafts of the base model, and of an earlier
version, are not offered to the adapter's requests: the completions' draft provenance and the
store's keys say so); a bad path fails naming ``lora_path`` with nothing changed; prime-rl's
``/load_lora_adapter`` (in place, ``{"status": "ok"}``) is the next version; after an
unload a request naming the adapter is a 404; ``/server_info``'s ``lora_config`` is what plain
vLLM reports for the same LoRA settings.
"""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from bubblespec.bench.tiny_lora import build_tiny_lora
from bubblespec.cli.commands import Cluster
from bubblespec.common.types import Completion, SamplingParams
from bubblespec.scheduler.core.types import Deliver
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.store import StoreSettings, open_store, prompt_key
from bubblespec.worker.engine import EngineRequest, VllmEngine
from tests.integration.conftest import engine_settings

PROMPTS = [(1, 40, 41, 42, 43, 44), (1, 60, 70, 80), (1, 33, 34, 35, 36, 37, 38, 39)]
MAX_TOKENS = 24


class Lora:
    """The LoRA cluster, its HTTP client, the reference engine and the completions delivered."""

    def __init__(self, cluster: Cluster, reference: VllmEngine, adapter: str, store):
        self.cluster, self.reference, self.adapter, self.store = cluster, reference, adapter, store
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.scheduler.http_port}", timeout=300)
        self.delivered: list[Completion] = []
        cluster.scheduler.service.listeners.append(
            lambda a: self.delivered.append(a.completion) if isinstance(a, Deliver) else None)

    async def complete(self, model: str, prompt: tuple[int, ...]) -> tuple[httpx.Response, Completion | None]:
        """One greedy completion; the core's completion of it (with its provenance)."""
        before = len(self.delivered)
        body = {"model": model, "prompt": list(prompt), "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True}
        r = await self.http.post("/v1/completions", json=body)
        return r, (self.delivered[before] if len(self.delivered) > before else None)

    async def reference_tokens(self, prompt: tuple[int, ...], adapter: tuple[str, int] | None) -> tuple[int, ...]:
        request = EngineRequest(f"ref-{adapter}-{prompt}", prompt, SamplingParams(temperature=0.0,
                                max_tokens=MAX_TOKENS), (), False, adapter=adapter)
        outs = [out async for out in self.reference.generate(request)]
        assert outs and outs[-1].finish_reason is not None
        return outs[-1].token_ids

    async def stored(self, prompt: tuple[int, ...], adapter: tuple[str, int] | None) -> list:
        key = prompt_key(prompt, adapter)
        return (await self.store.get_drafts([key]))[key]

    async def remembered(self, prompt: tuple[int, ...], adapter: tuple[str, int] | None, count: int = 1) -> None:
        """Wait until the worker stored ``count`` history drafts of ``prompt`` under ``adapter``."""
        for _ in range(500):
            if len(await self.stored(prompt, adapter)) >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"no history draft of {prompt} under {adapter} was stored")


def drafted(c: Completion, source: str) -> int:
    return sum(s.drafted_tokens for s in c.provenance.sources if s.source == source)


@pytest.fixture(scope="module")
async def lora(tiny_model, redis_server, tmp_path_factory):
    adapter = str(build_tiny_lora(tmp_path_factory.mktemp("lora") / "math", base_model=tiny_model))
    settings = SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0, tokenizer=tiny_model)
    store_settings = StoreSettings(url=redis_server.url, op_timeout_seconds=2.0, retry_after_seconds=1.0)
    cluster = Cluster(settings, engine_settings(tiny_model, enable_lora=True, max_loras=2), workers=1,
                      store_settings=store_settings)
    reference = VllmEngine(engine_settings(tiny_model, num_speculative_tokens=0, enable_lora=True, max_loras=2))
    await asyncio.gather(cluster.start(), reference.start())
    await reference.control("load_lora_adapter", {"lora_name": "math", "lora_path": adapter, "version": 1,
                                                  "lora_int_id": 1})
    store = open_store(store_settings)
    lo = Lora(cluster, reference, adapter, store)
    yield lo
    await lo.http.aclose()
    await store.close()
    await reference.shutdown()
    await cluster.stop()


async def test_server_info_carries_the_lora_config_plain_vllm_reports(lora):
    from vllm.entrypoints.serve.dev.server_info.api_router import PydanticVllmConfig

    # what vLLM 0.32's /server_info?config_format=json answers for an engine with the same LoRA settings
    expected = PydanticVllmConfig.dump_python(lora.reference._llm.vllm_config, mode="json", fallback=str)["lora_config"]
    assert expected is not None and expected["max_loras"] == 2
    r = await lora.http.get("/server_info", params={"config_format": "json"})
    assert r.status_code == 200 and r.json()["vllm_config"]["lora_config"] == expected, (r.json(), expected)


async def test_adapter_completions_equal_plain_vllms_with_the_adapter_and_drafts_never_cross(lora):
    base = (await lora.http.get("/v1/models")).json()["data"][0]["id"]
    # the base model first, twice: its second request gets the first one's history draft
    for prompt in PROMPTS:
        for i in range(2):
            r, c = await lora.complete(base, prompt)
            assert r.status_code == 200, r.text
            assert tuple(r.json()["choices"][0]["token_ids"]) == await lora.reference_tokens(prompt, None)
            await lora.remembered(prompt, None, i + 1)
    assert c is not None and drafted(c, "history") > 0, c.provenance  # history drafting is on for the base model

    r = await lora.http.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": lora.adapter})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'math' added successfully."
    models = (await lora.http.get("/v1/models")).json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models[1:]] == [("math", base, lora.adapter)]

    differ = 0
    for prompt in PROMPTS:
        expected = await lora.reference_tokens(prompt, ("math", 1))
        differ += expected != await lora.reference_tokens(prompt, None)
        r, c = await lora.complete("math", prompt)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "math" and r.headers["X-BubbleSpec-Adapter-Version"] == "1"
        assert tuple(r.json()["choices"][0]["token_ids"]) == expected  # exact: plain vLLM's with the adapter
        assert c is not None and (c.adapter, c.adapter_version) == ("math", 1)
        assert c.policy_version == 0  # the base model's version
        assert drafted(c, "history") == 0, c.provenance  # the base model's history is not the adapter's
        await lora.remembered(prompt, ("math", 1))
    assert differ == len(PROMPTS)  # the adapter changes what the model says

    # its own history: the same version's earlier answer, drafted and accepted
    stored = await lora.stored(PROMPTS[0], ("math", 1))
    assert stored and stored[0].tokens == await lora.reference_tokens(PROMPTS[0], ("math", 1))
    r, c = await lora.complete("math", PROMPTS[0])
    assert r.status_code == 200 and c is not None and drafted(c, "history") > 0
    assert tuple(r.json()["choices"][0]["token_ids"]) == stored[0].tokens

    # base-model requests unaffected after the load
    for prompt in PROMPTS:
        r, _ = await lora.complete(base, prompt)
        assert tuple(r.json()["choices"][0]["token_ids"]) == await lora.reference_tokens(prompt, None)


async def test_reload_is_the_next_version_and_drafts_of_the_previous_are_not_offered(lora):
    r = await lora.http.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": lora.adapter,
                                                            "load_inplace": True})
    assert r.status_code == 200, r.text
    r, c = await lora.complete("math", PROMPTS[0])
    assert r.status_code == 200 and r.headers["X-BubbleSpec-Adapter-Version"] == "2"
    assert c is not None and c.adapter_version == 2
    assert await lora.stored(PROMPTS[0], ("math", 1))  # version 1's history is there ...
    assert drafted(c, "history") == 0, c.provenance  # ... and not offered to version 2
    assert tuple(r.json()["choices"][0]["token_ids"]) == await lora.reference_tokens(PROMPTS[0], ("math", 1))


async def test_a_bad_path_fails_naming_the_field_and_changes_nothing(lora, tmp_path):
    async def cards() -> list[dict]:  # ``created`` is the listing's time, as in vLLM's: not compared
        return [{k: v for k, v in m.items() if k != "created"} for m in (await lora.http.get("/v1/models")).json()["data"]]

    before = await cards()
    for path in (str(tmp_path / "missing"), str(tmp_path)):  # no directory; a directory with no adapter
        r = await lora.http.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": path})
        assert r.status_code in (404, 500), r.text
        err = r.json()["error"]
        assert "worker-0" in err["message"] and "served on no worker" in err["message"], err
        if path.endswith("missing"):
            assert err["param"] == "lora_path" and r.status_code == 404, err
    assert await cards() == before
    r, _ = await lora.complete("other", PROMPTS[0])
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r, c = await lora.complete("math", PROMPTS[1])  # the loaded adapter is as it was
    assert r.status_code == 200 and r.headers["X-BubbleSpec-Adapter-Version"] == "2"


async def test_prime_rls_load_route_reloads_in_place_as_the_next_version(lora, tmp_path):
    # prime-rl's orchestrator (prime_rl.utils.client.load_lora_adapter) after each step of a LoRA run:
    # the same name, the step's own directory, no load_inplace (its server wrapper forces it)
    step_dir = shutil.copytree(lora.adapter, tmp_path / "step_3")
    r = await lora.http.post("/load_lora_adapter", json={"lora_name": "math", "lora_path": str(step_dir)})
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
    r, c = await lora.complete("math", PROMPTS[2])
    assert r.status_code == 200 and r.headers["X-BubbleSpec-Adapter-Version"] == "3"
    assert c is not None and c.adapter_version == 3
    assert tuple(r.json()["choices"][0]["token_ids"]) == await lora.reference_tokens(PROMPTS[2], ("math", 1))
    r = await lora.http.post("/load_lora_adapter", json={"lora_name": "math", "lora_path": str(tmp_path / "step_4")})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path", r.text  # prime-rl retries a 404
    r, _ = await lora.complete("math", PROMPTS[2])
    assert r.status_code == 200 and r.headers["X-BubbleSpec-Adapter-Version"] == "3"  # unchanged


async def test_unload_then_a_request_naming_it_is_404(lora):
    r = await lora.http.post("/v1/unload_lora_adapter", json={"lora_name": "math"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'math' removed successfully."
    r, _ = await lora.complete("math", PROMPTS[0])
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `math` does not exist."
    assert [m["id"] for m in (await lora.http.get("/v1/models")).json()["data"][1:]] == []
    assert lora.cluster.engines[0].loras.held == {}
