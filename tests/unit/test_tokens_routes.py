"""``/inference/v1/generate``, ``/tokenize`` and ``/detokenize`` without engines: the field tables
against vLLM's own request models, refusals (status, ``param``, no call made), the response and
stream shapes over a scripted service, and the tokenizer routes against transformers. The
comparison with a real vLLM server is tests/integration/test_vllm_reference.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from bubblespec.bench.tiny_model import build_tiny_tokenizer
from bubblespec.common.types import FinishReason
from bubblespec.scheduler.hot_routes import HotRoutes
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits
from bubblespec.scheduler.core.validate import Limits
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.scheduler.tokens_api import (
    GENERATE_FIELDS,
    SAMPLING_ONLY_FIELDS,
    SHARED_SAMPLING_FIELDS,
    TOKENIZE_FIELDS,
    create_router,
)
from fastapi import FastAPI
from fastapi.testclient import TestClient

LIMITS = ModelLimits(max_model_len=512, vocab_size=128)
PROMPT = [5, 17, 23, 42]
# vLLM 0.32's answer keys (a plain `vllm serve --enable-scale-out`, read from its protocol models)
ENVELOPE = {"request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
            "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params", "ec_transfer_params",
            "output_mode", "choices"}
CHOICE = {"index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask", "weight_versions",
          "logprobs"}


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> str:
    return str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny"))


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer)


def _completion(sample: int, **extra) -> SimpleNamespace:
    """Sample i: ids [40 + i, 41], logprob -0.5 each, finished out of order (sample 1 by length)."""
    ids = (40 + sample, 41)
    base = dict(prompt_id="p0", sample_index=sample, token_ids=ids, logprobs=(-0.5, -0.25), text="x" * len(ids),
                finish_reason=FinishReason.LENGTH if sample else FinishReason.STOP, policy_version=3)
    return SimpleNamespace(**{**base, **extra})


def _app(tokenizer: str, limits=LIMITS, token: str = "", refuse: InvalidRequest | None = None, **extra):
    """A stub scheduler that records each call's spec and answers sample i with ``_completion(i, **extra)``,
    through either service API the completions path uses (``run_requests``, or ``run_step``)."""
    calls: list = []

    def check(spec):
        if refuse is not None:
            raise refuse

    async def run_requests(spec, single_version=False, session_id=""):
        check(spec)
        calls.append(spec)
        for i in reversed(range(spec.sampling.n)):
            yield i, _completion(i, **extra)

    async def run_step(spec):
        async for _, c in run_requests(spec):
            yield [c]

    core = SimpleNamespace(model_limits=limits, policy_version=3, check_step=check, check_requests=check)
    settings = SchedulerSettings(tokenizer=tokenizer, served_model_name="tiny", trainer_token=token,
                                 limits=Limits(max_request_bytes=2**20))
    service = SimpleNamespace(core=core, tokenize=None, run_requests=run_requests, run_step=run_step)
    app = FastAPI()
    app.include_router(create_router(SimpleNamespace(settings=settings, service=service, ready=True)))
    return TestClient(HotRoutes(app)), calls  # as the scheduler serves them


def _generate(http, body, headers=None) -> tuple[int, dict]:
    r = http.post("/inference/v1/generate", content=json.dumps(body), headers={"content-type": "application/json",
                                                                                **(headers or {})})
    return r.status_code, r.json()


def test_the_tables_name_every_field_of_vllms_request_models():
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
    from vllm.sampling_params import SamplingParams

    assert set(GENERATE_FIELDS) == set(GenerateRequest.model_fields)
    public = {f for f in SamplingParams.__struct_fields__ if not f.startswith("_")}
    assert SHARED_SAMPLING_FIELDS == public & set(CompletionRequest.model_fields)  # what parse_sampling judges
    assert set(SAMPLING_ONLY_FIELDS) == public - set(CompletionRequest.model_fields)
    assert set(TOKENIZE_FIELDS) == set(TokenizeCompletionRequest.model_fields) | set(TokenizeChatRequest.model_fields)
    assert set(DetokenizeRequest.model_fields) == {"model", "tokens"}


OK = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}}


@pytest.mark.parametrize("body, status, param", [
    ({**OK, "model": "other"}, 404, "model"),
    ({**OK, "token_ids": []}, 400, "token_ids"),
    ({**OK, "token_ids": [-1]}, 400, "token_ids"),
    ({**OK, "token_ids": [1.5]}, 400, "token_ids"),
    ({**OK, "token_ids": "2+2"}, 400, "token_ids"),
    ({"sampling_params": {}}, 400, "token_ids"),
    ({**OK, "token_ids": [5, 1000]}, 400, "token_ids"),  # past the vocabulary
    ({**OK, "token_ids": [5] * 512}, 400, "token_ids"),  # no room for a token
    ({"token_ids": PROMPT}, 400, "sampling_params"),
    ({**OK, "sampling_params": [1]}, 400, "sampling_params"),
    ({**OK, "bogus": 1}, 400, "bogus"),
    ({**OK, "sampling_params": {"bogus": 1}}, 400, "bogus"),
    ({**OK, "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ({**OK, "sampling_params": {"n": 0}}, 400, "n"),
    ({**OK, "sampling_params": {"max_tokens": 0}}, 400, "max_tokens"),
    ({**OK, "sampling_params": {"presence_penalty": 0.5}}, 400, "presence_penalty"),
    ({**OK, "sampling_params": {"prompt_logprob_token_ids": [[1]]}}, 400, "prompt_logprob_token_ids"),
    ({**OK, "sampling_params": {"extra_args": {"a": 1}}}, 400, "extra_args"),
    ({**OK, "sampling_params": {"routed_experts_prompt_start": -2}}, 400, "routed_experts_prompt_start"),
    ({**OK, "priority": "high"}, 400, "priority"),  # any int64 is served (used for nothing, as vllm serve)
    ({**OK, "cache_salt": "a@b"}, 400, "cache_salt"),  # vLLM's rule; a salt is served
    ({**OK, "sampling_params": {"prompt_logprobs": -2}}, 400, "prompt_logprobs"),
    ({**OK, "cache_salt": ""}, 400, "cache_salt"),
    ({**OK, "features": {"mm_hashes": {}, "mm_placeholders": {}}}, 400, "features"),
    ({**OK, "content_parts": [{"type": "image_url"}]}, 400, "content_parts"),
    ({**OK, "kv_transfer_params": {"do_remote_decode": True}}, 400, "kv_transfer_params"),
    ({**OK, "reasoning_ended": True}, 400, "reasoning_ended"),
    ({**OK, "output_mode": "json"}, 400, "output_mode"),
    ({**OK, "output_mode": "text", "sampling_params": {"detokenize": False}}, 400, "output_mode"),
    ({**OK, "stream": "yes"}, 400, "stream"),
    ({**OK, "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400, "stream_options"),
    ({**OK, "request_id": 7}, 400, "request_id"),
    ({**OK, "return_token_ids": "yes"}, 400, "return_token_ids"),
])
def test_generate_refusals_name_the_field_and_make_no_call(tiny_tokenizer, body, status, param):
    http, calls = _app(tiny_tokenizer)
    code, answer = _generate(http, body)
    assert (code, answer["error"]["param"], answer["error"]["code"]) == (status, param, status), answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert calls == []


def test_generate_answer_in_vllms_shape(tiny_tokenizer):
    http, calls = _app(tiny_tokenizer, stop_reason=98)
    code, out = _generate(http, {"model": "tiny", "token_ids": PROMPT, "return_token_ids": True,
                                 "sampling_params": {"n": 2, "temperature": 0, "max_tokens": 5, "logprobs": 0,
                                                     "skip_special_tokens": False, "output_kind": 2}})
    assert code == 200, out
    assert set(out) == ENVELOPE and out["output_mode"] == "tokens" and out["model"] == "tiny"
    assert out["request_id"].startswith("generate-tokens-") and out["prompt_token_ids"] == PROMPT
    assert [set(c) for c in out["choices"]] == [CHOICE, CHOICE]
    first, second = out["choices"]
    assert (first["index"], first["token_ids"], first["finish_reason"], first["stop_reason"]) == (0, [40, 41], "stop", 98)
    assert (second["index"], second["finish_reason"]) == (1, "length")
    assert first["weight_versions"] == [{"version": "3", "start": 0, "end": 2}]
    entry = first["logprobs"]["content"][0]  # greedy: the sampled token is the most likely, rank 1
    assert entry == {"token_id": 40, "token": "token_id:40", "logprob": -0.5, "rank": 1,
                     "top_logprobs": [{"token_id": 40, "token": "token_id:40", "logprob": -0.5, "rank": 1}]}
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                            "prompt_tokens_details": None, "completion_tokens_details": None}
    [spec] = calls
    assert spec.prompts[0].token_ids == tuple(PROMPT) and spec.sampling.n == 2 and spec.sampling.max_tokens == 5
    code, out = _generate(http, {**OK, "sampling_params": {"max_tokens": 2}})
    assert out["choices"][0]["logprobs"] is None and out["prompt_token_ids"] is None


def test_generate_logprobs_with_alternatives_and_unknown_ranks(tiny_tokenizer):
    """vLLM lists the sampled token, then the alternatives without it, max(logprobs, 1) entries;
    the sampled token's rank is known where the alternatives show it (or for greedy sampling)."""
    tops = (((41, -0.1), (40, -0.5)), ((7, -0.2), (8, -0.3)))
    http, _ = _app(tiny_tokenizer, top_logprobs=tops)
    _, out = _generate(http, {**OK, "sampling_params": {"temperature": 1.0, "logprobs": 2, "max_tokens": 2}})
    first, second = out["choices"][0]["logprobs"]["content"]
    assert [(e["token_id"], e["rank"]) for e in first["top_logprobs"]] == [(40, 2), (41, 1)]
    assert first["rank"] == 2 and second["rank"] is None  # 41 is not among position 2's alternatives
    assert [(e["token_id"], e["logprob"], e["rank"]) for e in second["top_logprobs"]] == [(41, -0.25, None),
                                                                                          (7, -0.2, 1)]


def test_prime_rls_client_accepts_the_logprobs(tiny_tokenizer):
    """renderers 0.1.12 (verifiers 0.4's client, ``renderers.client._parse_completion_logprobs``) requires
    ``choices[0].logprobs.content[i].token == "token_id:<completion_ids[i]>"`` and a finite logprob."""
    http, _ = _app(tiny_tokenizer)
    body = {"model": "tiny", "token_ids": PROMPT, "sampling_params": {
        "temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "stop_token_ids": [2], "logprobs": 1,
        "skip_special_tokens": False}}
    code, out = _generate(http, body)
    assert code == 200, out
    choice = out["choices"][0]
    for token_id, entry in zip(choice["token_ids"], choice["logprobs"]["content"], strict=True):
        assert entry["token"] == f"token_id:{token_id}" and entry["logprob"] == entry["logprob"] > -9999


def test_skyrls_payloads_are_accepted(tiny_tokenizer):
    """The bodies SkyRL 0.3's RemoteInferenceClient sends (``_generate_single``, ``sample``, ``tokenize``, ``detokenize``)."""
    http, calls = _app(tiny_tokenizer)
    sample = {"n": 2, "logprobs": 0, "output_kind": 2, "prompt_logprobs": None, "temperature": 0.7, "max_tokens": 3,
              "seed": 5, "top_k": 4, "top_p": 0.9, "stop": ["\n"], "stop_token_ids": [2]}
    code, out = _generate(http, {"sampling_params": sample, "model": "tiny", "token_ids": PROMPT})
    assert code == 200 and len(out["choices"]) == 2 and out["choices"][0]["logprobs"]["content"]
    assert calls[0].sampling.seed == 5 and calls[0].sampling.top_k == 4
    assert http.post("/tokenize", json={"model": "tiny", "prompt": "2+2=", "add_special_tokens": True}).status_code == 200
    assert http.post("/detokenize", json={"model": "tiny", "tokens": [40, 41]}).json()["prompt"]


def test_max_tokens_as_vllms_generate_route_takes_it(tiny_tokenizer):
    """Absent: the rest of the model length; past it: up to the model length (vLLM checks neither)."""
    http, calls = _app(tiny_tokenizer)
    for asked, expected in ((None, 512 - 4), (10**6, 512 - 4), (7, 7)):
        code, _ = _generate(http, {**OK, "sampling_params": {} if asked is None else {"max_tokens": asked}})
        assert code == 200 and calls[-1].sampling.max_tokens == expected


def test_request_id_from_the_header_or_the_body(tiny_tokenizer):
    http, _ = _app(tiny_tokenizer)
    assert _generate(http, {**OK, "request_id": "mine"})[1]["request_id"] == "generate-tokens-mine"
    _, out = _generate(http, {**OK, "request_id": "mine"}, headers={"X-Request-Id": "hdr"})
    assert out["request_id"] == "generate-tokens-hdr"  # vLLM's precedence


def test_text_mode_adds_text_and_decoded_logprobs(tiny_tokenizer, hf_tokenizer):
    http, _ = _app(tiny_tokenizer)
    _, out = _generate(http, {**OK, "output_mode": "text", "sampling_params": {"logprobs": 0, "max_tokens": 2}})
    choice = out["choices"][0]
    assert out["output_mode"] == "text" and set(choice) == CHOICE | {"text"} and choice["text"] == "xx"
    token = hf_tokenizer.decode([40])
    assert choice["logprobs"]["content"][0] == {"token": token, "logprob": -0.5, "bytes": list(token.encode()),
                                                "top_logprobs": [{"token": token, "logprob": -0.5,
                                                                  "bytes": list(token.encode())}]}


def test_stream_sends_each_choice_then_usage(tiny_tokenizer):
    http, _ = _app(tiny_tokenizer)
    r = http.post("/inference/v1/generate", json={**OK, "stream": True, "return_token_ids": True,
                                                  "stream_options": {"include_usage": True},
                                                  "sampling_params": {"n": 2, "max_tokens": 2}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    first, second, usage = (json.loads(e) for e in events[:-1])
    assert set(first) == {"request_id", "usage", "output_mode", "choices", "prompt_token_ids"}
    assert set(second) == {"request_id", "usage", "output_mode", "choices"}
    assert [first["choices"][0]["index"], second["choices"][0]["index"]] == [1, 0]  # as they finish
    assert second["choices"][0]["token_ids"] == [40, 41] and second["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert len({first["request_id"], second["request_id"], usage["request_id"]}) == 1


def test_a_call_the_service_cannot_take_now_is_503(tiny_tokenizer):
    http, calls = _app(tiny_tokenizer, refuse=InvalidRequest("scheduler", "paused", "UNAVAILABLE"))
    assert _generate(http, OK)[0] == 503
    assert _generate(http, {**OK, "stream": True})[0] == 503  # before the stream's 200
    http, _ = _app(tiny_tokenizer, limits=None)
    assert _generate(http, OK)[0] == 503  # no worker yet
    assert calls == []


def test_every_route_needs_the_trainer_token(tiny_tokenizer):
    http, calls = _app(tiny_tokenizer, token="secret")
    for path, body in (("/inference/v1/generate", OK), ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        assert http.post(path, json=body).status_code == 401
        assert http.post(path, json=body, headers={"Authorization": "Bearer secret"}).status_code == 200
    assert len(calls) == 1


def test_tokenize_as_transformers_does(tiny_tokenizer, hf_tokenizer):
    http, _ = _app(tiny_tokenizer)
    text = "Hello world 2+2="
    out = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert out["tokens"] == hf_tokenizer.encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512 and out["token_strs"] == hf_tokenizer.convert_ids_to_tokens(out["tokens"])
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False) and plain["token_strs"] is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    chat = http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
    assert chat["tokens"] == hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                              return_dict=False)


def test_detokenize_keeps_special_tokens_as_transformers_decode(tiny_tokenizer, hf_tokenizer):
    http, _ = _app(tiny_tokenizer)
    for ids in ([1, 53, 98, 2], []):
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": hf_tokenizer.decode(ids)}
    # outside the vocabulary: nothing, as vLLM answers (not a 500 from the tokenizers library)
    assert http.post("/detokenize", json={"tokens": [53, 100_000, 2**62]}).json() == {"prompt": hf_tokenizer.decode([53])}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 'x' }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}, 400,
     "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "5"}, 400, "tokens"),
    ("/detokenize", {"tokens": [5], "bogus": 1}, 400, "bogus"),
    ("/detokenize", {"tokens": [5], "model": "other"}, 404, "model"),
])
def test_tokenizer_route_refusals(tiny_tokenizer, path, body, status, param):
    http, _ = _app(tiny_tokenizer)
    r = http.post(path, json=body)
    assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.json()


def test_tokenizer_routes_need_a_tokenizer():
    http, _ = _app("")
    for path, body, param in (("/tokenize", {"prompt": "x"}, "prompt"), ("/detokenize", {"tokens": [5]}, "tokens")):
        r = http.post(path, json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param)
        assert "no tokenizer" in r.json()["error"]["message"]
