"""``/inference/v1/generate``, ``/tokenize`` and ``/detokenize`` on the BubbleSpec cluster against a
plain vLLM 0.32 server given the same requests.

The reference is ``python -m vllm.entrypoints.openai.api_server --enable-scale-out`` on the tiny
model, without speculation, with the cluster engines' dtype (the checkpoint's float32) and
logprobs mode (processed): one per session, in a process group of its own, its output in a log
file whose tail a failure prints. The cluster's engines speculate with drafts, so greedy answers
being token-identical to plain vLLM's is the exactness guarantee under test; a seeded request
has the distribution but not the tokens guaranteed, so its logprobs are checked against plain
vLLM's for the same prefix. Differences the docs list (docs/INTEGRATIONS.md) are asserted as such.
The ``vllm_reference`` and ``servers`` fixtures are in conftest.py (shared with test_verifiers_client.py).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.factories import prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LOGPROB_TOLERANCE = 1e-4


async def _both(servers, path: str, body: dict, headers: dict | None = None) -> tuple[httpx.Response, httpx.Response]:
    ours, theirs = servers
    return await asyncio.gather(ours.post(path, json=body, headers=headers), theirs.post(path, json=body,
                                                                                          headers=headers))


def _same_choices(mine: dict, ref: dict) -> None:
    """Token ids, finish and stop reasons equal; logprobs (and their alternatives) within tolerance."""
    assert len(mine["choices"]) == len(ref["choices"])
    for a, b in zip(mine["choices"], ref["choices"], strict=True):
        assert (a["index"], a["token_ids"], a["finish_reason"], a["stop_reason"]) == \
            (b["index"], b["token_ids"], b["finish_reason"], b["stop_reason"])
        assert [(s["start"], s["end"]) for s in a["weight_versions"]] == [(0, len(b["token_ids"]))]
        if b["logprobs"] is None:
            assert a["logprobs"] is None
            continue
        for x, y in zip(a["logprobs"]["content"], b["logprobs"]["content"], strict=True):
            same = ("token_id", "rank") if "token_id" in y else ("token", "bytes")  # output_mode tokens, text
            for entry, theirs in zip([x, *x["top_logprobs"]], [y, *y["top_logprobs"]], strict=True):
                # a rank BubbleSpec does not know is null (documented)
                assert {k: entry[k] for k in same if entry.get(k, 0) is not None} == \
                    {k: theirs[k] for k in same if entry.get(k, 0) is not None}
                assert entry["logprob"] == pytest.approx(theirs["logprob"], abs=LOGPROB_TOLERANCE)


async def test_greedy_generate_is_token_identical_to_plain_vllm(servers):
    body = {"token_ids": list(prompt_ids(71_001, 12)), "request_id": "ref-greedy", "return_token_ids": True,
            "sampling_params": {"temperature": 0.0, "max_tokens": 16, "logprobs": 1}}
    mine, ref = await _both(servers, "/inference/v1/generate", body)
    assert (mine.status_code, ref.status_code) == (200, 200), (mine.text, ref.text)
    mine, ref = mine.json(), ref.json()
    _same_choices(mine, ref)
    assert set(mine) == set(ref) and all(set(a) == set(b) for a, b in zip(mine["choices"], ref["choices"]))
    assert mine["request_id"] == ref["request_id"] == "generate-tokens-ref-greedy"
    assert mine["prompt_token_ids"] == ref["prompt_token_ids"] == body["token_ids"]
    assert mine["usage"] == ref["usage"] and mine["output_mode"] == ref["output_mode"] == "tokens"
    entry, theirs = mine["choices"][0]["logprobs"]["content"][0], ref["choices"][0]["logprobs"]["content"][0]
    assert set(entry) == set(theirs) | {"token"}  # documented: the older form beside vLLM 0.32's token_id
    assert entry["token"] == f"token_id:{entry['token_id']}" and entry["rank"] == theirs["rank"] == 1
    # documented: BubbleSpec's policy version, where vLLM names the trainer's weight version ("default")
    assert ref["choices"][0]["weight_versions"][0]["version"] == "default"
    assert mine["choices"][0]["weight_versions"][0]["version"].isdigit()


async def test_greedy_text_stops_alternatives_and_model_length_match_plain_vllm(servers):
    """The text output with stop strings, stop token ids, top-2 alternatives, and a max_tokens past
    the model length (vLLM's generate route lets it run to the model length)."""
    greedy = {"temperature": 0.0, "max_tokens": 16}
    cases = [
        ({"token_ids": list(prompt_ids(71_003, 10)), "output_mode": "text",
          "sampling_params": {**greedy, "stop": [" ", "e"], "logprobs": 0}}, "text"),
        ({"token_ids": list(prompt_ids(71_003, 10)), "sampling_params": {**greedy, "stop_token_ids": [98, 5]}}, "id"),
        ({"token_ids": list(prompt_ids(71_004, 10)), "sampling_params": {**greedy, "logprobs": 2}}, "top-2"),
        ({"token_ids": list(prompt_ids(71_005, 506)), "sampling_params": {**greedy, "max_tokens": 100,
                                                                          "ignore_eos": True}}, "model length"),
    ]
    answers = await asyncio.gather(*(_both(servers, "/inference/v1/generate", body) for body, _ in cases))
    for (_, name), (mine, ref) in zip(cases, answers, strict=True):
        assert (mine.status_code, ref.status_code) == (200, 200), (name, mine.text, ref.text)
        mine, ref = mine.json(), ref.json()
        _same_choices(mine, ref)
        if name == "text":
            assert mine["choices"][0]["text"] == ref["choices"][0]["text"] and set(mine["choices"][0]) == \
                set(ref["choices"][0])
        if name == "model length":
            assert ref["choices"][0]["finish_reason"] == "length" and len(ref["choices"][0]["token_ids"]) == 6


async def test_seeded_samples_have_plain_vllms_logprobs(servers):
    """Over HTTP a seeded sample fixes its distribution, not its tokens: a step that verifies drafts
    beside it, or a move to another worker, changes which random draws it takes (docs/EXACTNESS.md,
    "Seeds"), so its tokens equal plain vLLM's only where neither happened. What holds always: each
    sampled token's logprob is plain vLLM's for the same prefix (prompt logprobs of prompt + sample)."""
    ours, theirs = servers
    prompt = list(prompt_ids(71_002, 10))
    out = await ours.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {
        "n": 2, "temperature": 1.0, "seed": 1234, "max_tokens": 16, "logprobs": 0}})
    assert out.status_code == 200, out.text
    for choice in out.json()["choices"]:
        ids, content = choice["token_ids"], choice["logprobs"]["content"]
        assert (choice["finish_reason"], len(ids)) == ("length", 16) or (choice["finish_reason"], ids[-1]) == ("stop", 2)
        assert all(e["rank"] is None for e in content)  # documented: not known outside the alternatives
        scored = await theirs.post("/inference/v1/generate", json={"token_ids": prompt + ids, "sampling_params": {
            "temperature": 1.0, "max_tokens": 1, "prompt_logprobs": 0}})
        assert scored.status_code == 200, scored.text
        rows = scored.json()["prompt_logprobs"][len(prompt):]
        expected = [row[str(t)]["logprob"] for row, t in zip(rows, ids, strict=True)]
        assert [e["logprob"] for e in content] == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


async def test_streamed_generate_adds_up_to_plain_vllms_stream(servers):
    body = {"token_ids": list(prompt_ids(71_006, 8)), "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"temperature": 0.0, "max_tokens": 12, "logprobs": 0}}

    async def chunks(http) -> list[dict]:
        import json

        async with http.stream("POST", "/inference/v1/generate", json=body) as r:
            assert r.status_code == 200
            lines = [ln[len("data: "):] async for ln in r.aiter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(x) for x in lines[:-1]]

    mine, ref = await asyncio.gather(*(chunks(http) for http in servers))
    for got in (mine, ref):
        assert got[-1]["choices"] == [] and len({c["request_id"] for c in got}) == 1
    assert mine[-1]["usage"] == ref[-1]["usage"] and set(mine[-1]) == set(ref[-1])
    assert all(set(c) == set(ref[0]) for c in mine[:-1])  # documented: one chunk per choice, vLLM's per token

    def joined(got):
        out: dict[int, tuple[list, list, str | None]] = {}
        for chunk in got[:-1]:
            for c in chunk["choices"]:
                ids, lps, _ = out.setdefault(c["index"], ([], [], None))
                ids += c["token_ids"]
                lps += [e["logprob"] for e in c["logprobs"]["content"]]
                out[c["index"]] = (ids, lps, c["finish_reason"] or out[c["index"]][2])
        return out

    a, b = joined(mine), joined(ref)
    assert sorted(a) == sorted(b) == [0] and (a[0][0], a[0][2]) == (b[0][0], b[0][2])
    assert a[0][1] == pytest.approx(b[0][1], abs=LOGPROB_TOLERANCE)


async def test_tokenize_and_detokenize_answer_as_plain_vllm(servers, cluster):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    bodies = [("/tokenize", {"prompt": "Hello world 2+2="}),
              ("/tokenize", {"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True}),
              ("/tokenize", {"messages": messages}),
              ("/detokenize", {"tokens": [1, 53, 98, 116, 2]}),
              ("/detokenize", {"tokens": []}),
              ("/detokenize", {"tokens": [53, 100_000]})]  # outside the vocabulary: nothing
    for (path, body), (mine, ref) in zip(bodies, await asyncio.gather(*(_both(servers, p, b) for p, b in bodies)),
                                         strict=True):
        assert (mine.status_code, ref.status_code) == (200, 200), (path, mine.text, ref.text)
        assert mine.json() == ref.json(), (path, body)


@pytest.mark.parametrize("path, body, status, param, theirs", [
    # refused by both: the same status; vLLM names pydantic's fields with a "body." prefix (documented)
    ("/inference/v1/generate", {"token_ids": [], "sampling_params": {}}, 400, "token_ids", (400, "body.token_ids")),
    ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"temperature": -1}}, 400, "temperature",
     (400, "temperature")),
    ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {}, "cache_salt": ""}, 400, "cache_salt",
     (400, "cache_salt")),
    ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {}, "model": "other"}, 404, "model",
     (404, "model")),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", (400, "body.tokens.0")),
    # refused by BubbleSpec, served or ignored by vLLM (documented)
    ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"max_tokens": 2, "presence_penalty": 0.5}},
     400, "presence_penalty", (200, None)),
    ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"max_tokens": 2}, "bogus": 1}, 400, "bogus",
     (200, None)),
    ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"max_tokens": 2, "bogus": 1}}, 400, "bogus",
     (200, None)),
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus", (200, None)),
    # served by BubbleSpec (n identical samples, as /v1/completions gives), refused by vLLM (documented)
    ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"n": 2, "temperature": 0, "max_tokens": 2}},
     200, None, (400, None)),
])
async def test_refusals_against_plain_vllm(servers, path, body, status, param, theirs):
    def answer(r: httpx.Response) -> tuple[int, str | None]:
        return r.status_code, None if r.status_code == 200 else r.json()["error"]["param"]

    mine, ref = await _both(servers, path, body)
    assert (answer(mine), answer(ref)) == ((status, param), theirs), (mine.text, ref.text)


def _same_prompt_logprobs(mine: list, ref: list) -> None:
    """vLLM's prompt_logprobs: None first, then per position the same tokens in the same order with
    the same ranks and decoded tokens, logprobs within tolerance."""
    assert mine[0] is None and ref[0] is None and len(mine) == len(ref), (mine, ref)
    for a, b in zip(mine[1:], ref[1:], strict=True):
        assert list(a) == list(b), (a, b)
        for token, theirs in b.items():
            assert set(a[token]) == set(theirs) and (a[token]["rank"], a[token]["decoded_token"]) == \
                (theirs["rank"], theirs["decoded_token"])
            assert a[token]["logprob"] == pytest.approx(theirs["logprob"], abs=LOGPROB_TOLERANCE)


async def test_prompt_logprobs_match_plain_vllm_on_every_route(servers):
    """prompt_logprobs 0 and 3 on generate, completions and chat, greedy and sampled with n=2 (plain
    vLLM refuses n > 1 when greedy): the cluster's engines speculate, plain vLLM does not; prompt
    logprobs come from the prefill pass alone, so they are plain vLLM's, in its layout and places,
    whatever the sampling."""
    prompt = list(prompt_ids(71_010, 14))
    messages = [{"role": "user", "content": "Count: 1 2 3 4"}]
    greedy = {"temperature": 0.0, "max_tokens": 8}
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 8, "n": 2}
    cases = [("/inference/v1/generate", {"token_ids": prompt, "sampling_params": {**greedy, "prompt_logprobs": 0}}),
             ("/inference/v1/generate", {"token_ids": prompt, "sampling_params": {**greedy, "n": 1,
                                                                                  "prompt_logprobs": 3}}),
             ("/v1/completions", {"prompt": prompt, **sampled, "prompt_logprobs": 3}),
             ("/v1/completions", {"prompt": "Hello world 2+2=", **greedy, "prompt_logprobs": 0}),
             ("/v1/chat/completions", {"messages": messages, **sampled, "prompt_logprobs": 2})]
    answers = await asyncio.gather(*(_both(servers, path, body) for path, body in cases))
    for (path, body), (mine, ref) in zip(cases, answers, strict=True):
        assert (mine.status_code, ref.status_code) == (200, 200), (path, mine.text, ref.text)
        mine, ref = mine.json(), ref.json()
        if path == "/v1/completions":
            for a, b in zip(mine["choices"], ref["choices"], strict=True):
                _same_prompt_logprobs(a["prompt_logprobs"], b["prompt_logprobs"])
                assert a["text"] == b["text"] or body["temperature"] > 0
        else:
            _same_prompt_logprobs(mine["prompt_logprobs"], ref["prompt_logprobs"])
            assert set(mine) == set(ref)
        if path == "/inference/v1/generate":
            _same_choices(mine, ref)
        width = (body.get("sampling_params") or body)["prompt_logprobs"]
        rows = (mine["prompt_logprobs"] if "prompt_logprobs" in mine else mine["choices"][0]["prompt_logprobs"])[1:]
        assert all(width <= len(row) <= width + 1 for row in rows) and rows


async def test_echo_matches_plain_vllm(servers):
    """echo: the prompt's text, and with logprobs its tokens, before the completion's; max_tokens 0
    answers the prompt alone."""
    prompt = list(prompt_ids(71_011, 9))
    cases = [{"prompt": "Hello world", "echo": True, "max_tokens": 6, "temperature": 0.0},
             {"prompt": prompt, "echo": True, "max_tokens": 6, "temperature": 0.0, "logprobs": 2},
             {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1, "prompt_logprobs": 3},
             {"prompt": "Hello world", "echo": True, "max_tokens": 4, "temperature": 0.0, "logprobs": 0,
              "return_tokens_as_token_ids": True}]
    answers = await asyncio.gather(*(_both(servers, "/v1/completions", body) for body in cases))
    for body, (mine, ref) in zip(cases, answers, strict=True):
        assert (mine.status_code, ref.status_code) == (200, 200), (body, mine.text, ref.text)
        (a,), (b,) = mine.json()["choices"], ref.json()["choices"]
        assert (a["text"], a["finish_reason"]) == (b["text"], b["finish_reason"]), body
        assert mine.json()["usage"] == ref.json()["usage"]
        if b["prompt_logprobs"] is not None:
            _same_prompt_logprobs(a["prompt_logprobs"], b["prompt_logprobs"])
        if b["logprobs"] is None:
            assert a["logprobs"] is None
            continue
        x, y = a["logprobs"], b["logprobs"]
        assert (x["tokens"], x["text_offset"]) == (y["tokens"], y["text_offset"]), body
        assert [lp is None for lp in x["token_logprobs"]] == [lp is None for lp in y["token_logprobs"]]
        assert [lp for lp in x["token_logprobs"] if lp is not None] == \
            pytest.approx([lp for lp in y["token_logprobs"] if lp is not None], abs=LOGPROB_TOLERANCE)
        for top, theirs in zip(x["top_logprobs"], y["top_logprobs"], strict=True):
            assert (top is None) == (theirs is None)
            if theirs is not None:
                assert list(top) == list(theirs)
                assert list(top.values()) == pytest.approx(list(theirs.values()), abs=LOGPROB_TOLERANCE)


async def test_cache_salt_and_priority_are_accepted_as_plain_vllm_accepts_them(servers):
    """A salt isolates the prefix cache and changes no output; a priority other than 0 is taken and
    changes nothing under vllm serve's default scheduling policy (fcfs), here as there."""
    prompt = list(prompt_ids(71_012, 12))
    greedy = {"temperature": 0.0, "max_tokens": 8}
    cases = [("/inference/v1/generate", {"token_ids": prompt, "cache_salt": "tenant-a", "priority": 5,
                                         "sampling_params": {**greedy, "logprobs": 0}}),
             ("/inference/v1/generate", {"token_ids": prompt, "cache_salt": "tenant-b",
                                         "sampling_params": {**greedy, "logprobs": 0}}),
             ("/v1/completions", {"prompt": prompt, **greedy, "cache_salt": "tenant-a", "priority": -2,
                                  "return_token_ids": True}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **greedy,
                                       "cache_salt": "tenant-c", "priority": 1})]
    answers = await asyncio.gather(*(_both(servers, path, body) for path, body in cases))
    for (path, _), (mine, ref) in zip(cases, answers, strict=True):
        assert (mine.status_code, ref.status_code) == (200, 200), (path, mine.text, ref.text)
        mine, ref = mine.json(), ref.json()
        if path == "/inference/v1/generate":
            _same_choices(mine, ref)
        elif path == "/v1/completions":
            assert [c["token_ids"] for c in mine["choices"]] == [c["token_ids"] for c in ref["choices"]]
        else:
            assert [c["message"]["content"] for c in mine["choices"]] == \
                [c["message"]["content"] for c in ref["choices"]]
    for salt in ("a/b", "x" * 129):  # vLLM's rule, refused by both and named
        mine, ref = await _both(servers, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "cache_salt": salt})
        assert (mine.status_code, ref.status_code) == (400, 400), (mine.text, ref.text)
        assert mine.json()["error"]["param"] == "cache_salt"
    mine, ref = await _both(servers, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2,
                                                         "stream": True})
    assert (mine.status_code, ref.status_code) == (400, 400), (mine.text, ref.text)
    assert mine.json()["error"]["param"] == ref.json()["error"]["param"] == "prompt_logprobs"


async def test_the_sdk_carries_prompt_logprobs_and_cache_salt(servers, client):
    """The gRPC SDK's complete() with prompt_logprobs and cache_salt: each completion's
    ``prompt_logprobs`` are plain vLLM's (``PromptLogprob``: token, logprob, rank, decoded token,
    alternatives), the greedy tokens are plain vLLM's too."""
    from bubblespec.client import SamplingParams

    prompt = list(prompt_ids(71_013, 10))
    [c, d] = await client.complete([prompt], SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2,
                                                            cache_salt="sdk"), n=2)
    _, theirs = servers
    ref = (await theirs.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {
        "temperature": 0.0, "max_tokens": 6, "prompt_logprobs": 2}})).json()
    assert list(c.token_ids) == list(d.token_ids) == ref["choices"][0]["token_ids"]
    for got in (c, d):
        mine = [None] + [{str(p.token_id): {"logprob": p.logprob, "rank": p.rank, "decoded_token": p.token},
                          **{str(t): {"logprob": lp, "rank": j + 1, "decoded_token": text}
                             for j, (t, lp, text) in enumerate(p.top)}} for p in got.prompt_logprobs]
        _same_prompt_logprobs(mine, ref["prompt_logprobs"])
