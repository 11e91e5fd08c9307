"""``/v1/chat/completions`` without engines: template rendering against transformers' own
``apply_chat_template``, request parsing, refusals (status, ``param``, no step), and the response
and stream shapes over a scripted ``run_requests``. The real-cluster tests are in
tests/integration/test_openai_api.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.bench.tiny_model import CHAT_TEMPLATE, build_tiny_tokenizer
from bubblespec.common import codec as cv
from bubblespec.scheduler.hot_routes import HotRoutes
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits
from bubblespec.scheduler.core.validate import Limits
from bubblespec.scheduler.openai_api import create_router
from bubblespec.scheduler.openai_chat import ChatCompletions, load_chat_template, parse_messages, render_chat
from bubblespec.scheduler.settings import SchedulerSettings
from fastapi import FastAPI
from fastapi.testclient import TestClient

CHATS = [
    [{"role": "user", "content": "2+2="}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Sum 3 and 5"}],
    [{"role": "user", "content": ""}],
]
# A template that uses what transformers' environment adds: raise_exception, tojson, loop controls,
# the {% generation %} tag, trim_blocks / lstrip_blocks, and a special-token variable.
RICH_TEMPLATE = """{% for m in messages %}
  {% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}
  {% if loop.index > 8 %}{% break %}{% endif %}
  {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}
  {% else %}{{ bos_token }}[{{ m['role'] }}] {{ m['content'] }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ bos_token }}[assistant] {% endif %}"""


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> str:
    return str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny"))


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer)


def test_tiny_tokenizer_has_the_chat_template(tiny_tokenizer, hf_tokenizer):
    template, special = load_chat_template(tiny_tokenizer)
    assert template == CHAT_TEMPLATE == hf_tokenizer.chat_template
    assert (special["bos_token"], special["eos_token"]) == ("<s>", "</s>")
    assert load_chat_template(tiny_tokenizer + "/tokenizer.json") == (template, special)  # a tokenizer.json path


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("template", [None, RICH_TEMPLATE])
def test_rendering_matches_transformers_apply_chat_template(tiny_tokenizer, hf_tokenizer, messages, template):
    own, special = load_chat_template(tiny_tokenizer)
    ours = render_chat(template or own, parse_messages(messages), special)
    theirs = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=True)
    assert ours == theirs


def test_template_errors_are_refusals_naming_messages(tiny_tokenizer):
    _, special = load_chat_template(tiny_tokenizer)
    with pytest.raises(InvalidRequest) as e:
        render_chat("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "x"}], special)
    assert e.value.field == "messages" and "roles must alternate" in str(e.value)


def test_chat_template_files_as_transformers_reads_them(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "</s>", "special": True},
         "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_chat_template(str(tmp_path)) == ("D", {"eos_token": "</s>"})
    (tmp_path / "chat_template.jinja").write_text("J")  # the file wins over the config entry
    load_chat_template.cache_clear()
    assert load_chat_template(str(tmp_path))[0] == "J"
    load_chat_template.cache_clear()


def test_message_forms():
    assert parse_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": "c", "name": "bot"}]) == \
        [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c", "name": "bot"}]
    for bad in (None, "hi", [], [5], [{"content": "x"}], [{"role": "robot", "content": "x"}],
                [{"role": "tool", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": None}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
                [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]):
        with pytest.raises(InvalidRequest) as e:
            parse_messages(bad)
        assert e.value.field == "messages"


def _completion(step_id: str, sample: int, ids: list[int], finish: int = 1) -> pb.GenerateResponse:
    text = "x" * len(ids)  # any text: the shapes are under test
    return pb.GenerateResponse(completion=pb.Completion(
        step_id=step_id, prompt_id="p0", sample_index=sample, token_ids=ids, logprobs=[-0.5] * len(ids),
        text=text, finish_reason=finish))


LIMITS = ModelLimits(max_model_len=512, vocab_size=128)


def _app(tokenizer: str, limits=LIMITS, max_body: int = 2**20, refuse: InvalidRequest | None = None):
    """A stub scheduler whose ``run_requests`` records the call and answers sample i with ids [40 + i, 41],
    or raises ``refuse`` (as the service refuses a call it cannot run)."""
    core = SimpleNamespace(model_limits=limits, policy_version=0, steps={}, check_requests=lambda spec: None)

    async def run_requests(spec, single_version=False, session_id=""):
        if refuse is not None:
            raise refuse
        core.steps[spec.step_id] = spec
        for i in reversed(range(spec.sampling.n)):  # finish out of order
            yield i, cv.completion_from_pb(_completion(spec.step_id, i, [40 + i, 41], finish=2 if i else 1).completion)

    settings = SchedulerSettings(tokenizer=tokenizer, served_model_name="tiny",
                                 limits=Limits(max_request_bytes=max_body))
    scheduler = SimpleNamespace(settings=settings, service=SimpleNamespace(core=core, tokenize=None, run_requests=run_requests),
                                ready=True)
    app = FastAPI()
    app.include_router(create_router(scheduler, chat=ChatCompletions))
    return TestClient(HotRoutes(app)), core  # as the scheduler serves them


def _post(http, body) -> tuple[int, dict]:
    r = http.post("/v1/chat/completions", content=body if isinstance(body, bytes) else json.dumps(body),
                  headers={"content-type": "application/json"})
    return r.status_code, r.json()


MSG = [{"role": "user", "content": "2+2="}]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other", "messages": MSG}, 404, "model"),
    ({"messages": MSG, "n": 0}, 400, "n"),
    ({"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": -1, "max_tokens": 5}, 400, "max_completion_tokens"),
    ({"messages": MSG, "max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": MSG, "temperature": -1}, 400, "temperature"),
    ({"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true, as vLLM refuses it
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),  # over max_logprobs
    ({"messages": MSG, "top_logprobs": -1}, 400, "top_logprobs"),
    ({"messages": MSG, "min_tokens": 7, "max_tokens": 5}, 400, "min_tokens"),
    ({"messages": MSG, "best_of": 2}, 400, "best_of"),  # not a field of vLLM 0.32's request
    ({"messages": MSG, "logprobs": 1.5}, 400, "logprobs"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": MSG, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"messages": MSG, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"messages": MSG, "chat_template": "{{ 'x' }}"}, 400, "chat_template"),
    ({"messages": MSG, "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ({"messages": MSG, "return_tokens_as_token_ids": "yes"}, 400, "return_tokens_as_token_ids"),
    ({"messages": "2+2="}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"content": "x"}]}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),  # longer than the model
    ({}, 400, "messages"),
    (b"{not json", 400, None),
    (b"[1]", 400, None),
])
def test_chat_refusals_name_the_parameter_and_create_no_step(tiny_tokenizer, body, status, param):
    http, core = _app(tiny_tokenizer)
    code, answer = _post(http, body)
    assert code == status, answer
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, status)
    if param:
        assert err["message"].startswith(f"{param}: ") or param in err["message"]
    assert core.steps == {}


def test_chat_needs_a_tokenizer_with_a_chat_template(tmp_path, tiny_tokenizer):
    (tmp_path / "tokenizer.json").write_text((__import__("pathlib").Path(tiny_tokenizer) / "tokenizer.json").read_text())
    for tokenizer in ("", str(tmp_path)):
        http, core = _app(tokenizer)
        code, answer = _post(http, {"messages": MSG})
        assert (code, answer["error"]["param"]) == (400, "messages")
        assert "chat template" in answer["error"]["message"]
        assert core.steps == {}


def test_no_worker_and_oversized_bodies(tiny_tokenizer):
    http, core = _app(tiny_tokenizer, limits=None)
    code, answer = _post(http, {"messages": MSG})
    assert (code, answer["error"]["type"]) == (503, "ServiceUnavailableError")
    http, core = _app(tiny_tokenizer, max_body=100)
    code, answer = _post(http, {"messages": [{"role": "user", "content": "x" * 200}]})
    assert code == 413 and "body is over 100 bytes" in answer["error"]["message"]
    assert core.steps == {}


def test_chat_response_in_vllms_shape(tiny_tokenizer, hf_tokenizer):
    http, core = _app(tiny_tokenizer)
    code, out = _post(http, {"model": "tiny", "messages": MSG, "n": 2, "logprobs": True, "max_completion_tokens": 7,
                             "max_tokens": 99, "return_token_ids": True, "temperature": 0})
    assert code == 200, out
    [spec] = core.steps.values()
    expected = hf_tokenizer.apply_chat_template(MSG, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert spec.prompts[0].token_ids == tuple(expected)
    assert spec.prompts[0].max_tokens == 7 and spec.sampling.n == 2  # max_completion_tokens over max_tokens
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-") and out["model"] == "tiny"
    assert out["prompt_token_ids"] == expected
    assert [c["index"] for c in out["choices"]] == [0, 1]
    first = out["choices"][0]
    assert first["message"]["role"] == "assistant" and isinstance(first["message"]["content"], str)
    assert (first["finish_reason"], first["token_ids"]) == ("stop", [40, 41])
    assert out["choices"][1]["finish_reason"] == "length"
    entry = first["logprobs"]["content"][0]
    token = hf_tokenizer.decode([40])
    assert entry == {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}
    assert out["usage"] == {"prompt_tokens": len(expected), "completion_tokens": 4, "total_tokens": len(expected) + 4,
                            "prompt_tokens_details": None, "completion_tokens_details": None}
    # the keys of vLLM 0.32's ChatCompletionResponse, every one
    assert set(out) == {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                        "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                        "ec_transfer_params", "metrics"}


def test_chat_default_max_tokens_is_the_rest_of_the_model_length(tiny_tokenizer):
    http, core = _app(tiny_tokenizer)
    code, out = _post(http, {"messages": MSG})
    assert code == 200 and out["choices"][0]["logprobs"] is None and out["prompt_token_ids"] is None
    [spec] = core.steps.values()
    assert spec.prompts[0].max_tokens == 512 - len(spec.prompts[0].token_ids)


def test_return_tokens_as_token_ids_in_both_routes(tiny_tokenizer, hf_tokenizer):
    http, _ = _app(tiny_tokenizer)
    _, chat = _post(http, {"messages": MSG, "logprobs": True, "return_tokens_as_token_ids": True})
    entries = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == ["token_id:40", "token_id:41"]
    assert entries[0]["bytes"] == list(hf_tokenizer.decode([40]).encode())  # vLLM: bytes of the decoded token
    r = http.post("/v1/completions", json={"prompt": [5, 6], "logprobs": 1, "return_tokens_as_token_ids": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:40", "token_id:41"]
    assert lp["top_logprobs"] == [{"token_id:40": -0.5}, {"token_id:41": -0.5}]
    assert lp["text_offset"] == [0, len("token_id:40")]
    r = http.post("/v1/completions", json={"prompt": [5, 6], "logprobs": 1})
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [hf_tokenizer.decode([40]), hf_tokenizer.decode([41])]
    # the keys of vLLM 0.32's CompletionResponse and UsageInfo, every one
    assert set(r.json()) == {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                             "usage", "kv_transfer_params", "ec_transfer_params", "metrics"}
    assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                                 "prompt_tokens_details": None, "completion_tokens_details": None}


def _events(http, body) -> list:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = [ln[len("data: "):] for ln in r.text.split("\n\n") if ln]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_chat_stream_sends_roles_then_each_choice_then_usage(tiny_tokenizer):
    http, _ = _app(tiny_tokenizer)
    chunks = _events(http, {"messages": MSG, "n": 2, "stream": True, "stream_options": {"include_usage": True},
                            "return_token_ids": True})
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    roles, contents, usage = chunks[:2], chunks[2:4], chunks[4]
    assert [c["choices"][0]["delta"] for c in roles] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in roles] == [0, 1] and roles[0]["prompt_token_ids"]
    assert [c["choices"][0]["index"] for c in contents] == [1, 0]  # as they finish
    assert [c["choices"][0]["finish_reason"] for c in contents] == ["length", "stop"]
    assert contents[0]["choices"][0]["token_ids"] == [41, 41] and "content" in contents[0]["choices"][0]["delta"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert len(chunks) == 5


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": [5]})])
def test_a_step_the_service_cannot_run_now_is_503(tiny_tokenizer, path, body):
    http, core = _app(tiny_tokenizer, refuse=InvalidRequest("scheduler", "paused", "UNAVAILABLE"))
    r = http.post(path, json=body)
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    r = http.post(path, json={**body, "stream": True})  # streamed: the error as an event, then [DONE]
    events = [ln for ln in r.text.split("\n\n") if ln]
    assert json.loads(events[0][len("data: "):])["error"]["code"] == 503 and events[-1] == "data: [DONE]"
    assert core.steps == {}


def test_trls_chat_payload_is_accepted_and_its_parser_reads_the_answer(tiny_tokenizer):
    """The body TRL's VLLMClient.chat sends (trl/generation/vllm_client.py), parsed by TRL's own parse_logprobs."""
    from trl.generation.vllm_client import parse_logprobs

    http, _ = _app(tiny_tokenizer)
    payload = {"model": "tiny", "n": 2, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
               "min_p": 0.0, "max_tokens": 4, "logprobs": True, "top_logprobs": 0, "return_token_ids": True,
               "return_tokens_as_token_ids": True,
               "messages": [{"role": "user", "content": [{"type": "text", "text": "2+2="}]}]}
    code, out = _post(http, payload)
    assert code == 200, out
    logprobs, ids = parse_logprobs([c["logprobs"] for c in out["choices"]])
    assert ids == [[[40], [41]], [[41], [41]]] and logprobs == [[[-0.5], [-0.5]]] * 2
    assert out["prompt_token_ids"] and [c["token_ids"] for c in out["choices"]] == [[40, 41], [41, 41]]
