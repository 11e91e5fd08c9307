"""The request fields BubbleSpec serves, on real engines with speculative drafts on: greedy results
equal those of the reference engine (no speculation) given the same fields, token for token,
with the same ``stop_reason`` and text. Each prompt first runs once plain, so that its later
requests get that response as a (perfect) history draft and verify many tokens per pass.

``min_tokens`` needs the proposer's cap (``RequestDrafter.propose``): vLLM 0.32 masks stop tokens
at the position after the drafts by the output length before them, so a draft that reached
``min_tokens`` would keep a stop token from where it is allowed (docs/EXACTNESS.md)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import httpx
import pytest

from bubblespec.client import SamplingParams
from bubblespec.worker.engine import EngineOutput, EngineRequest
from tests.factories import token_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = token_prompts(3, seed=4242)
BASE = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SPECIAL = {0, 1, 2, 3}  # the tiny tokenizer's <pad>, <s>, </s>, <unk>


async def _reference(engine, prompt, sp: SamplingParams) -> EngineOutput:
    outputs = [o async for o in engine.generate(EngineRequest(f"ref-{uuid.uuid4().hex}", tuple(prompt), sp))]
    assert outputs and outputs[-1].finish_reason is not None
    return outputs[-1]


async def _cluster(client, cluster, prompts, sp: SamplingParams, **kw):
    v = cluster.scheduler.core.version
    return await client.generate(f"fields-{uuid.uuid4().hex[:12]}", [tuple(p) for p in prompts], sp,
                                 policy_version=v, **kw)


def _http(cluster) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.scheduler.http_port}", timeout=300)


@pytest.fixture(scope="module")
async def plain(cluster, client, reference_engine):
    """Each prompt's plain greedy response (16 tokens, EOS ignored), the same on both sides; it
    is each prompt's history draft from here on."""
    out = await _cluster(client, cluster, PROMPTS, BASE)
    ref = await asyncio.gather(*(_reference(reference_engine, p, BASE) for p in PROMPTS))
    assert [c.token_ids for c in out.completions] == [r.token_ids for r in ref], "the cluster does not serve the " \
        "reference engine's weights"
    return [c.token_ids for c in out.completions]


async def test_min_tokens_with_stop_tokens_is_exact_with_drafts(cluster, client, reference_engine, plain):
    """For each prompt and each position s whose token t first appears there, min_tokens = s with
    stop token t: the stop token is masked before s and allowed from s on, where the drafts (the
    plain response) reach across s. Also min_tokens past EOS, with EOS not ignored."""
    cases = [(p, replace(BASE, ignore_eos=False, min_tokens=s, stop_token_ids=(ids[s],)))
             for p, ids in zip(PROMPTS, plain) for s in range(2, 12) if ids[s] not in ids[:s]]
    cases += [(p, replace(BASE, ignore_eos=False, min_tokens=m)) for p in PROMPTS for m in (5, 16)]
    assert len(cases) >= 20
    ours = await asyncio.gather(*(_cluster(client, cluster, [p], sp) for p, sp in cases))
    refs = await asyncio.gather(*(_reference(reference_engine, p, sp) for p, sp in cases))
    stopped = 0
    for (_, sp), out, ref in zip(cases, ours, refs):
        [c] = out.completions
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (ref.token_ids, ref.finish_reason, ref.stop_reason), sp
        assert len(c.token_ids) >= sp.min_tokens
        stopped += c.stop_reason is not None
        assert c.stop_reason in (None, *sp.stop_token_ids)
    assert stopped >= 10, "stop tokens ended few responses: the check saw little"
    assert sum(out.summary.provenance.accepted() for out in ours) > 100, "drafts were hardly used"


async def test_stop_strings_stop_reason_and_include_stop_str_in_output_over_http(cluster, reference_engine, plain):
    text = (await _reference(reference_engine, PROMPTS[0], BASE)).text
    at = next(i for i in range(4, len(text) - 2) if text[i:i + 2] not in text[:i + 1])
    stop = text[at:at + 2]
    async with _http(cluster) as http:
        for include in (False, True):
            sp = replace(BASE, stop=(stop,), include_stop_str_in_output=include)
            body = {"prompt": list(PROMPTS[0]), "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": stop,
                    "include_stop_str_in_output": include, "return_token_ids": True}
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            [choice] = r.json()["choices"]
            ref = await _reference(reference_engine, PROMPTS[0], sp)
            assert (choice["text"], choice["token_ids"], choice["stop_reason"]) == (ref.text, list(ref.token_ids), stop)
            assert choice["text"].endswith(stop) == include and choice["finish_reason"] == "stop"
        # a stop token id: its id as the stop reason; EOS and length: none
        tok = plain[1][6]
        body = {"prompt": list(PROMPTS[1]), "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "stop_token_ids": [tok], "return_token_ids": True}
        [choice] = (await http.post("/v1/completions", json=body)).json()["choices"]
        ref = await _reference(reference_engine, PROMPTS[1], replace(BASE, stop_token_ids=(tok,)))
        assert (choice["token_ids"], choice["stop_reason"]) == (list(ref.token_ids), ref.stop_reason)
        assert choice["stop_reason"] == tok and choice["token_ids"][-1] == tok
        [choice] = (await http.post("/v1/completions", json={**body, "stop_token_ids": []})).json()["choices"]
        assert choice["stop_reason"] is None


async def test_skip_special_tokens_changes_the_text_exactly(cluster, client, reference_engine):
    """A response with special tokens in it (EOS ignored): their text is left out by default and
    kept with skip_special_tokens false, as the reference engine renders them."""
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    candidates = token_prompts(24, seed=9191)
    refs = await asyncio.gather(*(_reference(reference_engine, p, sp) for p in candidates))
    found = [(p, r) for p, r in zip(candidates, refs) if SPECIAL & set(r.token_ids[:-1])]
    assert found, "no greedy response of 24 prompts holds a special token"
    prompt = found[0][0]
    keep = replace(sp, skip_special_tokens=False)
    ref_keep = await _reference(reference_engine, prompt, keep)
    assert ref_keep.text != found[0][1].text
    await _cluster(client, cluster, [prompt], sp)  # its history draft
    ours = await _cluster(client, cluster, [prompt, prompt], keep)
    assert [c.text for c in ours.completions] == [ref_keep.text] * 2
    assert ours.summary.provenance.accepted() > 0
    async with _http(cluster) as http:
        body = {"prompt": list(prompt), "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        for skip, expected in ((True, found[0][1].text), (False, ref_keep.text)):
            r = await http.post("/v1/completions", json={**body, "skip_special_tokens": skip})
            assert r.json()["choices"][0]["text"] == expected


async def test_top_logprobs_are_the_reference_engines_with_drafts(cluster, client, reference_engine, plain):
    sp = replace(BASE, logprobs=3)
    out = await _cluster(client, cluster, PROMPTS, sp)
    refs = await asyncio.gather(*(_reference(reference_engine, p, sp) for p in PROMPTS))
    assert out.summary.provenance.accepted() > 0
    for c, ref in zip(out.completions, refs):
        assert c.token_ids == ref.token_ids and len(c.top_logprobs) == len(c.token_ids)
        for mine, theirs, tok in zip(c.top_logprobs, ref.top_logprobs, c.token_ids):
            assert [t for t, _ in mine] == [t for t, _ in theirs] and len(mine) == 3
            assert [x for _, x in mine] == pytest.approx([x for _, x in theirs], abs=1e-3)
            assert mine[0][0] == tok  # greedy: the sampled token is the most likely
    async with _http(cluster) as http:
        body = {"prompt": list(PROMPTS[0]), "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 3,
                "return_tokens_as_token_ids": True}
        choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
        expected = [{f"token_id:{t}": pytest.approx(x, abs=1e-3) for t, x in top} for top in out.completions[0].top_logprobs]
        assert choice["logprobs"]["top_logprobs"] == expected
        chat = {"messages": [{"role": "user", "content": "2+2="}], "max_completion_tokens": 6, "temperature": 0,
                "logprobs": True, "top_logprobs": 2}
        content = (await http.post("/v1/chat/completions", json=chat)).json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 6 and all(len(e["top_logprobs"]) == 2 for e in content)


async def test_seeds_over_int64_draw_what_vllm_draws_for_them(cluster, client, reference_engine):
    """Sample i of a step seeded s uses s + i, as vLLM's own n > 1 does, modulo 2**64 (torch's
    reading): 2**63 - 1 goes on with 2**63 and -2 with -1, which the engine must not take for "no
    seed". Drafts off: a seeded request is then reproducible (docs/EXACTNESS.md)."""
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=2)
    for seed, samples in ((2**63 - 1, (2**63 - 1, 2**63)), (-2, (-2, -1))):
        out = await _cluster(client, cluster, [PROMPTS[0]], replace(sp, seed=seed), drafts=False)
        refs = [await _reference(reference_engine, PROMPTS[0], replace(sp, n=1, seed=s)) for s in samples]
        assert [c.token_ids for c in out.completions] == [r.token_ids for r in refs], seed
    async with _http(cluster) as http:
        body = {"prompt": list(PROMPTS[0]), "max_tokens": 8, "seed": 2**63 - 1, "n": 2}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        r = await http.post("/v1/completions", json={**body, "seed": 2**63})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "seed")


async def test_server_info_says_the_engines_dtype(cluster):
    async with _http(cluster) as http:
        config = (await http.get("/server_info", params={"config_format": "json"})).json()["vllm_config"]
    assert config["model_config"]["dtype"] == "torch.float32"  # the tiny model's checkpoint dtype (CPU "auto")
    assert config["lora_config"] is None and config["model_config"]["max_logprobs"] == 20
