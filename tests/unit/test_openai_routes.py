"""The OpenAI-compatible routes without engines: auth, request parsing, error shapes.

A stub scheduler with no worker connected: every refusal here happens before a step exists.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from bubblespec.scheduler.hot_routes import HotRoutes
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits
from bubblespec.scheduler.core.validate import Limits
from bubblespec.scheduler.openai_api import create_router, openai_param, parse_prompts, parse_sampling
from bubblespec.scheduler.settings import SchedulerSettings
from fastapi import FastAPI
from fastapi.testclient import TestClient


def _app(token: str = "", limits=None, max_body: int = 2**20) -> tuple[TestClient, SimpleNamespace]:
    core = SimpleNamespace(model_limits=limits, policy_version=0, steps={})
    settings = SchedulerSettings(trainer_token=token, tokenizer="/models/tiny/", limits=Limits(max_request_bytes=max_body))
    scheduler = SimpleNamespace(settings=settings,
                                service=SimpleNamespace(core=core, tokenize=None), ready=False)
    app = FastAPI()
    app.include_router(create_router(scheduler))
    return TestClient(HotRoutes(app)), scheduler  # as the scheduler serves them


def test_v1_routes_need_the_trainer_token_when_one_is_set():
    http, _ = _app(token="secret")
    for call in (lambda h: http.get("/v1/models", headers=h),
                 lambda h: http.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=h)):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = call(headers)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "AuthenticationError"
            assert "authorization" in r.json()["error"]["message"]
    ok = http.get("/v1/models", headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200
    assert http.get("/health").status_code == 503  # open, and not ready: no worker


def test_models_lists_the_served_model_in_vllms_shape():
    http, _ = _app(limits=ModelLimits(max_model_len=512, vocab_size=100))
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == ("tiny", "model", 512)
    assert SchedulerSettings(tokenizer="/m/x/tokenizer.json").model_name() == "x"
    assert SchedulerSettings().model_name() == "bubblespec"
    assert SchedulerSettings(served_model_name="m", tokenizer="/a/b").model_name() == "m"


@pytest.mark.parametrize("raw, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"model": "other", "prompt": "x"}', 404, "model"),
    (b'{"model": "tiny", "prompt": "x"}', 503, None),  # no worker connected yet
])
def test_completions_refusals_in_openai_error_shape(raw, status, param):
    http, _ = _app()
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, status)


def test_a_body_over_the_request_limit_is_refused_with_413():
    http, _ = _app(max_body=100)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 200})
    assert r.status_code == 413
    assert "request: body is over 100 bytes" in r.json()["error"]["message"]


def test_prompt_forms():
    assert [p.text for p in parse_prompts("a")] == ["a"]
    assert [p.text for p in parse_prompts(["a", "b"])] == ["a", "b"]
    assert [p.token_ids for p in parse_prompts([1, 2])] == [(1, 2)]
    assert [p.token_ids for p in parse_prompts([[1], [2, 3]])] == [(1,), (2, 3)]
    for bad in (None, [], 5, [True], [[]], ["a", 1], {"a": 1}):
        with pytest.raises(InvalidRequest) as e:
            parse_prompts(bad)
        assert e.value.field == "prompt"


def test_sampling_defaults_and_refusals():
    sp = parse_sampling({}, "processed")
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.n, sp.seed) == (16, 1.0, 1.0, -1, 1, None)
    assert parse_sampling({"stop": "x", "top_k": 0}, "raw").stop == ("x",)
    assert parse_sampling({"logprobs": 5, "min_tokens": 3, "seed": -1}, "raw").logprobs == 5
    for body, field in [({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
                        ({"prompt_logprobs": -2}, "prompt_logprobs"), ({"priority": "x"}, "priority"),
                        ({"best_of": 3}, "best_of"), ({"presence_penalty": 0.5}, "presence_penalty"),
                        ({"stop": 5}, "stop"), ({"stop_token_ids": 5}, "stop_token_ids")]:
        with pytest.raises(InvalidRequest) as e:
            parse_sampling(body, "processed")
        assert e.value.field == field


def test_validation_fields_map_to_openai_parameters():
    assert openai_param("sampling.n") == "n"
    assert openai_param("sampling.stop[3]") == "stop"
    assert openai_param("prompts[2].token_ids[5]") == "prompt"
    assert openai_param("prompts[0].max_tokens") == "max_tokens"
    assert openai_param("step_id") is None
