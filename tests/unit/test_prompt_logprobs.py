"""prompt_logprobs, echo, cache_salt and priority without engines: the wire carries them, the
worker hands them to vLLM and reads vLLM's prompt logprobs back, a moved request keeps the
first run's, the core refuses prompt logprobs a request did not ask for (or of the wrong
shape), and the HTTP routes take the fields by vLLM's rules and answer in vLLM's layouts.
The same against plain vLLM: tests/integration/test_vllm_reference.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from bubblespec.bench.tiny_model import build_tiny_tokenizer
from bubblespec.common import codec as cv
from bubblespec.common.types import Completion, FinishReason, PromptLogprob, SamplingParams
from bubblespec.scheduler.core.checks import check_prompt_logprobs
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits
from bubblespec.scheduler.core.validate import Limits
from bubblespec.scheduler.openai_api import create_router
from bubblespec.scheduler.openai_chat import ChatCompletions
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.scheduler.tokens_api import create_router as tokens_router
from bubblespec.worker.engine import EngineOutput, EngineRequest, EngineSettings, VllmEngine
from bubblespec.worker.engine_logprobs import prompt_rows as _prompt_rows
from bubblespec.worker.resume import joined_prompt_logprobs, partial, resumed
from fastapi import FastAPI
from fastapi.testclient import TestClient

LIMITS = ModelLimits(max_model_len=512, vocab_size=128)
MSG = [{"role": "user", "content": "2+2="}]

PROMPT = (1, 40, 41)
ROWS = (PromptLogprob(40, -2.5, 3, "a", ((7, -0.5, "x"), (9, -1.0, "y"))),
        PromptLogprob(41, -0.25, 1, "b", ((41, -0.25, "b"), (7, -2.0, "x"))))


def _lp(x: float, rank: int, text: str):
    return SimpleNamespace(logprob=x, rank=rank, decoded_token=text)


def test_the_wire_carries_prompt_logprobs_and_cache_salt():
    sp = SamplingParams(prompt_logprobs=0, cache_salt="tenant-1")
    assert cv.sampling_from_pb(cv.sampling_to_pb(sp)) == sp
    assert cv.sampling_from_pb(cv.sampling_to_pb(SamplingParams())).prompt_logprobs is None  # unset: none asked
    c = Completion("s", "p0", 0, (5,), (-0.5,), "x", FinishReason.STOP, 1, prompt_logprobs=ROWS)
    assert cv.completion_from_pb(cv.completion_to_pb(c)) == c
    assert repr(SamplingParams()) == repr(SamplingParams(prompt_logprobs=None))  # old step fingerprints hold
    assert "prompt_logprobs=2" in repr(SamplingParams(prompt_logprobs=2))


def test_the_worker_asks_vllm_and_reads_its_rows():
    pytest.importorskip("vllm")
    engine = VllmEngine(EngineSettings(model="unused"))
    params = engine._params(EngineRequest("s/p0/0", PROMPT, SamplingParams(prompt_logprobs=2)))
    assert params.prompt_logprobs == 2 and params.skip_reading_prefix_cache  # vLLM skips the cache for them
    job = engine._params(EngineRequest("draft:d", PROMPT, SamplingParams(prompt_logprobs=2), draft_job=True))
    assert job.prompt_logprobs is None
    # vLLM's rows: None, then the prompt token first and the top 2 in rank order, each token once
    rows = [None, {40: _lp(-2.5, 3, "a"), 7: _lp(-0.5, 1, "x"), 9: _lp(-1.0, 2, "y")},
            {41: _lp(-0.25, 1, "b"), 7: _lp(-2.0, 2, "x")}]
    assert _prompt_rows(rows, PROMPT, 2) == ROWS
    assert _prompt_rows([None, {40: _lp(-2.5, 3, "a")}, {41: _lp(-0.25, 1, "b")}], PROMPT, 0) == (
        PromptLogprob(40, -2.5, 3, "a"), PromptLogprob(41, -0.25, 1, "b"))


def test_a_moved_request_keeps_the_first_runs_prompt_logprobs():
    request = EngineRequest("s/p0/0", PROMPT, SamplingParams(max_tokens=10, prompt_logprobs=2))
    last = EngineOutput("s/p0/0", [50, 51], [-1.0, -1.0], ["ab"], prompt_logprobs=ROWS)
    before = partial("s", "p0", 0, None, last, 1, "w1", len(PROMPT), None)
    assert before.prompt_logprobs == ROWS
    moved = resumed(request, before)
    assert moved.sampling.prompt_logprobs is None  # the partial has them: not computed again
    final = EngineOutput("s/p0/0", (52,), (-0.5,), "c", FinishReason.LENGTH)
    assert joined_prompt_logprobs(before, final, len(PROMPT)) == ROWS
    # stopped before its first output: the next worker computes them over prompt + partial, keeps the prompt's
    early = partial("s", "p0", 0, None, None, 1, "w1", len(PROMPT), None)
    assert resumed(request, early).sampling.prompt_logprobs == 2
    extra = PromptLogprob(50, -1.0, 1, "z", ((50, -1.0, "z"), (7, -3.0, "x")))
    longer = EngineOutput("s/p0/0", (52,), (-0.5,), "c", FinishReason.LENGTH, prompt_logprobs=(*ROWS, extra))
    assert joined_prompt_logprobs(early, longer, len(PROMPT)) == ROWS
    # a request moved twice hands on the first run's too
    again = partial("s", "p0", 0, before, EngineOutput("", [52], [-0.5], ["c"]), 1, "w2", len(PROMPT), None)
    assert again.prompt_logprobs == ROWS


def test_the_core_refuses_prompt_logprobs_a_request_did_not_ask_for():
    c = Completion("s", "p0", 0, (5,), (-0.5,), "x", FinishReason.STOP, 1, prompt_logprobs=ROWS)
    check_prompt_logprobs(c, PROMPT, 2, 128, "completion")
    bad = [(PROMPT, None, "completion.prompt_logprobs"),  # not asked
           ((1, 40), 2, "completion.prompt_logprobs"),  # one per prompt token from the second on
           ((1, 40, 42), 2, "completion.prompt_logprobs[1].token_id"),  # names another token
           (PROMPT, 3, "completion.prompt_logprobs[0]")]  # narrower than asked
    for prompt, asked, field in bad:
        with pytest.raises(InvalidRequest) as e:
            check_prompt_logprobs(c, prompt, asked, 128, "completion")
        assert e.value.field == field
    with pytest.raises(InvalidRequest):
        check_prompt_logprobs(c, PROMPT, 2, 8, "completion")  # alternatives outside the vocabulary
    empty = Completion("s", "p0", 0, (), (), "", FinishReason.STOP, 1)
    check_prompt_logprobs(empty, PROMPT, 2, 128, "aborted.partial", partial=True)  # stopped before its first output
    with pytest.raises(InvalidRequest):
        check_prompt_logprobs(empty, PROMPT, 2, 128, "completion")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    return str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny"))


def _app(tokenizer: str):
    """Route stubs as in test_request_fields, each sample answered with ``ROWS`` as its prompt logprobs."""
    core = SimpleNamespace(model_limits=LIMITS, policy_version=0, steps={}, check_step=lambda spec: None,
                           check_requests=lambda spec, *_: None)

    def answer(spec, i):
        rows = ROWS if spec.sampling.prompt_logprobs is not None else ()
        return Completion(spec.step_id, "p0", i, (40 + i, 41), (-0.5, -0.25), "ab", FinishReason.STOP, 0,
                          top_logprobs=(((40 + i, -0.5), (7, -1.5)), ((9, -0.1), (41, -0.25))), prompt_logprobs=rows)

    async def run_requests(spec, *_):
        core.steps[spec.step_id] = spec
        for i in range(spec.sampling.n):
            yield i, answer(spec, i)

    settings = SchedulerSettings(tokenizer=tokenizer, served_model_name="tiny", limits=Limits())
    service = SimpleNamespace(core=core, tokenize=lambda text: list(PROMPT), run_requests=run_requests)
    app = FastAPI()
    scheduler = SimpleNamespace(settings=settings, service=service, ready=True)
    app.include_router(create_router(scheduler, chat=ChatCompletions))
    app.include_router(tokens_router(scheduler))
    return TestClient(app), core


def _post(http, path: str, body: dict) -> tuple[int, dict]:
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    return r.status_code, r.json()


EXPECTED = [None, {"40": {"logprob": -2.5, "rank": 3, "decoded_token": "a"},
                   "7": {"logprob": -0.5, "rank": 1, "decoded_token": "x"},
                   "9": {"logprob": -1.0, "rank": 2, "decoded_token": "y"}},
            {"41": {"logprob": -0.25, "rank": 1, "decoded_token": "b"},  # first, with its place among the top
             "7": {"logprob": -2.0, "rank": 2, "decoded_token": "x"}}]


def test_each_route_answers_prompt_logprobs_in_vllms_layout(tokenizer):
    http, core = _app(tokenizer)
    code, answer = _post(http, "/v1/completions", {"prompt": list(PROMPT), "n": 2, "prompt_logprobs": 2,
                                                    "cache_salt": "s1", "priority": -3})
    assert code == 200, answer
    assert [c["prompt_logprobs"] for c in answer["choices"]] == [EXPECTED, EXPECTED]  # per choice, as vLLM
    [spec] = core.steps.values()
    assert (spec.sampling.prompt_logprobs, spec.sampling.cache_salt) == (2, "s1")
    code, answer = _post(http, "/v1/chat/completions", {"messages": MSG, "prompt_logprobs": 2})
    assert code == 200 and answer["prompt_logprobs"] == EXPECTED  # chat: at the top level
    code, answer = _post(http, "/inference/v1/generate", {"token_ids": list(PROMPT), "cache_salt": "s2",
                                                          "priority": 7, "sampling_params": {"prompt_logprobs": 2}})
    assert code == 200 and answer["prompt_logprobs"] == EXPECTED, answer
    assert [s.sampling.cache_salt for s in core.steps.values()][-1] == "s2"
    code, answer = _post(http, "/v1/completions", {"prompt": list(PROMPT)})
    assert answer["choices"][0]["prompt_logprobs"] is None  # vLLM's choices carry the key, null unless asked
    assert list(core.steps.values())[-1].sampling.prompt_logprobs is None


def test_the_fields_are_checked_by_vllms_rules_and_named(tokenizer):
    http, core = _app(tokenizer)
    cases = [({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": -2}, "prompt_logprobs"),
             ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": "2"}, "prompt_logprobs"),
             ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"), ({"cache_salt": ""}, "cache_salt"),
             ({"cache_salt": "a/b"}, "cache_salt"), ({"cache_salt": "x" * 129}, "cache_salt"),
             ({"cache_salt": 5}, "cache_salt"), ({"priority": "high"}, "priority"), ({"priority": 2**63}, "priority"),
             ({"echo": "yes"}, "echo")]
    for extra, param in cases:
        code, answer = _post(http, "/v1/completions", {"prompt": list(PROMPT), **extra})
        assert (code, answer["error"]["param"]) == (400, param), (extra, answer)
        if "echo" not in extra:
            code, answer = _post(http, "/v1/chat/completions", {"messages": MSG, **extra})
            assert (code, answer["error"]["param"]) == (400, param), (extra, answer)
    code, answer = _post(http, "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {},
                                                          "cache_salt": "@x"})
    assert (code, answer["error"]["param"]) == (400, "cache_salt")
    assert core.steps == {}
    # 0 with stream: accepted, as vLLM, and none computed (a stream carries none)
    r = http.post("/v1/completions", json={"prompt": list(PROMPT), "stream": True, "prompt_logprobs": 0})
    assert r.status_code == 200 and "prompt_logprobs" not in r.text
    assert [s.sampling.prompt_logprobs for s in core.steps.values()] == [None]


def test_echo_puts_the_prompt_before_the_completion(tokenizer):
    http, core = _app(tokenizer)
    code, answer = _post(http, "/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 4})
    assert code == 200 and answer["choices"][0]["text"] == "hi" + "ab" and answer["choices"][0]["logprobs"] is None
    assert list(core.steps.values())[-1].sampling.prompt_logprobs is None  # no logprobs: no prompt logprobs
    code, answer = _post(http, "/v1/completions", {"prompt": list(PROMPT), "echo": True, "logprobs": 1,
                                                    "return_tokens_as_token_ids": True})
    assert code == 200, answer
    [choice] = answer["choices"]
    assert list(core.steps.values())[-1].sampling.prompt_logprobs == 1  # echo's width: logprobs
    lp = choice["logprobs"]
    assert lp["tokens"] == ["token_id:1", "token_id:40", "token_id:41", "token_id:40", "token_id:41"]
    assert lp["token_logprobs"][:3] == [None, -2.5, -0.25] and lp["top_logprobs"][0] is None
    # a prompt position: the first logprobs + 1 entries of vLLM's map (the prompt token, then the most likely)
    assert lp["top_logprobs"][1:3] == [{"token_id:40": -2.5, "token_id:7": -0.5}, {"token_id:41": -0.25,
                                                                                  "token_id:7": -2.0}]
    assert lp["text_offset"] == [0, 10, 21, 32, 43]
    assert choice["prompt_logprobs"] == EXPECTED  # vLLM answers the prompt logprobs echo asked for too
    code, answer = _post(http, "/v1/completions", {"prompt": list(PROMPT), "echo": True, "max_tokens": 0,
                                                    "logprobs": 0, "return_tokens_as_token_ids": True})
    assert code == 200, answer
    [spec, choice] = list(core.steps.values())[-1], answer["choices"][0]
    assert spec.sampling.max_tokens == 1 and len(choice["logprobs"]["tokens"]) == len(PROMPT)  # the prompt alone
    assert choice["text"] == http.post("/detokenize", json={"tokens": list(PROMPT)}).json()["prompt"]
