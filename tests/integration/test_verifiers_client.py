"""prime-rl's training client, verifiers 0.4's own ``TrainClient``, against the BubbleSpec cluster,
checked against plain vLLM 0.32 given the same requests.

The client runs in ``.venv-verifiers`` (verifiers needs openai<3; scripts/setup.sh makes it from
tests/requirements-verifiers.txt) as ``tests/support/verifiers_rollout.py``, driven here over
stdin/stdout: a three-turn chat rollout with a tool in the chat template and a tool call and
result in the history, rendered to token ids by verifiers' renderer and posted to
``/inference/v1/generate`` with the rollout's ``X-Session-ID`` on every turn, with prime-rl's
train sampling arguments (greedy here) and cache salt. Its requests are recorded on the client's own
connection pool and replayed to plain vLLM (``vllm_reference``): greedy token ids equal, the
logprobs verifiers read within 1e-4 of plain vLLM's. The renderer for a model without a typed
renderer (``DefaultRenderer``) renders each turn from the messages (it has no bridge): a turn's
prompt extends the previous prompt, not always its completion token for token (the random tiny
model emits ids that decode to nothing).

The tiny model's chat template has no tools, so the renderer gets one that renders them (a
``DefaultRendererConfig`` extra is passed to ``apply_chat_template``, as verifiers takes a
template for fine-tunes) and Hermes-style ``<tool_call>`` blocks (its ``qwen3`` tool parser).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bubblespec.scheduler.prime_rl_routes import INIT_BROADCASTER_REFUSAL

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
DRIVER = ROOT / "tests" / "support" / "verifiers_rollout.py"
LOGPROB_TOLERANCE = 1e-4
SESSION = "rollout-7f3a9c"
MAX_TOKENS = 16

TOOL_TEMPLATE = (
    "{%- if tools %}{{ bos_token + 'tools\\n' }}{% for t in tools %}{{ t['function']['name'] + ': '"
    " + t['function']['description'] + '\\n' }}{% endfor %}{{ eos_token + '\\n' }}{% endif %}"
    "{%- for m in messages %}{{ bos_token + m['role'] + '\\n' }}{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ {'name': c['function']['name'], 'arguments':"
    " c['function']['arguments']} | tojson }}</tool_call>{% endfor %}{{ eos_token + '\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "sum of a and b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
MESSAGES = [
    {"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "5"}, {"role": "user", "content": "and 4+4?"}]
SALT = "3"
# prime-rl's train sampling arguments (prime_rl.configs.orchestrator's to_sampling_args), greedy, with
# the cache salt its orchestrator adds on rollouts from the live policy (the policy version)
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "logprobs": True, "max_completion_tokens": MAX_TOKENS,
            "extra_body": {"cache_salt": SALT}}


def _job(base_url: str, model: str, tiny_model: str, user_turns: list[str]) -> dict:
    return {"base_url": base_url, "model": model, "tokenizer": tiny_model, "chat_template": TOOL_TEMPLATE,
            "tool_parser": "qwen3", "tools": TOOLS, "messages": MESSAGES, "user_turns": user_turns,
            "sampling": SAMPLING, "session_id": SESSION, "api_key": "EMPTY"}


async def _run_verifiers(jobs: list[dict]) -> list[dict]:
    """The driver in verifiers' venv, without blocking this loop (the cluster runs in it)."""
    if not PYTHON.exists():
        pytest.skip(f"{PYTHON} is missing: run bash scripts/setup.sh (it makes verifiers' venv)")
    proc = await asyncio.create_subprocess_exec(str(PYTHON), str(DRIVER), stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(json.dumps(jobs).encode()), 600)
    assert proc.returncode == 0, err.decode(errors="replace")[-4000:]
    return json.loads(out)


async def test_verifiers_train_client_multi_turn_rollout_matches_plain_vllm(servers, cluster, tiny_model):
    ours, theirs = servers
    base, ref_base = (str(http.base_url).rstrip("/") for http in servers)
    model = cluster.scheduler.settings.model_name()
    ref_model = (await theirs.get("/v1/models")).json()["data"][0]["id"]
    mine, on_vllm = await _run_verifiers([
        _job(f"{base}/v1", model, tiny_model, ["and 9+9?", "thanks"]),
        _job(f"{ref_base}/v1", ref_model, tiny_model, []),
    ])
    assert mine["error"] is None, mine["error"]
    turns = mine["turns"]
    assert len(turns) == 3

    # what verifiers sends: one POST per turn, the rollout's session id on each, token ids rendered by
    # its renderer, prime-rl's sampling plus the renderer's stop ids, logprobs=1 and special tokens kept
    assert turns[0]["calls"] == [f"{base}/v1/models", f"{base}/inference/v1/generate"]
    for turn in turns:
        request = turn["request"]
        assert (request["method"], request["url"]) == ("POST", f"{base}/inference/v1/generate")
        assert request["headers"]["x-session-id"] == SESSION
        assert request["headers"]["authorization"] == "Bearer EMPTY"
        assert request["body"] == {"model": model, "token_ids": turn["prompt_ids"], "sampling_params": {
            "temperature": 0.0, "top_p": 1.0, "logprobs": 1, "max_tokens": MAX_TOKENS, "stop_token_ids": [2],
            "skip_special_tokens": False}, "cache_salt": SALT}
        assert turn["status"] == 200
        choice = turn["answer"]["choices"][0]
        assert turn["completion_ids"] == choice["token_ids"] and turn["completion_ids"]
        assert turn["completion_logprobs"] == [e["logprob"] for e in choice["logprobs"]["content"]]
    # each turn's prompt extends the last (the rollout's prefix, which session affinity keeps cached)
    for before, after in zip(turns, turns[1:]):
        assert after["prompt_ids"][:len(before["prompt_ids"])] == before["prompt_ids"]
    shown = (await ours.post("/detokenize", json={"tokens": turns[0]["prompt_ids"]})).json()["prompt"]
    assert shown.startswith("<s>tools\nadd: sum of a and b\n</s>\n") and '<tool_call>{"name": "add"' in shown

    # the same requests to plain vLLM: greedy ids equal, logprobs within tolerance
    replies = await asyncio.gather(*(theirs.post("/inference/v1/generate", json={**t["request"]["body"],
                                                                                  "model": ref_model},
                                                 headers={"X-Session-ID": SESSION}) for t in turns))
    for turn, reply in zip(turns, replies, strict=True):
        assert reply.status_code == 200, reply.text
        ref = reply.json()["choices"][0]
        assert (turn["completion_ids"], turn["answer"]["choices"][0]["finish_reason"]) == \
            (ref["token_ids"], ref["finish_reason"])
        assert turn["completion_logprobs"] == pytest.approx([e["logprob"] for e in ref["logprobs"]["content"]],
                                                            abs=LOGPROB_TOLERANCE)
        # the entries carry vLLM 0.32's token_id and rank, and the "token_id:<id>" token that
        # verifiers checks (vLLM <= 0.31's form; vLLM 0.32 and 0.33 send no token)
        for a, b in zip(turn["answer"]["choices"][0]["logprobs"]["content"], ref["logprobs"]["content"], strict=True):
            assert set(a) == set(b) | {"token"} and a["token"] == f"token_id:{a['token_id']}"
            assert (a["token_id"], a["rank"]) == (b["token_id"], b["rank"])

    # verifiers 0.4 itself refuses plain vLLM 0.32's answer for want of that token
    assert on_vllm["turns"] == [] and on_vllm["error"]["cause"] == "MalformedGenerateResponseError"
    assert "token must be 'token_id:" in on_vllm["error"]["cause_message"]


async def test_prime_rls_own_routes_against_plain_vllm(servers):
    """``/liveness`` as prime-rl's server answers it; ``/init_broadcaster`` (prime-rl's NCCL weight
    broadcast) refused by name with the 404 that plain vLLM, which has neither route, gives."""
    ours, theirs = servers
    live, ref_live = await asyncio.gather(ours.get("/liveness"), theirs.get("/liveness"))
    assert (live.status_code, live.json(), ref_live.status_code) == (200, {"status": "ok"}, 404)
    body = {"host": "127.0.0.1", "port": 29501, "rank_offset": 0, "inference_world_size": 2, "timeout": 60,
            "quantize_in_weight_transfer": False}
    init, ref_init = await asyncio.gather(ours.post("/init_broadcaster", json=body),
                                          theirs.post("/init_broadcaster", json=body))
    assert (init.status_code, ref_init.status_code) == (404, 404)
    assert init.json()["error"]["message"] == INIT_BROADCASTER_REFUSAL
    assert init.json()["error"]["param"] == "init_broadcaster"
