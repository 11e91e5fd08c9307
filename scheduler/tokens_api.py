"""vLLM's token-in/token-out route and its tokenizer routes on the scheduler's HTTP port
(docs/INTEGRATIONS.md), with vLLM 0.32's request and response shapes.

- ``POST /inference/v1/generate`` (``vllm serve --enable-scale-out``; prime-rl's and SkyRL's
  clients): ``token_ids`` and a ``sampling_params`` object in, token ids (``output_mode``
  ``tokens``) or token ids and text (``text``) out, whole or streamed. The call runs on the
  completions path (``GenerateCall`` is an ``openai_api._Completions`` served by ``_serve``):
  the same validation, scheduling, drafting and exactness as ``/v1/completions``. The fields
  ``sampling_params`` shares with ``/v1/completions`` go through ``openai_api.parse_sampling``;
  the rest of vLLM's ``SamplingParams`` and every top-level field are in the tables below.
- ``POST /tokenize`` (``prompt``, or ``messages`` through the chat template) and ``POST
  /detokenize``, with the scheduler's tokenizer (``SchedulerSettings.tokenizer``).

Every request field is served or refused by name (400, OpenAI's error shape); vLLM ignores
unknown fields, BubbleSpec refuses them. Logprob entries in ``tokens`` mode carry vLLM 0.32's
``token_id`` and ``rank`` (as 0.33's) and also ``"token": "token_id:<id>"``, vLLM 0.31's form
(its entries were OpenAI chat logprobs), which prime-rl's client checks on every entry
(verifiers 0.4's ``TrainClient`` through ``renderers``; prime-rl pins vLLM 0.26). ``rank`` is
the sampled token's place when the top alternatives show it (or 1 for greedy sampling), else
null: BubbleSpec does not compute it.
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from bubblespec.common.types import Completion, Prompt, SamplingParams
from bubblespec.scheduler.core.types import ErrorCode, InvalidRequest, ModelLimits, StepSpec
from bubblespec.scheduler.core.validate import check_cache_salt
from bubblespec.scheduler.openai_prompt import check_priority, prompt_logprobs_json
from bubblespec.scheduler.openai_api import (
    _Completions,
    _decoder,
    _refusal,
    _serve,
    error,
    parse_sampling,
    read_json,
    unauthorized,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from bubblespec.scheduler.app import SchedulerApp

__all__ = ["GENERATE_FIELDS", "SAMPLING_ONLY_FIELDS", "SHARED_SAMPLING_FIELDS", "TOKENIZE_FIELDS", "GenerateCall",
           "create_router"]

_NOT_HERE = "not implemented by BubbleSpec"
_SERVED = None  # a table entry: the field is honoured; otherwise (why refused, accepted defaults)

GENERATE_FIELDS: dict[str, tuple | None] = {
    "request_id": _SERVED, "token_ids": _SERVED, "sampling_params": _SERVED, "model": _SERVED,
    "return_token_ids": _SERVED, "output_mode": _SERVED, "stream": _SERVED, "stream_options": _SERVED,
    "token_offsets": _SERVED,  # /render's character offsets: vLLM's generate does not read them either
    "features": ("multimodal input is " + _NOT_HERE, ()), "content_parts": ("multimodal input is " + _NOT_HERE, ([],)),
    "reasoning_ended": ("structured output is " + _NOT_HERE, ()),
    "reasoning_parser_kwargs": ("reasoning parsers are " + _NOT_HERE, ()),
    "cache_salt": _SERVED,  # passed to each request's engine (openai_prompt)
    "priority": _SERVED,  # any int64, used for nothing, as vllm serve's default fcfs policy (openai_prompt)
    "kv_transfer_params": ("disaggregated serving is " + _NOT_HERE, ()),
    "ec_transfer_params": ("disaggregated serving is " + _NOT_HERE, ()),
}
"""vLLM 0.32's ``GenerateRequest``, field by field: served, or (why refused, accepted values)."""

SHARED_SAMPLING_FIELDS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "watermarking", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "logprob_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "stream_interval", "structured_outputs", "logit_bias", "allowed_token_ids",
    "bad_words", "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start"})
"""``SamplingParams`` fields that ``/v1/completions`` has too: ``parse_sampling`` serves or refuses them."""

SAMPLING_ONLY_FIELDS: dict[str, tuple | None] = {
    "detokenize": _SERVED,  # the text of output_mode "text"; tokens are the same either way
    "output_kind": _SERVED,  # set by the server from ``stream``, as vLLM's generate route does
    "flat_logprobs": _SERVED,  # a layout inside vLLM: the same JSON
    "skip_reading_prefix_cache": _SERVED,  # a cache hint: the same outputs
    "prompt_logprob_token_ids": ("prompt logprobs are " + _NOT_HERE, ()),
    "prompt_logprob_start": ("prompt logprobs are " + _NOT_HERE, ()),
    "trace_decode_token_ids": ("trace replay is " + _NOT_HERE, ()),
    "extra_args": ("engine plugins are " + _NOT_HERE, ({},)),
    "skip_clone": ("an engine-internal flag", (False,)), "output_text_buffer_length": ("an engine-internal field", (0,)),
}
"""The other fields of vLLM 0.32's ``SamplingParams``, which only this route takes."""

TOKENIZE_FIELDS: dict[str, tuple | None] = {
    "model": _SERVED, "prompt": _SERVED, "messages": _SERVED, "add_special_tokens": _SERVED,
    "return_token_strs": _SERVED,
    "add_generation_prompt": ("the chat template always gets add_generation_prompt=True", (True,)),
    "continue_final_message": (_NOT_HERE, (False,)), "chat_template": ("the tokenizer's chat template is used", ()),
    "chat_template_kwargs": (_NOT_HERE, ({},)), "media_io_kwargs": (_NOT_HERE, ({},)),
    "mm_processor_kwargs": (_NOT_HERE, ({},)), "tools": ("tool calls are " + _NOT_HERE, ([],)),
}
"""vLLM 0.32's ``TokenizeCompletionRequest`` and ``TokenizeChatRequest``, field by field."""


def _check(body: dict, table: dict, where: str = "") -> None:
    """Refuse the first field of ``body`` that ``table`` does not serve (unknown, or refused and
    not at one of its accepted values; null counts as absent)."""
    for name, value in body.items():
        if name not in table:
            raise InvalidRequest(name, f"{where}{name} is not a field BubbleSpec knows: unknown fields are refused, "
                                       "not ignored (docs/INTEGRATIONS.md lists the fields)")
        entry = table[name]
        if entry is not None and value is not None and not any(_same(value, d) for d in entry[1]):
            raise InvalidRequest(name, f"{where}{name} is not supported by BubbleSpec ({entry[0]}); leave it out "
                                       f"(docs/INTEGRATIONS.md), got {value!r:.60}")


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return isinstance(value, bool) and isinstance(default, bool) and value == default
    return value == default


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _flag(body: dict, name: str) -> bool:
    if body.get(name) not in (None, True, False):
        raise InvalidRequest(name, f"must be a boolean, got {body.get(name)!r:.40}")
    return bool(body.get(name))


def _token_list(raw: Any, name: str, *, empty: bool) -> list[int]:
    if not isinstance(raw, list) or not (raw or empty) or not all(_is_int(t) and 0 <= t < 2**63 for t in raw):
        raise InvalidRequest(name, f"must be a {'' if empty else 'non-empty '}list of token ids (integers >= 0), "
                                   f"got {raw!r:.60}")
    return raw


def _clamp(lp: float) -> float:
    return -9999.0 if math.isnan(lp) else max(float(lp), -9999.0)


class GenerateCall(_Completions):
    """One ``/inference/v1/generate`` call: one prompt of token ids, ``n`` choices."""

    ID_PREFIX = "generate-tokens"

    def __init__(self, scheduler: SchedulerApp, body: dict, header_id: str | None = None):
        _check(body, GENERATE_FIELDS)
        if not isinstance(body.get("sampling_params"), dict):
            raise InvalidRequest("sampling_params", f"must be an object (vLLM's SamplingParams fields), got "
                                                    f"{body.get('sampling_params')!r:.60}")
        _check(body["sampling_params"], {**SAMPLING_ONLY_FIELDS, **dict.fromkeys(SHARED_SAMPLING_FIELDS)},
               "sampling_params.")
        super().__init__(scheduler, body)
        self.rename = {"prompt": "token_ids"}
        rid = header_id if header_id is not None else body.get("request_id")  # vLLM: X-Request-Id wins
        if rid is not None and not isinstance(rid, str):
            raise InvalidRequest("request_id", f"must be a string, got {rid!r:.40}")
        self.id = f"{self.ID_PREFIX}-{uuid.uuid4().hex[:16] if rid is None else rid}"
        self.mode = body.get("output_mode") or "tokens"
        if self.mode not in ("tokens", "text"):
            raise InvalidRequest("output_mode", f"must be tokens or text, got {self.mode!r:.40}")
        if self.mode == "text" and body["sampling_params"].get("detokenize") is False:
            raise InvalidRequest("output_mode", "text needs sampling_params.detokenize to be true (as in vLLM)")
        self.return_ids = _flag(body, "return_token_ids")
        _flag(body, "stream")
        self._stream_options(body.get("stream_options"))
        if not isinstance(body.get("token_offsets"), list | None):
            raise InvalidRequest("token_offsets", "must be a list of [start, end] pairs")
        self.logprobs = body["sampling_params"].get("logprobs")
        self.first_chunk = True

    @staticmethod
    def _stream_options(options: Any) -> None:
        if options is None:
            return
        if not isinstance(options, dict) or any(k not in ("include_usage", "continuous_usage_stats") for k in options):
            raise InvalidRequest("stream_options", f"must be an object with include_usage, got {options!r:.60}")
        if options.get("continuous_usage_stats"):
            raise InvalidRequest("stream_options", "continuous_usage_stats is not supported by BubbleSpec (chunks "
                                                   "are whole choices); leave it false")

    def prompts(self) -> list[Prompt]:
        return [Prompt("p0", token_ids=tuple(_token_list(self.body.get("token_ids"), "token_ids", empty=False)))]

    def sampling(self, model: ModelLimits) -> SamplingParams:
        """``parse_sampling`` on the shared fields. ``max_tokens`` as vLLM's generate route takes
        it: absent, the rest of the model length; larger than that, generation stops at the
        model length (finish_reason ``length``). ``routed_experts_prompt_start`` only trims
        routed-expert data, which BubbleSpec never returns (as vLLM without
        ``--enable-return-routed-experts``)."""
        shared = {k: v for k, v in self.body["sampling_params"].items() if k in SHARED_SAMPLING_FIELDS}
        start = shared.pop("routed_experts_prompt_start", None)
        if start is not None and not (_is_int(start) and start >= 0):
            raise InvalidRequest("routed_experts_prompt_start", f"must be an integer >= 0, got {start!r:.40}")
        room = model.max_model_len - len(self.body["token_ids"])
        if room < 1:
            raise InvalidRequest("token_ids", f"the prompt ({len(self.body['token_ids'])} tokens) leaves no room for "
                                              f"an output token in the model length ({model.max_model_len})")
        asked = shared.get("max_tokens")
        if asked is None or (_is_int(asked) and asked > room):
            shared["max_tokens"] = room
        check_priority(self.body)
        salt = self.body.get("cache_salt")
        check_cache_salt(salt, "cache_salt")
        if self.body.get("stream"):  # vLLM's stream chunks carry no prompt logprobs: none computed
            shared.pop("prompt_logprobs", None)
        return replace(parse_sampling(shared, self.scheduler.settings.default_logprobs_mode), cache_salt=salt)

    prompt_logprobs: list | None = None
    """vLLM's top-level ``prompt_logprobs`` (the prompt's, from the first choice that finished)."""

    def choice(self, c: Completion, index: int, spec: StepSpec) -> dict:
        if spec.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprobs_json(c)
        choice = {"index": index, "finish_reason": c.finish_reason.value, "stop_reason": getattr(c, "stop_reason", None),
                  "token_ids": list(c.token_ids), "routed_experts": None, "sampling_mask": None,
                  "weight_versions": _versions(c), "logprobs": None}
        if self.logprobs is not None:
            greedy = spec.sampling.temperature == 0
            rows = _rows(c, self.logprobs, greedy)
            choice["logprobs"] = {"content": [self._text_entry(*r) if self.mode == "text" else _token_entry(*r)
                                              for r in rows]}
        if self.mode == "text":
            choice["text"] = c.text
        return choice

    def _text_entry(self, token: int, lp: float, rank: int | None, top: list) -> dict:
        """vLLM's ChatCompletionLogProbs entry: decoded tokens and their UTF-8 bytes."""
        def one(t: int, x: float) -> dict:
            text = self.text(t) if self.text else None
            return {"token": text if text is not None else f"token_id:{t}", "logprob": x,
                    "bytes": None if text is None else list(text.encode("utf-8", errors="replace"))}
        return {**one(token, lp), "top_logprobs": [one(t, x) for t, x, _ in top]}

    def envelope(self, choices: list, usage: dict | None) -> dict:
        return {"request_id": self.id, "model": self.model, "created": self.created,
                "usage": None if usage is None else {**usage, "prompt_tokens_details": None,
                                                     "completion_tokens_details": None},
                "prompt_logprobs": self.prompt_logprobs, "prompt_token_id_logprobs": None,
                "prompt_token_ids": list(self.body["token_ids"]) if self.return_ids else None,
                "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
                "output_mode": self.mode, "choices": choices}

    def chunk(self, choice: dict) -> dict:
        """One chunk per finished choice (vLLM sends one per token); the prompt's ids on the first."""
        chunk = {"request_id": self.id, "usage": None, "output_mode": self.mode, "choices": [choice]}
        if self.first_chunk and self.return_ids:
            chunk["prompt_token_ids"] = list(self.body["token_ids"])
        self.first_chunk = False
        return chunk

    def usage_chunk(self, usage: dict) -> dict:
        return {"request_id": self.id, "usage": usage, "output_mode": self.mode, "choices": []}


def _rows(c: Completion, k: int, greedy: bool) -> list[tuple]:
    """(token, logprob, rank, top) per generated token, ``top`` as vLLM lists it: the sampled
    token, then the alternatives most likely first without it, ``max(k, 1)`` entries."""
    alternatives = getattr(c, "top_logprobs", ()) or ()
    rows = []
    for i, (token, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=False)):
        alts = alternatives[i] if i < len(alternatives) else ()
        rank = next((j + 1 for j, (t, _) in enumerate(alts) if t == token), 1 if greedy else None)
        top = [(token, _clamp(lp), rank)] + [(t, _clamp(x), j + 1) for j, (t, x) in enumerate(alts) if t != token]
        rows.append((token, _clamp(lp), rank, top[:max(k, 1)]))
    return rows


def _token_entry(token: int, lp: float, rank: int | None, top: list) -> dict:
    def one(t: int, x: float, r: int | None) -> dict:
        return {"token_id": t, "token": f"token_id:{t}", "logprob": x, "rank": r}
    return {**one(token, lp, rank), "top_logprobs": [one(*e) for e in top]}


def _versions(c: Completion) -> list[dict]:
    """vLLM's weight_versions: the policy version (as a string) of each span of the output."""
    spans = getattr(c, "version_spans", ()) or ((0, c.policy_version),)
    ends = [start for start, _ in spans[1:]] + [len(c.token_ids)]
    return [{"version": str(v), "start": s, "end": e} for (s, v), e in zip(spans, ends, strict=True)]


def _tokenizer(scheduler: SchedulerApp, field: str) -> Tokenizer:
    path = scheduler.settings.tokenizer
    if not path:
        raise InvalidRequest(field, "the scheduler has no tokenizer (SchedulerSettings.tokenizer)")
    return _decoder(path)


def _model_len(scheduler: SchedulerApp) -> int:
    limits = scheduler.service.core.model_limits
    if limits is None:
        raise InvalidRequest("workers", "no worker has connected yet", ErrorCode.UNAVAILABLE)
    return limits.max_model_len


def tokenize(scheduler: SchedulerApp, body: dict) -> dict:
    """vLLM's ``/tokenize``: ``prompt`` (special tokens added by default), or ``messages``
    rendered by the chat template (none added by default), as vLLM does."""
    from bubblespec.scheduler.openai_chat import load_chat_template, parse_messages, render_chat

    _check(body, TOKENIZE_FIELDS)
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise InvalidRequest("prompt", "give either prompt (a string) or messages (a chat), not both or neither")
    strs = _flag(body, "return_token_strs")
    special = not chat if body.get("add_special_tokens") is None else _flag(body, "add_special_tokens")
    tok = _tokenizer(scheduler, "messages" if chat else "prompt")
    if chat:
        template, variables = load_chat_template(scheduler.settings.tokenizer)
        if template is None:
            raise InvalidRequest("messages", "the model has no chat template (as in vLLM, none is assumed)")
        text = render_chat(template, parse_messages(body["messages"]), variables)
    elif not isinstance(text := body["prompt"], str):
        raise InvalidRequest("prompt", f"must be a string, got {text!r:.40}")
    cap = scheduler.settings.limits.max_prompt_text_bytes
    if len(text.encode("utf-8", "surrogatepass")) > cap:
        raise InvalidRequest("messages" if chat else "prompt", f"is over {cap} bytes")
    ids = tok.encode(text, add_special_tokens=special).ids
    return {"count": len(ids), "max_model_len": _model_len(scheduler), "tokens": ids,
            "token_strs": [tok.id_to_token(i) for i in ids] if strs else None}


def detokenize(scheduler: SchedulerApp, body: dict) -> dict:
    """vLLM's ``/detokenize``: the tokens' text, special tokens included; ids outside the
    vocabulary decode to nothing, as in vLLM (the tokenizers library takes ids below 2**32)."""
    _check(body, {"model": _SERVED, "tokens": _SERVED})
    ids = [t for t in _token_list(body.get("tokens"), "tokens", empty=True) if t < 2**32]
    return {"prompt": _tokenizer(scheduler, "tokens").decode(ids, skip_special_tokens=False)}


def create_router(scheduler: SchedulerApp) -> APIRouter:
    """``POST /inference/v1/generate``, ``POST /tokenize``, ``POST /detokenize``; each takes
    the trainer token when the scheduler has one (401 otherwise)."""
    router = APIRouter()

    @router.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        call = functools.partial(GenerateCall, header_id=request.headers.get("x-request-id"))
        return await _serve(scheduler, request, call)

    async def answer(request: Request, handler: Callable[[SchedulerApp, dict], dict]) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        try:
            body = await read_json(request, scheduler.settings.limits.max_request_bytes)
            if body.get("model") and not scheduler.settings.serves_model(body["model"]):
                return error(404, f"The model `{body['model']}` does not exist.", "model")
            return JSONResponse(handler(scheduler, body))
        except InvalidRequest as exc:
            return _refusal(exc)

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await answer(request, tokenize)

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await answer(request, detokenize)

    return router
