"""OpenAI-compatible data plane on the scheduler's HTTP port: ``/health``, ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions`` (``openai_chat``) with vLLM 0.32's request and
response shapes, for the subset in docs/INTEGRATIONS.md.

Each completions or chat call is validated by ``build_step`` like a gRPC Generate and joins the
cluster's work as independent requests (``SchedulerService.run_requests``, ``core/pool.py``):
drafting, straggler watch, moves and exactness apply, calls with the same prompt are one group,
and the number of calls in flight is bounded only by the pool's limits (a full pool answers 429
with ``Retry-After``). A refused request is an OpenAI error ``{"error": {message, type,
param, code}}`` naming the OpenAI parameter, and changes no state. Every request field is
served or refused by name (``request_fields``: an allow-list of vLLM 0.32's fields).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import replace
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from bubblespec.common.types import Completion, Prompt, SamplingParams, SchedulingPolicy
from bubblespec.scheduler.core.types import ErrorCode, InvalidRequest, ModelLimits, StepSpec
from bubblespec.scheduler.core.validate import Limits, build_step
from bubblespec.scheduler.openai_prompt import check_priority, echo_logprobs, parse_prompt_logprobs, prompt_logprobs_json
from bubblespec.scheduler.request_fields import COMPLETIONS, Refused, Served, check_fields, check_stream_options

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from bubblespec.scheduler.app import SchedulerApp

__all__ = ["NULL_RESPONSE_FIELDS", "STATUS", "create_router", "error", "openai_param", "parse_prompts", "parse_sampling",
           "read_json", "unauthorized"]

_T = TypeVar("_T")

STATUS: dict[str, int] = {ErrorCode.INVALID_ARGUMENT: 400, ErrorCode.FAILED_PRECONDITION: 400, ErrorCode.ALREADY_EXISTS: 409,
          ErrorCode.NOT_FOUND: 404, ErrorCode.UNAVAILABLE: 503, ErrorCode.CANCELLED: 499, ErrorCode.UNAUTHENTICATED: 401,
          ErrorCode.RESOURCE_EXHAUSTED: 413, ErrorCode.INTERNAL: 500}
"""HTTP status of an ``InvalidRequest`` code, on every OpenAI-shaped route of the scheduler."""
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 409: "ConflictError",
          413: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default


def openai_param(field: str) -> str | None:
    """The OpenAI parameter that a ``build_step`` field name stands for."""
    if field.startswith("sampling."):
        return field[len("sampling."):].split("[")[0]
    if field.startswith("prompts"):
        return "max_tokens" if field.endswith(".max_tokens") else "prompt"
    return None if field in ("step_id", "workers", "request") else field


def error(status: int, message: str, param: str | None = None, retry_after: float | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "BadRequestError"), "param": param,
                      "code": status}}
    headers = None if retry_after is None else {"Retry-After": str(max(1, round(retry_after)))}
    return JSONResponse(body, status_code=status, headers=headers)


def _refusal(exc: InvalidRequest, rename: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI error for ``exc``; ``rename`` maps ``openai_param`` names to the route's own.
    A refusal with a retry hint (a full queue) is 429 with ``Retry-After``, which clients retry."""
    param = openai_param(exc.field)
    param = (rename or {}).get(param, param) if param is not None else None
    message = str(exc) if param is None else f"{param}: {str(exc).split(': ', 1)[-1]}"
    if exc.retry_after is not None:
        return error(429, message, param, exc.retry_after)
    return error(STATUS.get(exc.code, 500), message, param)


def parse_prompts(raw: Any) -> list[Prompt]:
    """``prompt`` as text, list of texts, token ids, or list of token-id lists."""
    if isinstance(raw, str):
        return [Prompt("p0", text=raw)]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("prompt", "must be a string, a list of strings, a list of token ids or a list of lists")
    # JSON gives exactly these types (never a subclass, and bool is not int here); type() is
    # mapped over a prompt's ids in C, not a Python frame per token
    kinds = set(map(type, raw))
    if kinds == {str}:
        return [Prompt(f"p{i}", text=t) for i, t in enumerate(raw)]
    if kinds == {int}:
        return [Prompt("p0", token_ids=tuple(raw))]
    if kinds == {list} and all(x and set(map(type, x)) == {int} for x in raw):
        return [Prompt(f"p{i}", token_ids=tuple(x)) for i, x in enumerate(raw)]
    raise InvalidRequest("prompt", "must be a string, a list of strings, a list of token ids or a list of lists")


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list):
        return tuple(raw)
    raise InvalidRequest("stop", "must be a string or a list of strings")


def _ids(raw: Any) -> tuple:
    if raw is None:
        return ()
    if isinstance(raw, list):
        return tuple(raw)
    raise InvalidRequest("stop_token_ids", "must be a list of token ids")


def parse_sampling(body: dict, default_logprobs_mode: str,
                   fields: dict[str, Served | Refused] = COMPLETIONS) -> SamplingParams:
    """vLLM's defaults: max_tokens 16, temperature 1, top_p 1, top_k off (0 or -1), n 1, seed -1
    = none. Every field of ``body`` must be one ``fields`` serves (``request_fields``); value
    checks are ``build_step``'s."""
    check_fields(body, fields)
    check_stream_options(body)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
        raise InvalidRequest("logprobs", f"must be an integer >= 0 (alternatives per token besides the sampled "
                                         f"token), got {logprobs!r:.40}")
    if body.get("request_id") is not None and not isinstance(body["request_id"], str):
        raise InvalidRequest("request_id", f"must be a string, got {body['request_id']!r:.40}")
    check_priority(body)
    prompt_logprobs = parse_prompt_logprobs(body, _MAX_LOGPROBS)
    if body.get("stream") and not body.get("echo"):
        prompt_logprobs = None  # 0 with stream: vLLM computes them and sends none; BubbleSpec skips them
    top_k, seed = body.get("top_k"), body.get("seed")

    def pick(name: str, default: Any) -> Any:
        return default if body.get(name) is None else body[name]

    return SamplingParams(
        temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=-1 if top_k in (None, 0) else top_k,
        max_tokens=pick("max_tokens", _DEFAULT_MAX_TOKENS), stop=_stop(body.get("stop")),
        stop_token_ids=_ids(body.get("stop_token_ids")), seed=None if seed == -1 else seed, n=pick("n", 1),
        ignore_eos=pick("ignore_eos", False), logprobs_mode=default_logprobs_mode,
        min_tokens=pick("min_tokens", 0), include_stop_str_in_output=pick("include_stop_str_in_output", False),
        skip_special_tokens=pick("skip_special_tokens", True),
        spaces_between_special_tokens=pick("spaces_between_special_tokens", True), logprobs=logprobs or 0,
        prompt_logprobs=prompt_logprobs, cache_salt=body.get("cache_salt"))


_MAX_LOGPROBS = Limits().max_logprobs


@cache
def _decoder(path: str) -> Tokenizer:
    from pathlib import Path

    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def _logprobs(c: Completion, decode: Callable[[int], str]) -> dict:
    """vLLM's completion logprobs layout: per token, ``top_logprobs`` maps the sampled token and
    then the ``logprobs`` most likely ones (a token once, at its first place) to their logprobs."""
    tokens = [decode(t) for t in c.token_ids]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    token_lps = [max(float(lp), -9999.0) for lp in c.logprobs]
    tops = c.top_logprobs or [()] * len(tokens)
    top = [{tok: lp, **{decode(t): max(float(x), -9999.0) for t, x in alternatives}}
           for tok, lp, alternatives in zip(tokens, token_lps, tops, strict=False)]
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": top}


def _choice(c: Completion, index: int, spec: StepSpec, body: dict, token: Callable[[int], str]) -> dict:
    prompt_ids = spec.prompts[index // spec.sampling.n].token_ids
    choice = {"index": index, "text": c.text, "finish_reason": c.finish_reason.value, "stop_reason": c.stop_reason,
              "logprobs": None if body.get("logprobs") is None else _logprobs(c, token)}
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = list(prompt_ids)
        choice["token_ids"] = list(c.token_ids)
    return choice


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


class _Completions:
    """One ``/v1/completions`` call: parse, build the step, run it, shape the answer. The chat
    route (``openai_chat.ChatCompletions``) reuses it, overriding the parsing and shaping hooks
    (``prompts``, ``sampling``, ``choice``, ``envelope``, ``opening``, ``chunk``, ``usage_chunk``)."""

    ID_PREFIX = "cmpl"

    def __init__(self, scheduler: SchedulerApp, body: dict):
        self.scheduler, self.body = scheduler, body
        rid = body.get("request_id")  # vLLM's answer id: <prefix>-<request_id>
        self.id = f"{self.ID_PREFIX}-{rid if isinstance(rid, str) else uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = scheduler.settings.model_name()
        self.rename: dict[str, str] = {}  # openai_param names -> this route's parameter names
        tok = scheduler.settings.tokenizer
        self.text: Callable[[int], str] | None = (
            (lambda t: _decoder(tok).decode([t], skip_special_tokens=False)) if tok else None)
        as_ids = body.get("return_tokens_as_token_ids") or self.text is None
        # vLLM's logprobs token strings
        self.token: Callable[[int], str] = self.text if not as_ids and self.text is not None else _token_id

    def prompts(self) -> list[Prompt]:
        return parse_prompts(self.body.get("prompt"))

    def sampling(self, model: ModelLimits) -> SamplingParams:
        body = self.body
        if body.get("echo") not in (None, True, False):
            raise InvalidRequest("echo", f"must be a boolean, got {body.get('echo')!r:.40}")
        if body.get("echo"):  # vLLM: max_tokens 0 runs one token and answers the prompt alone;
            # the prompt's logprobs come from prompt logprobs of width logprobs unless prompt_logprobs says
            self.echo_only = body.get("max_tokens") == 0
            body = {**body, "max_tokens": 1 if self.echo_only else body.get("max_tokens")}
        sampling = parse_sampling(body, self.scheduler.settings.default_logprobs_mode)
        if body.get("echo") and sampling.prompt_logprobs is None and body.get("logprobs") is not None:
            sampling = replace(sampling, prompt_logprobs=sampling.logprobs)
        return sampling

    echo_only = False
    """``echo`` with ``max_tokens`` 0: the answer is the prompt alone (the one token run is not shown)."""

    def build(self) -> StepSpec:
        s, service = self.scheduler.settings, self.scheduler.service
        model = service.core.model_limits
        if model is None:
            raise InvalidRequest("workers", "no worker has connected yet", ErrorCode.UNAVAILABLE)
        if self.body.get("return_tokens_as_token_ids") not in (None, True, False):
            raise InvalidRequest("return_tokens_as_token_ids", "must be a boolean")
        prompts = self.prompts()
        return build_step(
            step_id=f"http-{next(_CALL_IDS)}", policy_version=service.core.policy_version, prompts=prompts,
            sampling=self.sampling(model), policy=SchedulingPolicy(s.default_policy),
            limits=s.limits, model=model, tokenize=service.tokenize, resumable=False)

    def choice(self, c: Completion, index: int, spec: StepSpec) -> dict:
        choice = _choice(c, index, spec, self.body, self.token)
        if not self.body.get("stream"):  # vLLM's choices carry it (null unless asked); its stream choices do not
            choice["prompt_logprobs"] = None if spec.sampling.prompt_logprobs is None else prompt_logprobs_json(c)
        if self.body.get("echo"):
            self._echo(choice, c, index, spec)
        return choice

    def _echo(self, choice: dict, c: Completion, index: int, spec: StepSpec) -> None:
        """vLLM's ``echo``: the prompt's text before the completion's (none of the completion's for
        ``max_tokens`` 0), and its tokens in the logprobs before the completion's."""
        ids = spec.prompts[index // spec.sampling.n].token_ids
        if self.body.get("return_token_ids"):
            text = ""
        else:
            raw = parse_prompts(self.body.get("prompt"))[index // spec.sampling.n]
            text = raw.text if raw.text is not None else self.prompt_text(ids)
        choice["text"] = text + ("" if self.echo_only else choice["text"])
        if choice.get("logprobs") is None:
            return
        as_ids = bool(self.body.get("return_tokens_as_token_ids")) or self.text is None
        head = echo_logprobs(ids, c, self.body.get("logprobs") or 0, self.token, as_ids)
        if self.echo_only:
            choice["logprobs"] = head
            return
        tail, shift = choice["logprobs"], sum(len(t) for t in head["tokens"])
        choice["logprobs"] = {"text_offset": head["text_offset"] + [o + shift for o in tail["text_offset"]],
                              **{k: head[k] + tail[k] for k in ("token_logprobs", "tokens", "top_logprobs")}}

    def prompt_text(self, ids: tuple[int, ...]) -> str:
        """A token-id prompt's text, as vLLM's renderer decodes it (special tokens kept)."""
        tok = self.scheduler.settings.tokenizer
        if not tok:
            raise InvalidRequest("echo", "the scheduler has no tokenizer (SchedulerSettings.tokenizer) to give the "
                                         "prompt's text")
        return _decoder(tok).decode(list(ids), skip_special_tokens=False)

    single_version = False
    """Run again from scratch rather than go on under a new policy version after a keep pause
    (header ``X-BubbleSpec-Single-Version``; ``core/pool.py``)."""
    session_id = ""
    """The conversation this call continues (header ``X-Session-ID``): its turns go to the
    worker that holds its prefix while that worker has room (``core/affinity.py``)."""

    async def completions(self, spec: StepSpec) -> AsyncIterator[tuple[int, dict, Completion]]:
        """(index, choice, completion) per finished choice, in the order they finish."""
        async for index, c in self.scheduler.service.run_requests(spec, self.single_version, self.session_id):
            yield index, self.choice(c, index, spec), c

    def envelope(self, choices: list, usage: dict | None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage, **NULL_RESPONSE_FIELDS}

    def opening(self, spec: StepSpec) -> list[dict]:
        """Chunks streamed before the first finished choice."""
        return []

    def chunk(self, choice: dict) -> dict:
        return self.envelope([choice], None)

    def usage_chunk(self, usage: dict) -> dict:
        return self.envelope([], usage)

    async def whole(self, spec: StepSpec) -> dict:
        """The whole answer, once every choice has finished (its choices built then, in index
        order: one generator fewer between the service and this call than ``completions``)."""
        service = self.scheduler.service
        found = {index: c async for index, c in service.run_requests(spec, self.single_version, self.session_id)}
        choices = [self.choice(found[i], i, spec) for i in sorted(found)]
        return self.envelope(choices, _usage(spec, found.values()))

    async def stream(self, spec: StepSpec) -> AsyncIterator[str]:
        done: list[Completion] = []
        try:
            async for _, choice, c in self.completions(spec):
                if not done:
                    for chunk in self.opening(spec):
                        yield _sse(chunk)
                done.append(c)
                yield _sse(self.chunk(choice))
            options = self.body.get("stream_options") or {}
            if isinstance(options, dict) and options.get("include_usage"):
                yield _sse(self.usage_chunk(_usage(spec, done, stream=True)))
        except InvalidRequest as exc:
            yield f"data: {bytes(_refusal(exc, self.rename).body).decode()}\n\n"
        yield "data: [DONE]\n\n"


_CALL_IDS = itertools.count()
"""Step ids of calls (``http-<n>``): internal, since a call is never resumed by its id (the
answer's own id is ``_Completions.id``)."""


def _token_id(t: int) -> str:
    return f"token_id:{t}"


NULL_RESPONSE_FIELDS: dict[str, None] = {"service_tier": None, "system_fingerprint": None,
                                               "kv_transfer_params": None, "ec_transfer_params": None,
                                               "metrics": None}
"""Keys of vLLM's non-streaming completion and chat answers that are null here, as in plain
vLLM without disaggregated serving (whose request fields are refused) or its server flag
``--enable-per-request-metrics``."""


def _usage(spec: StepSpec, completions: Iterable[Completion], *, stream: bool = False) -> dict:
    """vLLM's ``UsageInfo``. Its token-details fields are null (a server flag fills them): a whole
    answer carries them as null, a stream's usage chunk (sent without nulls) leaves them out."""
    prompt = sum(len(p.token_ids) for p in spec.prompts)
    generated = sum(len(c.token_ids) for c in completions)
    usage: dict = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    if not stream:
        usage.update(prompt_tokens_details=None, completion_tokens_details=None)
    return usage


async def read_json(request: Request, limit: int, *, empty: dict | None = None) -> dict:
    """The request's JSON object, read up to ``limit`` bytes; an empty body is ``empty`` when
    given (vLLM's optional bodies), else refused."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise InvalidRequest("request", f"body is over {limit} bytes", ErrorCode.RESOURCE_EXHAUSTED)
    if empty is not None and not body.strip():
        return dict(empty)
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("request", f"body is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("request", "body must be a JSON object")
    return parsed


def unauthorized(scheduler: SchedulerApp, request: Request) -> Response | None:
    """401 in OpenAI's shape unless the request carries the trainer token (when the scheduler
    has one); vLLM answers 401 for a missing and for a wrong key alike."""
    if not scheduler.settings.trainer_token:  # no token to check: the headers are not read (every call comes here)
        return None
    from bubblespec.scheduler.auth import http_refusal

    refusal = http_refusal(request.headers.get("authorization"), None, scheduler.settings.trainer_token)
    return None if refusal is None else error(401, refusal[1].split(" (")[0], None)


def create_router(scheduler: SchedulerApp, chat: type[_Completions] | None = None) -> APIRouter:
    """``/health``, ``/v1/models``, ``/v1/completions``, and ``/v1/chat/completions`` served by
    ``chat`` (``openai_chat.ChatCompletions``; the caller passes it, so this module never
    imports the chat module that builds on it) when given."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if scheduler.ready else 503)

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        limits = scheduler.service.core.model_limits
        created = int(time.time())
        card = {"id": scheduler.settings.model_name(), "object": "model", "created": created,
                "owned_by": "bubblespec", "root": scheduler.settings.tokenizer or None, "parent": None,
                "max_model_len": None if limits is None else limits.max_model_len}
        from bubblespec.scheduler.lora_models import adapter_cards

        return JSONResponse({"object": "list", "data": [card, *adapter_cards(scheduler, created)]})

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        if (refusal := unauthorized(scheduler, request)) is not None:
            return refusal
        return await _serve(scheduler, request, _Completions)

    if chat is not None:
        @router.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            if (refusal := unauthorized(scheduler, request)) is not None:
                return refusal
            return await _serve(scheduler, request, chat)

    return router


async def _serve(scheduler: SchedulerApp, request: Request, kind: Callable[[SchedulerApp, dict], _Completions],
                 ) -> Response:
    """One completions or chat call: read, check the model, build the step, answer or stream."""
    rename: dict[str, str] = {}
    try:
        body = await read_json(request, scheduler.settings.limits.max_request_bytes)
        call = kind(scheduler, body)
        sent = _call_headers(request)
        call.single_version = _header_flag(sent, SINGLE_VERSION_HEADER)
        call.session_id = _session_id(sent)
        if (header_id := sent.get("x-request-id")) is not None:  # vLLM: the header wins over the body
            call.id = f"{call.ID_PREFIX}-{header_id}"
        rename = call.rename
        headers = None
        if body.get("model") and not scheduler.settings.serves_model(body["model"]):  # vLLM: no model = the served one
            from bubblespec.scheduler import lora_models as lora_api

            if not isinstance(body["model"], str) or (adapter := await lora_api.adapter_for(scheduler, body["model"])) is None:
                return error(404, f"The model `{body.get('model')}` does not exist.", "model")
            call.model, headers = adapter[0], {lora_api.ADAPTER_VERSION_HEADER: str(adapter[1])}  # a LoRA adapter's
            spec = lora_api.with_adapter(call.build(), adapter)
        else:
            spec = call.build()
        if body.get("stream"):  # refusals (a full queue, no worker) must come before the 200 of a stream
            scheduler.service.core.check_requests(spec)
            return StreamingResponse(call.stream(spec), media_type="text/event-stream", headers=headers)
        answer = await until_disconnected(request, call.whole(spec))
        return Response(status_code=499) if answer is None else JSONResponse(answer, headers=headers)
    except InvalidRequest as exc:
        return _refusal(exc, rename)


SINGLE_VERSION_HEADER = "X-BubbleSpec-Single-Version"
SESSION_HEADER = "X-Session-ID"
MAX_SESSION_ID_CHARS = 256


_CALL_HEADERS = frozenset(name.lower().encode("latin-1") for name in (SINGLE_VERSION_HEADER, SESSION_HEADER, "X-Request-ID"))


def _call_headers(request: Request) -> dict[str, str]:
    """The headers of ``_CALL_HEADERS`` that the call sends (lower-case names; the first of a
    repeated one, as Starlette's ``Headers.get``), read in one pass over the raw headers: most
    calls send none of them, and a miss in ``Headers`` costs a scan and an exception each."""
    found: dict[str, str] = {}
    for name, value in request.scope["headers"]:
        if name in _CALL_HEADERS:
            found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return found


def _session_id(headers: dict[str, str]) -> str:
    raw = headers.get(SESSION_HEADER.lower(), "")
    if len(raw) > MAX_SESSION_ID_CHARS:
        raise InvalidRequest(SESSION_HEADER, f"is {len(raw)} characters, at most {MAX_SESSION_ID_CHARS}")
    return raw


def _header_flag(headers: dict[str, str], name: str) -> bool:
    raw = headers.get(name.lower())
    if raw is None or raw.lower() in ("false", "0", "no"):
        return False
    if raw.lower() in ("true", "1", "yes"):
        return True
    raise InvalidRequest(name, f"must be true or false, got {raw!r:.40}")


async def until_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """Await ``work`` unless the caller disconnects first: then cancel it (its requests are
    aborted on the workers, ``SchedulerService.run_requests``) and return None, as vLLM's
    ``with_cancellation`` does. A stream needs none of this: Starlette cancels it.

    ``work`` runs in the caller's own task, and one task watches for the disconnect and cancels
    that task (not a second task for the work and ``asyncio.wait`` over both: per call, that
    was most of this route's own asyncio overhead under load)."""
    task = asyncio.current_task()
    assert task is not None
    state = {"done": False, "gone": False}

    def on_gone(watch: asyncio.Future) -> None:
        if not state["done"] and not watch.cancelled() and watch.exception() is None:
            state["gone"] = True
            task.cancel()

    watch = asyncio.ensure_future(_disconnect(request))
    watch.add_done_callback(on_gone)
    try:
        return await work
    except asyncio.CancelledError:
        if not state["gone"]:
            raise  # the handler itself was cancelled: the work never outlives its caller
        task.uncancel()
        return None
    finally:
        state["done"] = True
        watch.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
