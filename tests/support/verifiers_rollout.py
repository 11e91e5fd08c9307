"""A multi-turn rollout through verifiers' own ``TrainClient`` (prime-rl's training client), run in
``.venv-verifiers`` (tests/requirements-verifiers.txt) by tests/integration/test_verifiers_client.py.

Reads a JSON list of rollout jobs on stdin, writes a JSON list of reports on stdout. Imports nothing of BubbleSpec or of
the test suite: it is verifiers' code path as prime-rl drives it (``TrainClient.get_response``
with the chat dialect, prime-rl's train sampling arguments, the rollout's id as ``session_id``),
with an httpx event hook on the client's own connection pool that records each request it
sends (URL, headers, body) and each answer, without changing either.

A job: ``base_url``, ``model``, ``tokenizer`` (the renderer's model directory), ``chat_template``,
``tool_parser``, ``tools``, ``messages`` (the first prompt), ``user_turns`` (one user message
after each answer but the last), ``sampling`` (a ``SamplingConfig``), ``session_id``,
``api_key``. A report: ``turns`` (each: ``request``, ``status``, ``answer`` and what verifiers made
of it: ``prompt_ids``, ``completion_ids``, ``completion_logprobs``, ``content``,
``finish_reason``) and ``error`` (the exception that ended the rollout, or null).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


async def rollout(job: dict) -> dict:
    from renderers import DefaultRendererConfig
    from verifiers.v1.clients import TrainClient, TrainClientConfig
    from verifiers.v1.dialects import ChatDialect
    from verifiers.v1.types import SamplingConfig

    os.environ["VERIFIERS_TEST_API_KEY"] = job["api_key"]
    renderer = DefaultRendererConfig(tool_parser=job["tool_parser"], chat_template=job["chat_template"])
    client = TrainClient(TrainClientConfig(base_url=job["base_url"], api_key_var="VERIFIERS_TEST_API_KEY",
                                           renderer=renderer, renderer_model_name=job["tokenizer"]))
    wire: list[dict] = []

    async def sent(request):
        wire.append({"request": {"method": request.method, "url": str(request.url), "headers": dict(request.headers),
                                 "body": json.loads(request.content) if request.content else None}})

    async def answered(response):
        await response.aread()
        wire[-1].update(status=response.status_code, answer=response.json())

    client.client._client.event_hooks = {"request": [sent], "response": [answered]}
    messages, turns, error = list(job["messages"]), [], None
    try:
        for i in range(len(job["user_turns"]) + 1):
            body = {"model": job["model"], "messages": messages, "tools": job["tools"]}
            seen = len(wire)
            response = await client.get_response(ChatDialect(), body, SamplingConfig(**job["sampling"]),
                                                  session_id=job["session_id"])
            generate = [w for w in wire[seen:] if w["request"]["url"].endswith("/inference/v1/generate")]
            tokens = response.tokens
            turns.append({**generate[-1], "calls": [w["request"]["url"] for w in wire[seen:]],
                          "prompt_ids": list(tokens.prompt_ids), "completion_ids": list(tokens.completion_ids),
                          "completion_logprobs": list(tokens.completion_logprobs),
                          "content": response.message.content, "finish_reason": response.finish_reason})
            messages.append({"role": "assistant", "content": response.message.content or ""})
            if i < len(job["user_turns"]):
                messages.append({"role": "user", "content": job["user_turns"][i]})
    except Exception as exc:  # the report carries it: the test asserts on what failed and why
        cause = exc.__cause__ or exc
        error = {"type": type(exc).__name__, "message": str(exc), "cause": type(cause).__name__,
                 "cause_message": str(cause)}
    finally:
        await client.close()
    return {"turns": turns, "error": error}


async def main(jobs: list[dict]) -> list[dict]:
    return [await rollout(job) for job in jobs]


if __name__ == "__main__":
    json.dump(asyncio.run(main(json.load(sys.stdin))), sys.stdout)
