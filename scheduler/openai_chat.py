"""``/v1/chat/completions`` with vLLM 0.32's request and response shapes, on the completions path.

``messages`` are rendered with the model's chat template (the tokenizer directory's
``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``) the way transformers'
``apply_chat_template`` renders it: a sandboxed jinja2 environment, ``add_generation_prompt=True``,
the tokenizer's special tokens as variables. The text is tokenized without added special tokens,
as vLLM does for chat, and runs as a one-prompt ``/v1/completions`` step (``openai_api``): the same
validation, drafting, straggler watch and exactness. Without a tokenizer or a chat template the
call is refused with 400 naming ``messages``, as vLLM refuses it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from bubblespec.common.types import Completion, Prompt, SamplingParams
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits, StepSpec
from bubblespec.scheduler.openai_api import NULL_RESPONSE_FIELDS, _Completions, _decoder, parse_sampling
from bubblespec.scheduler.openai_prompt import prompt_logprobs_json
from bubblespec.scheduler.request_fields import CHAT

if TYPE_CHECKING:
    from bubblespec.scheduler.app import SchedulerApp

__all__ = ["ChatCompletions", "load_chat_template", "parse_messages", "render_chat"]

ROLES = ("system", "user", "assistant")
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the variables apply_chat_template passes to a template
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_NO_TEMPLATE = ("the model has no chat template (chat_template.jinja or tokenizer_config.json's chat_template "
                "in the scheduler's tokenizer directory); as in vLLM, no default chat template is used")


@cache
def load_chat_template(tokenizer: str) -> tuple[str | None, dict[str, str]]:
    """(chat template or None, special tokens) of a tokenizer directory, or of a tokenizer.json's
    directory. As transformers loads them: ``chat_template.jinja`` over the config's entry, a list of
    named templates gives its "default"; special tokens from special_tokens_map.json and
    tokenizer_config.json (the latter first), as strings."""
    d = Path(tokenizer)
    d = d if d.is_dir() else d.parent
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (d / name).is_file():
            config.update(json.loads((d / name).read_text(encoding="utf-8")))
    template = config.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    special = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items() if k in _SPECIAL}
    return (template if isinstance(template, str) else None), {k: v for k, v in special.items() if isinstance(v, str)}


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` tag (assistant-mask tracking): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@cache
def _compiled(template: str) -> jinja2.Template:
    """transformers' environment: sandboxed, trim_blocks and lstrip_blocks, loop controls, its
    ``tojson`` filter and its ``raise_exception`` and ``strftime_now`` globals."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], special: dict[str, str]) -> str:
    """The prompt text, as ``tokenizer.apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)`` renders it."""
    try:
        return _compiled(template).render(messages=messages, tools=None, documents=None,
                                          add_generation_prompt=True, **special)
    except (jinja2.TemplateError, TypeError) as exc:
        raise InvalidRequest("messages", f"the chat template refused the conversation: {exc}") from None


def _content(raw: Any, i: int) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                     for p in raw):
        return "\n".join(p["text"] for p in raw)  # vLLM's "string" content format
    raise InvalidRequest("messages", f"messages[{i}].content must be a string or a list of text parts "
                                     f"({{\"type\": \"text\", \"text\": ...}}), got {raw!r:.60}")


def parse_messages(raw: Any) -> list[dict]:
    """``messages`` as the template sees them: role, text content, and name when given. Tool
    calls, tool and function messages and non-text content are refused."""
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise InvalidRequest("messages", f"messages[{i}] must be an object with role and content, got {m!r:.40}")
        if m.get("role") not in ROLES:
            raise InvalidRequest("messages", f"messages[{i}].role must be one of {', '.join(ROLES)} "
                                             f"(tool calls are not supported), got {m.get('role')!r:.40}")
        if m.get("tool_calls") or m.get("function_call"):
            raise InvalidRequest("messages", f"messages[{i}]: tool calls are not supported by BubbleSpec")
        message = {"role": m["role"], "content": _content(m.get("content"), i)}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


def _logprobs(c: Completion, n: int, token: Callable[[int], str], text: Callable[[int], str]) -> dict:
    """vLLM's chat logprobs: ``bytes`` are the decoded token's even when ``token`` is "token_id:<id>";
    ``top_logprobs`` lists the first ``n`` (``top_logprobs``) of the sampled token followed by the
    most likely ones (a token once, at its first place), as vLLM 0.32 lists them."""
    def entry(t: int, lp: float, *, with_bytes_of: Callable[[int], str] = text) -> dict:
        return {"token": token(t), "logprob": max(float(lp), -9999.0),
                "bytes": list(with_bytes_of(t).encode("utf-8", errors="replace"))}

    tops = c.top_logprobs or [()] * len(c.token_ids)
    content = []
    for t, lp, alternatives in zip(c.token_ids, c.logprobs, tops, strict=False):
        ranked = dict([(t, lp), *((a, x) for a, x in alternatives if a != t)])
        top = [entry(a, x, with_bytes_of=token) for a, x in list(ranked.items())[:n]]
        content.append({**entry(t, lp), "top_logprobs": top})
    return {"content": content}


class ChatCompletions(_Completions):
    """One ``/v1/chat/completions`` call: one templated prompt, ``n`` choices."""

    ID_PREFIX = "chatcmpl"

    def __init__(self, scheduler: SchedulerApp, body: dict) -> None:
        super().__init__(scheduler, body)
        self.rename = {"prompt": "messages"}
        if body.get("max_completion_tokens") is not None:
            self.rename["max_tokens"] = "max_completion_tokens"
        self.prompt_ids: tuple[int, ...] = ()

    def prompts(self) -> list[Prompt]:
        messages = parse_messages(self.body.get("messages"))
        tok = self.scheduler.settings.tokenizer
        template, special = load_chat_template(tok) if tok else (None, {})
        if template is None:
            raise InvalidRequest("messages", _NO_TEMPLATE)
        text = render_chat(template, messages, special)
        cap = self.scheduler.settings.limits.max_prompt_text_bytes
        if len(text.encode("utf-8", "surrogatepass")) > cap:
            raise InvalidRequest("messages", f"the templated prompt is over {cap} bytes")
        self.prompt_ids = tuple(_decoder(tok).encode(text, add_special_tokens=False).ids)
        return [Prompt("p0", token_ids=self.prompt_ids)]

    def sampling(self, model: ModelLimits) -> SamplingParams:
        """``max_completion_tokens`` over ``max_tokens``; neither: the rest of the model length (vLLM)."""
        body = self.body
        if body.get("logprobs") not in (None, True, False):
            raise InvalidRequest("logprobs", f"must be a boolean, got {body.get('logprobs')!r:.40}")
        top = body.get("top_logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 0):
            raise InvalidRequest("top_logprobs", f"must be an integer >= 0, got {top!r:.40}")
        if top and not body.get("logprobs"):
            raise InvalidRequest("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true "
                                                 "(as in vLLM)")
        self.rename["logprobs"] = "top_logprobs"  # sampling.logprobs is top_logprobs here
        limit = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                     max(1, model.max_model_len - len(self.prompt_ids)))
        return parse_sampling({**body, "max_tokens": limit, "logprobs": (top or 0) if body.get("logprobs") else None},
                              self.scheduler.settings.default_logprobs_mode, CHAT)

    prompt_logprobs: list | None = None
    """vLLM's top-level ``prompt_logprobs`` (the prompt's, from the first choice that finished)."""

    def choice(self, c: Completion, index: int, spec: StepSpec) -> dict:
        assert self.text is not None, "a chat call has a tokenizer (prompts() refuses one without)"
        if spec.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprobs_json(c)
        message = {"role": "assistant", "content": c.text, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "reasoning": None}
        return {"index": index, "message": message,
                "logprobs": _logprobs(c, self.body.get("top_logprobs") or 0, self.token, self.text)
                if self.body.get("logprobs") else None,
                "finish_reason": c.finish_reason.value, "stop_reason": c.stop_reason,
                "token_ids": list(c.token_ids) if self.body.get("return_token_ids") else None}

    def _prompt_ids(self) -> list[int] | None:
        return list(self.prompt_ids) if self.body.get("return_token_ids") else None

    def envelope(self, choices: list, usage: dict | None) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage, "prompt_logprobs": self.prompt_logprobs,
                "prompt_token_ids": self._prompt_ids(), "prompt_text": None, **NULL_RESPONSE_FIELDS}

    def _chunk(self, choices: list, **extra: Any) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def opening(self, spec: StepSpec) -> list[dict]:
        """vLLM's first chunks: one role delta per choice, with the prompt's ids when asked."""
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], prompt_token_ids=self._prompt_ids())
                for i in range(spec.sampling.n)]

    def chunk(self, choice: dict) -> dict:
        delta = {"index": choice["index"], "delta": {"content": choice["message"]["content"]},
                 **{k: choice[k] for k in ("logprobs", "finish_reason", "stop_reason", "token_ids")}}
        return self._chunk([delta])

    def usage_chunk(self, usage: dict) -> dict:
        return self._chunk([], usage=usage)
