"""vLLM's ``POST /v1/chat/completions/render`` on the scheduler's HTTP port: a chat request
rendered to what ``/inference/v1/generate`` takes, without generating (SkyRL's
``RemoteInferenceClient.render_chat_completion``).

The request is a ``/v1/chat/completions`` body, checked exactly as that route checks it
(``openai_chat.ChatCompletions``: every field served or refused by name, the model's chat
template, ``add_generation_prompt``, no added special tokens). The answer has vLLM 0.32's
``GenerateRequest`` shape: ``request_id`` (``chatcmpl-<id>``), ``token_ids`` (the rendered
prompt), ``sampling_params`` (the sampling the chat call would run with, as vLLM's
``SamplingParams`` fields, only those ``/inference/v1/generate`` serves, so the answer can be
posted there as it is), ``model``, ``stream`` and ``stream_options``; multimodal ``features``
and ``content_parts`` are null (BubbleSpec takes text only), as are the reasoning and
transfer fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from bubblespec.common.types import SamplingParams
from bubblespec.scheduler.core.types import ErrorCode, InvalidRequest
from bubblespec.scheduler.openai_api import _refusal, error, read_json, unauthorized
from bubblespec.scheduler.openai_chat import ChatCompletions

if TYPE_CHECKING:
    from bubblespec.scheduler.app import SchedulerApp

__all__ = ["create_router", "sampling_fields"]


def sampling_fields(s: SamplingParams) -> dict:
    """``s`` as vLLM's ``SamplingParams`` fields (the ones ``/inference/v1/generate`` serves)."""
    return {"n": s.n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
            "stop": list(s.stop), "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos,
            "max_tokens": s.max_tokens, "min_tokens": s.min_tokens, "logprobs": s.logprobs or None,
            "include_stop_str_in_output": s.include_stop_str_in_output,
            "skip_special_tokens": s.skip_special_tokens,
            "spaces_between_special_tokens": s.spaces_between_special_tokens}


def render(call: ChatCompletions) -> dict:
    """The rendered request (``InvalidRequest`` naming the field for a bad one)."""
    body = call.body
    if body.get("model") and body.get("model") != call.model:
        raise InvalidRequest("model", f"The model `{body.get('model')}` does not exist.", ErrorCode.NOT_FOUND)
    spec = call.build()
    sampling = sampling_fields(spec.sampling)
    if body.get("logprobs"):  # chat's top_logprobs (0 with logprobs true: the sampled token's only)
        sampling["logprobs"] = body.get("top_logprobs") or 0
    return {"request_id": call.id, "token_ids": list(call.prompt_ids), "token_offsets": None, "features": None,
            "content_parts": None, "sampling_params": sampling, "model": call.model, "reasoning_ended": None,
            "reasoning_parser_kwargs": None, "return_token_ids": None, "output_mode": "tokens",
            "stream": bool(body.get("stream")), "stream_options": body.get("stream_options") if body.get("stream")
            else None, "cache_salt": None, "priority": 0, "kv_transfer_params": None, "ec_transfer_params": None}


def create_router(scheduler: SchedulerApp) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions/render")
    async def render_chat_completion(request: Request) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        rename: dict[str, str] = {}
        try:
            call = ChatCompletions(scheduler, await read_json(request, scheduler.settings.limits.max_request_bytes))
            rename = call.rename
            return JSONResponse(render(call))
        except InvalidRequest as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                return error(404, str(exc).split(": ", 1)[-1], exc.field)
            return _refusal(exc, rename)

    return router
