"""The OpenAI-compatible routes against the real cluster, driven by the official ``openai`` client.

Outputs are compared token for token with what ``bubblespec.client`` returns for the same prompts
at the same policy version (other tests in the session move the version: it is read each time).
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from bubblespec.common.types import SamplingParams

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The quick brown fox", "Once upon a time"]
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def _openai(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.scheduler.http_port}/v1", api_key="x",
                              max_retries=0)


def _model(cluster) -> str:
    return cluster.scheduler.settings.model_name()


async def _reference(client, cluster, name: str, prompts, n: int = 1):
    v = cluster.scheduler.core.version
    result = await client.generate(f"{name}-v{v}", prompts, SamplingParams(n=n, **GREEDY), policy_version=v)
    return [c.token_ids for c in result.completions], [c.logprobs for c in result.completions]


async def test_models_lists_the_served_model(cluster):
    assert cluster.scheduler.settings.tokenizer
    models = await _openai(cluster).models.list()
    [card] = models.data
    assert card.id == _model(cluster)
    assert card.object == "model"
    assert card.model_extra["max_model_len"] == cluster.scheduler.core.limits.max_model_len


async def test_text_prompts_greedy_match_the_grpc_client(cluster, client):
    out = await _openai(cluster).completions.create(model=_model(cluster), prompt=PROMPTS, n=2, logprobs=1,
                                                    extra_body={"return_token_ids": True}, **GREEDY)
    ids, lps = await _reference(client, cluster, "oa-text-ref", PROMPTS, n=2)
    assert len(ids) == 4 and all(ids)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt-major, then sample index
    assert [tuple(c.model_extra["token_ids"]) for c in out.choices] == ids
    for choice, expected in zip(out.choices, lps):
        assert choice.finish_reason in ("stop", "length")
        assert choice.logprobs.token_logprobs == pytest.approx(list(expected), abs=1e-5)
        assert len(choice.logprobs.tokens) == len(expected) == len(choice.logprobs.top_logprobs)
    assert out.usage.completion_tokens == sum(len(t) for t in ids)
    prompt_len = sum(len(out.choices[i].model_extra["prompt_token_ids"]) for i in (0, 2))
    assert out.usage.prompt_tokens == prompt_len
    assert out.usage.total_tokens == prompt_len + out.usage.completion_tokens


async def test_token_id_prompts_match_the_grpc_client(cluster, client):
    single = [5, 17, 23, 42]
    batch = [[5, 17, 23, 42], [7, 8, 9]]
    api = _openai(cluster)
    one = await api.completions.create(model=_model(cluster), prompt=single, **GREEDY,
                                       extra_body={"return_token_ids": True})
    many = await api.completions.create(model=_model(cluster), prompt=batch, **GREEDY,
                                        extra_body={"return_token_ids": True})
    ref_one, _ = await _reference(client, cluster, "oa-ids-one", [single])
    ref_many, _ = await _reference(client, cluster, "oa-ids-many", batch)
    assert [tuple(c.model_extra["token_ids"]) for c in one.choices] == ref_one
    assert [tuple(c.model_extra["token_ids"]) for c in many.choices] == ref_many
    assert one.choices[0].model_extra["prompt_token_ids"] == single


async def test_streaming_sends_every_choice_once(cluster, client):
    stream = await _openai(cluster).completions.create(
        model=_model(cluster), prompt=PROMPTS, n=2, stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    indexed = [c.choices[0] for c in chunks if c.choices]
    assert sorted(ch.index for ch in indexed) == [0, 1, 2, 3]
    assert all(ch.finish_reason in ("stop", "length") for ch in indexed)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    v = cluster.scheduler.core.version
    ref = await client.generate(f"oa-stream-ref-v{v}", PROMPTS, SamplingParams(n=2, **GREEDY), policy_version=v)
    assert {ch.index: ch.text for ch in indexed} == {i: c.text for i, c in enumerate(ref.completions)}


async def _post_raw(cluster, body: bytes, path: str = "/v1/completions") -> tuple[int, dict]:
    """A request the openai client cannot send (the scheduler's HTTP server runs on this loop)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.scheduler.http_port}") as http:
        r = await http.post(path, content=body, headers={"Content-Type": "application/json"})
        return r.status_code, r.json()


async def test_bad_requests_are_refused_naming_the_parameter_and_change_nothing(cluster):
    api, model = _openai(cluster), _model(cluster)
    before = (len(cluster.scheduler.core.steps), cluster.scheduler.core.version)
    with pytest.raises(openai.NotFoundError) as e:
        await api.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    assert e.value.body["param"] == "model"
    for kwargs, param in [({"n": 0}, "n"), ({"max_tokens": -1}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
                          ({"max_tokens": 10**6}, "max_tokens"), ({"temperature": -1.0}, "temperature")]:
        args = {"max_tokens": 4, **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            await api.completions.create(model=model, prompt="x", **args)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param, e.value.body
        assert param in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        await api.completions.create(model=model, prompt=[[10**9]], max_tokens=4)
    assert e.value.body["param"] == "prompt"
    status, body = await _post_raw(cluster, b'{"model": "x", "prompt": ')
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert (len(cluster.scheduler.core.steps), cluster.scheduler.core.version) == before


async def test_health_is_200_when_ready(cluster):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.scheduler.http_port}") as http:
        assert (await http.get("/health")).status_code == 200


async def test_concurrent_calls_are_concurrent_steps_with_exact_outputs(cluster, client):
    api, model = _openai(cluster), _model(cluster)
    calls = [api.completions.create(model=model, prompt=p, extra_body={"return_token_ids": True}, **GREEDY)
             for p in PROMPTS]
    outs = await asyncio.gather(*calls)
    ids, _ = await _reference(client, cluster, "oa-concurrent-ref", PROMPTS)
    assert [tuple(o.choices[0].model_extra["token_ids"]) for o in outs] == ids
    assert len({o.id for o in outs}) == 2


async def test_seeded_sampling_builds_the_step_the_grpc_client_builds(cluster, client, monkeypatch):
    """Seeded steps with drafts on are not bit-reproducible (docs/EXACTNESS.md, "Seeds"): compare the
    requests themselves. Same prompts and sampling through either API give the same content (all a
    step's fingerprint covers; a call carries none: it is never resumed by its id)."""
    sampled = {"temperature": 1.0, "top_p": 0.9, "seed": 11, "max_tokens": 12}
    service, specs = cluster.scheduler.service, []
    real = service.run_requests

    def spy(spec, *args):
        specs.append(spec)
        return real(spec, *args)

    monkeypatch.setattr(service, "run_requests", spy)
    out = await _openai(cluster).completions.create(model=_model(cluster), prompt=PROMPTS, n=2, **sampled,
                                                    extra_body={"return_token_ids": True, "top_k": 20})
    v = cluster.scheduler.core.version
    ref = await client.generate(f"oa-seeded-ref-v{v}", PROMPTS, SamplingParams(n=2, top_k=20, **sampled),
                                policy_version=v)
    [http_spec] = specs
    ref_spec = cluster.scheduler.core.steps[f"oa-seeded-ref-v{v}"].spec
    def content(spec):
        return spec.policy_version, spec.prompts, spec.sampling, spec.lookahead, spec.policy, spec.use_drafts

    assert content(http_spec) == content(ref_spec)
    assert http_spec.fingerprint == "" and len(ref_spec.fingerprint) == 32
    assert len(out.choices) == len(ref.completions) == 4
    assert all(1 <= len(c.model_extra["token_ids"]) <= 12 for c in out.choices)


CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "The quick brown fox"}]


def _templated(cluster, messages) -> list[int]:
    """The prompt ids transformers' own apply_chat_template gives (what vLLM serves for chat)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cluster.scheduler.settings.tokenizer)
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


async def test_chat_greedy_matches_the_grpc_client_on_the_templated_prompt(cluster, client):
    out = await _openai(cluster).chat.completions.create(
        model=_model(cluster), messages=CHAT, n=2, logprobs=True, temperature=0.0, max_completion_tokens=8,
        extra_body={"return_token_ids": True})
    ids = _templated(cluster, CHAT)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.model_extra["prompt_token_ids"] == ids
    ref_ids, ref_lps = await _reference(client, cluster, "oa-chat-ref", [ids], n=2)
    assert len(ref_ids) == 2 and all(ref_ids)
    assert [c.index for c in out.choices] == [0, 1]
    assert [tuple(c.model_extra["token_ids"]) for c in out.choices] == ref_ids
    for choice, expected in zip(out.choices, ref_lps):
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(list(expected), abs=1e-5)
        assert all(e.top_logprobs == [] and bytes(e.bytes).decode() == e.token for e in choice.logprobs.content)
    v = cluster.scheduler.core.version
    ref = await client.generate(f"oa-chat-text-v{v}", [ids], SamplingParams(n=1, **GREEDY), policy_version=v)
    assert out.choices[0].message.content == ref.completions[0].text
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == sum(len(t) for t in ref_ids)


async def test_chat_streaming_sends_roles_then_each_choice_once(cluster, client):
    stream = await _openai(cluster).chat.completions.create(
        model=_model(cluster), messages=CHAT, n=2, stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert sorted(d.index for d in deltas if d.delta.role == "assistant") == [0, 1]
    finished = [d for d in deltas if d.finish_reason is not None]
    assert sorted(d.index for d in finished) == [0, 1]
    v = cluster.scheduler.core.version
    ref = await client.generate(f"oa-chat-stream-ref-v{v}", [_templated(cluster, CHAT)], SamplingParams(n=2, **GREEDY),
                                policy_version=v)
    assert {d.index: d.delta.content for d in finished} == {i: c.text for i, c in enumerate(ref.completions)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in ref.completions)


async def test_return_tokens_as_token_ids_names_tokens_by_id(cluster):
    api, model = _openai(cluster), _model(cluster)
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    out = await api.completions.create(model=model, prompt=PROMPTS[0], logprobs=1, extra_body=extra, **GREEDY)
    choice = out.choices[0]
    names = [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    assert choice.logprobs.tokens == names and names
    assert [list(top)[0] for top in choice.logprobs.top_logprobs] == names  # the sampled token, then 1 alternative
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    chat = await api.chat.completions.create(model=model, messages=CHAT, logprobs=True, extra_body=extra, **GREEDY)
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]


async def test_bad_chat_requests_are_refused_naming_the_parameter_and_change_nothing(cluster):
    api, model = _openai(cluster), _model(cluster)
    before = (len(cluster.scheduler.service.core.steps), cluster.scheduler.core.version)
    with pytest.raises(openai.NotFoundError) as e:
        await api.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=4)
    assert e.value.body["param"] == "model"
    user = [{"role": "user", "content": "x"}]
    for kwargs, param in [({"n": 0}, "n"), ({"max_tokens": -1}, "max_tokens"),
                          ({"max_completion_tokens": -1}, "max_completion_tokens"),
                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
                          ({"messages": "hello"}, "messages"), ({"messages": []}, "messages"),
                          ({"messages": [{"role": "user"}]}, "messages"),
                          ({"messages": [{"role": "wizard", "content": "x"}]}, "messages")]:
        args = {"messages": user, "max_tokens": 4, **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            await api.chat.completions.create(model=model, **args)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param, e.value.body
        assert param in e.value.body["message"]
    status, body = await _post_raw(cluster, b'{"messages": [', "/v1/chat/completions")
    assert status == 400 and body["error"]["param"] is None
    assert (len(cluster.scheduler.service.core.steps), cluster.scheduler.core.version) == before
