"""The allow-list of request fields (``scheduler/request_fields.py``) and the fields it serves,
without engines: every field of vLLM 0.32's request models is in a table, every refused or
unknown field is a 400 naming it that creates no step, served fields reach ``SamplingParams``,
and the answers carry ``stop_reason`` and top logprobs in vLLM's layouts. The same fields on
real engines, with drafts: tests/integration/test_request_fields_engines.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from bubblespec.bench.tiny_model import build_tiny_tokenizer
from bubblespec.common.types import Completion, FinishReason, SamplingParams
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits
from bubblespec.scheduler.core.validate import Limits, build_step, check_sampling
from bubblespec.scheduler.openai_api import create_router, parse_sampling
from bubblespec.scheduler.openai_chat import ChatCompletions
from bubblespec.scheduler.request_fields import CHAT, COMPLETIONS, ENGINE_FIELDS, Refused, Served
from bubblespec.scheduler.settings import SchedulerSettings
from fastapi import FastAPI
from fastapi.testclient import TestClient

LIMITS = ModelLimits(max_model_len=512, vocab_size=128)
MSG = [{"role": "user", "content": "2+2="}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    return str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny"))


def _answer(spec, i: int) -> Completion:
    """Sample i of a one-prompt step: ids [40 + i, 41], stopped by token 41 with two alternatives a token."""
    return Completion(spec.step_id, "p0", i, (40 + i, 41), (-0.5, -0.25), "ab", FinishReason.STOP, 0,
                      stop_reason=41, top_logprobs=(((40 + i, -0.5), (7, -1.5)), ((9, -0.1), (41, -0.25))))


def _app(tokenizer: str):
    """A stub scheduler that records the steps it is given and answers each sample with ``_answer``."""
    core = SimpleNamespace(model_limits=LIMITS, policy_version=0, steps={}, check_step=lambda spec: None,
                           check_requests=lambda spec, *_: None)

    async def run_step(spec):
        core.steps[spec.step_id] = spec
        yield [_answer(spec, i) for i in range(spec.sampling.n)]

    async def run_requests(spec, *_):  # (spec, single_version, session_id) as the service takes them
        core.steps[spec.step_id] = spec
        for i in range(spec.sampling.n):
            yield i, _answer(spec, i)

    settings = SchedulerSettings(tokenizer=tokenizer, served_model_name="tiny", limits=Limits())
    service = SimpleNamespace(core=core, tokenize=None, run_step=run_step, run_requests=run_requests)
    app = FastAPI()
    app.include_router(create_router(SimpleNamespace(settings=settings, service=service, ready=True),
                                     chat=ChatCompletions))
    return TestClient(app), core


def _post(http, path: str, body: dict) -> tuple[int, dict]:
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    return r.status_code, r.json()


def _vllm_models():
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.sampling_params import SamplingParams as VllmParams

    return CompletionRequest, ChatCompletionRequest, VllmParams


def test_the_tables_name_every_field_of_vllms_requests_and_sampling_params():
    completion, chat, params = _vllm_models()
    assert set(COMPLETIONS) == set(completion.model_fields)
    assert set(CHAT) == set(chat.model_fields)
    assert set(ENGINE_FIELDS) == set(params.__struct_fields__)


def _not_default(entry: Refused):
    return next(v for v in ("not-the-default", 12345, True, {"x": 1}) if not any(v == d for d in entry.defaults))


@pytest.mark.parametrize("route, table, base", [
    ("/v1/completions", COMPLETIONS, {"prompt": [1, 2, 3]}),
    ("/v1/chat/completions", CHAT, {"messages": MSG}),
])
def test_every_refused_field_is_a_400_naming_it_and_makes_no_step(tokenizer, route, table, base):
    http, core = _app(tokenizer)
    refused = [name for name, entry in table.items() if isinstance(entry, Refused)]
    assert len(refused) > 25
    for name in refused:
        code, answer = _post(http, route, {**base, "max_tokens": 4, name: _not_default(table[name])})
        assert (code, answer["error"]["param"]) == (400, name), (name, answer)
        assert answer["error"]["message"].startswith(f"{name}: is not supported by BubbleSpec")
    for name in refused:  # at a default (or null) each is accepted and ignored
        for value in (None, *table[name].defaults):
            code, answer = _post(http, route, {**base, "max_tokens": 4, name: value})
            assert code == 200, (name, value, answer)
    assert len(core.steps) == sum(1 + len(table[n].defaults) for n in refused)


@pytest.mark.parametrize("route, base", [("/v1/completions", {"prompt": [1, 2, 3]}), ("/v1/chat/completions",
                                                                                       {"messages": MSG})])
def test_an_unknown_field_is_refused_by_name_not_ignored(tokenizer, route, base):
    http, core = _app(tokenizer)
    for name in ("min_token", "best_of", "guided_json", "top_logprob"):  # a typo, and fields of older vLLMs
        code, answer = _post(http, route, {**base, name: 1})
        assert (code, answer["error"]["param"]) == (400, name), answer
        assert "unknown fields are refused" in answer["error"]["message"]
    assert core.steps == {}


def test_completions_fields_reach_sampling_params():
    sp = parse_sampling({"min_tokens": 3, "include_stop_str_in_output": True, "skip_special_tokens": False,
                         "spaces_between_special_tokens": False, "logprobs": 5, "stop_token_ids": [7],
                         "seed": 2**63 - 1, "user": "u", "request_id": "r1"}, "processed")
    assert (sp.min_tokens, sp.include_stop_str_in_output, sp.skip_special_tokens, sp.spaces_between_special_tokens,
            sp.logprobs, sp.stop_token_ids, sp.seed) == (3, True, False, False, 5, (7,), 2**63 - 1)
    assert parse_sampling({"seed": -1}, "processed").seed is None  # vLLM: -1 is no seed
    assert parse_sampling({"logprobs": 0}, "processed").logprobs == 0


def test_seeds_cover_int64_and_values_are_checked_by_name():
    for seed in (-(2**63), -2, 0, 2**62, 2**63 - 1):
        check_sampling(SamplingParams(seed=seed, n=64, max_tokens=8), Limits(), LIMITS)
    bad = [(SamplingParams(seed=2**63), "sampling.seed"), (SamplingParams(seed=-(2**63) - 1), "sampling.seed"),
           (SamplingParams(max_tokens=4, min_tokens=5), "sampling.min_tokens"),
           (SamplingParams(min_tokens=-1), "sampling.min_tokens"), (SamplingParams(logprobs=21), "sampling.logprobs"),
           (SamplingParams(logprobs=-1), "sampling.logprobs"),
           (SamplingParams(skip_special_tokens=1), "sampling.skip_special_tokens"),  # type: ignore[arg-type]
           (SamplingParams(include_stop_str_in_output="yes"), "sampling.include_stop_str_in_output")]  # type: ignore[arg-type]
    for sp, field in bad:
        with pytest.raises(InvalidRequest) as e:
            check_sampling(sp, Limits(), LIMITS)
        assert e.value.field == field


def test_a_prompt_whose_max_tokens_is_below_min_tokens_is_refused():
    from bubblespec.common.types import Prompt

    with pytest.raises(InvalidRequest) as e:
        build_step(step_id="s", policy_version=0, prompts=[Prompt("p0", token_ids=(1, 2), max_tokens=3)],
                   sampling=SamplingParams(max_tokens=8, min_tokens=5), limits=Limits(), model=LIMITS)
    assert e.value.field == "prompts[0].max_tokens"


def test_completions_answer_stop_reason_and_top_logprobs_in_vllms_layout(tokenizer):
    http, core = _app(tokenizer)
    code, answer = _post(http, "/v1/completions", {"prompt": [1, 2, 3], "n": 2, "logprobs": 1, "min_tokens": 2,
                                                    "return_tokens_as_token_ids": True, "request_id": "abc"})
    assert code == 200, answer
    assert answer["id"] == "cmpl-abc"  # vLLM: cmpl-<request_id>
    [spec] = core.steps.values()
    assert (spec.sampling.logprobs, spec.sampling.min_tokens) == (1, 2)
    first = answer["choices"][0]
    assert first["stop_reason"] == 41
    assert first["logprobs"]["tokens"] == ["token_id:40", "token_id:41"]
    assert first["logprobs"]["top_logprobs"] == [  # the sampled token first, then the alternatives in rank order
        {"token_id:40": -0.5, "token_id:7": -1.5}, {"token_id:41": -0.25, "token_id:9": -0.1}]


def test_chat_answers_top_logprobs_as_vllm_lists_them(tokenizer):
    http, core = _app(tokenizer)
    code, answer = _post(http, "/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 2,
                                                         "return_tokens_as_token_ids": True, "request_id": "r"})
    assert code == 200, answer
    assert answer["id"] == "chatcmpl-r"
    [spec] = core.steps.values()
    assert spec.sampling.logprobs == 2
    choice = answer["choices"][0]
    assert choice["stop_reason"] == 41
    second = choice["logprobs"]["content"][1]
    # vLLM 0.32 lists the first top_logprobs entries of {sampled, most likely...}: the sampled token, then 9
    assert [(t["token"], t["logprob"]) for t in second["top_logprobs"]] == [("token_id:41", -0.25), ("token_id:9", -0.1)]
    assert second["top_logprobs"][0]["bytes"] == list(b"token_id:41")
    code, answer = _post(http, "/v1/chat/completions", {"messages": MSG, "logprobs": True})
    assert answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_stream_options_follow_vllms_rules(tokenizer):
    http, core = _app(tokenizer)
    for body, param in [({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
                        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
                        ({"stream": True, "stream_options": {"other": True}}, "stream_options"),
                        ({"stream": "yes"}, "stream")]:
        code, answer = _post(http, "/v1/completions", {"prompt": [1, 2], **body})
        assert (code, answer["error"]["param"]) == (400, param), answer
    assert core.steps == {}
    r = http.post("/v1/completions", json={"prompt": [1, 2], "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and '"usage"' in r.text


def test_served_entries_say_how():
    assert all(isinstance(e, (Served, Refused)) for e in (*COMPLETIONS.values(), *CHAT.values()))
    assert all(e.why for e in (*COMPLETIONS.values(), *CHAT.values()) if isinstance(e, Refused))
