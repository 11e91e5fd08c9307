"""Every request field of vLLM 0.32's ``/v1/completions`` and ``/v1/chat/completions``, and what
BubbleSpec does with it: an allow-list.

A field is either served (``Served``: implemented with vLLM's semantics, end to end where it
reaches the engine) or refused unless left at its default (``Refused``: answered 400 naming it,
so that no request is silently answered under other semantics than it asked for). A field that
is in neither table is refused too, also by name: vLLM would ignore an unknown field with a
warning, and a misspelt ``min_tokens`` would then quietly sample something else.
``check_fields`` runs before anything else of the request, so a refusal changes no state.

``ENGINE_FIELDS`` says, for each field of vLLM's ``SamplingParams``, where its value comes from
in BubbleSpec (a request field, or the worker). ``tests/unit/test_request_fields.py`` checks
that the three tables name every field of vLLM's request models and ``SamplingParams``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bubblespec.scheduler.core.types import InvalidRequest

__all__ = ["CHAT", "COMPLETIONS", "ENGINE_FIELDS", "Refused", "Served", "check_fields", "check_stream_options"]


@dataclass(frozen=True)
class Served:
    """Implemented: the value is honoured (``note``: how, in a few words)."""

    note: str = ""


@dataclass(frozen=True)
class Refused:
    """Not implemented: accepted only at one of ``defaults`` (JSON null always counts as absent)."""

    why: str
    defaults: tuple = ()


_NOT_HERE = "not implemented by BubbleSpec"
_SPEC = "vLLM refuses it with speculative decoding, which every BubbleSpec worker runs"
_BEAM = "beam search is not implemented by BubbleSpec"
_RENDER = "only vLLM's render endpoints use it"
_DISAGG = "disaggregated serving is not implemented by BubbleSpec"

_SHARED: dict[str, Served | Refused] = {
    "model": Served("the served model name; another name is 404, as in vLLM"),
    "n": Served(), "max_tokens": Served(), "temperature": Served(), "top_p": Served(), "top_k": Served(),
    "seed": Served("any int64; sample i uses seed + i modulo 2**64; -1 = none, as in vLLM"),
    "stop": Served(), "stop_token_ids": Served(), "ignore_eos": Served(),
    "min_tokens": Served(), "include_stop_str_in_output": Served(), "skip_special_tokens": Served(),
    "spaces_between_special_tokens": Served(),
    "stream": Served("one chunk per finished choice, not per token"),
    "stream_options": Served("include_usage; continuous_usage_stats refused"),
    "user": Served("accepted and used for nothing, as vLLM does"),
    "request_id": Served("the response id is <prefix>-<request_id>, as in vLLM"),
    "return_token_ids": Served(), "return_tokens_as_token_ids": Served(),
    "frequency_penalty": Refused(_NOT_HERE, (0,)), "presence_penalty": Refused(_NOT_HERE, (0,)),
    "repetition_penalty": Refused(_NOT_HERE, (1,)),
    "min_p": Refused(_SPEC, (0,)), "logit_bias": Refused(_SPEC, ({},)),
    "use_beam_search": Refused(_BEAM, (False,)), "length_penalty": Refused(_BEAM, (1,)),
    "watermarking": Refused(_NOT_HERE, (False,)),
    "truncate_prompt_tokens": Refused(_NOT_HERE), "truncation_side": Refused(_NOT_HERE),
    "allowed_token_ids": Refused(_NOT_HERE), "bad_words": Refused(_NOT_HERE, ([],)),
    "prompt_logprobs": Served("0 to 20 (vLLM's max_logprobs): per prompt token from the second on, its logprob, "
                              "rank and that many alternatives, vLLM's layout; with stream only 0 (none sent)"),
    "logprob_token_ids": Refused(_NOT_HERE),
    "response_format": Refused("structured output is " + _NOT_HERE, ({"type": "text"},)),
    "structured_outputs": Refused("structured output is " + _NOT_HERE),
    "priority": Served("any int64, used for nothing, as vllm serve's default fcfs scheduling policy does"),
    "session_id": Refused(_NOT_HERE),
    "cache_salt": Served("passed to each request's engine: prefix-cache isolation, vLLM's checks"),
    "routed_experts_prompt_start": Refused(_NOT_HERE, (0,)),
    "return_token_offsets": Refused(_RENDER, (False,)), "mm_payload": Refused(_RENDER, ("tensors",)),
    "return_mm_kwargs": Refused(_RENDER), "kv_transfer_params": Refused(_DISAGG),
    "ec_transfer_params": Refused(_DISAGG), "vllm_xargs": Refused(_NOT_HERE, ({},)),
    "repetition_detection": Refused(_NOT_HERE), "thinking_token_budget": Refused(_NOT_HERE, (-1,)),
    "stream_interval": Refused("streams send whole choices"),
}

COMPLETIONS: dict[str, Served | Refused] = {
    **_SHARED,
    "prompt": Served("text, texts, token ids or token-id lists"),
    "logprobs": Served("0 to 20: the sampled token and that many alternatives per token"),
    "echo": Served("the prompt's text (and with logprobs its tokens' logprobs) before the completion's"),
    "suffix": Refused("vLLM refuses it too", ("",)),
    "prompt_embeds": Refused(_NOT_HERE),
    "add_special_tokens": Refused("text prompts get the tokenizer's special tokens (vLLM's default)", (True,)),
}
"""``/v1/completions``: vLLM 0.32's ``CompletionRequest``, field by field."""

CHAT: dict[str, Served | Refused] = {
    **_SHARED,
    "messages": Served("system, user and assistant text messages"),
    "logprobs": Served("true: the sampled token's logprob, with top_logprobs alternatives"),
    "top_logprobs": Served("0 to 20"),
    "max_completion_tokens": Served("over max_tokens; neither: the rest of the model length"),
    "tools": Refused("tool calls are " + _NOT_HERE, ([],)),
    "tool_choice": Refused("tool calls are " + _NOT_HERE, ("none", "auto")),
    "parallel_tool_calls": Refused("tool calls are " + _NOT_HERE, (True,)),
    "reasoning_effort": Refused("reasoning parsers are " + _NOT_HERE),
    "include_reasoning": Refused("reasoning parsers are " + _NOT_HERE, (True,)),
    "echo": Refused(_NOT_HERE, (False,)),
    "add_generation_prompt": Refused("the chat template always gets add_generation_prompt=True", (True,)),
    "continue_final_message": Refused(_NOT_HERE, (False,)),
    "add_special_tokens": Refused("the templated prompt is tokenized without added special tokens "
                                  "(vLLM's chat default)", (False,)),
    "documents": Refused(_NOT_HERE), "chat_template": Refused("the tokenizer's chat template is used"),
    "chat_template_kwargs": Refused(_NOT_HERE, ({},)), "media_io_kwargs": Refused(_NOT_HERE, ({},)),
    "mm_processor_kwargs": Refused(_NOT_HERE, ({},)), "return_prompt_text": Refused(_NOT_HERE, (False,)),
}
"""``/v1/chat/completions``: vLLM 0.32's ``ChatCompletionRequest``, field by field."""

ENGINE_FIELDS: dict[str, str] = {
    **{name: "the request field of that name" for name in (
        "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "include_stop_str_in_output")},
    "n": "1: the scheduler runs sample i of a request field n as a request of its own",
    "seed": "the request's seed + i for sample i, modulo 2**64",
    "max_tokens": "max_tokens (chat: max_completion_tokens over max_tokens), less what a moved request made",
    "logprobs": "the request's logprobs (chat: top_logprobs); none for draft jobs",
    "prompt_logprobs": "the request's prompt_logprobs (completions with echo and logprobs and without it: "
                       "logprobs); none for draft jobs, nor for a moved request whose partial has them",
    **{name: "the refused request field of that name, at its default" for name in (
        "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "watermarking", "logprob_token_ids",
        "structured_outputs", "logit_bias", "allowed_token_ids", "bad_words",
        "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start", "stream_interval")},
    "prompt_logprob_token_ids": "never set", "prompt_logprob_start": "never set", "trace_decode_token_ids": "never set",
    "flat_logprobs": "vLLM's default", "skip_clone": "vLLM's default", "skip_reading_prefix_cache": "vLLM's default",
    "output_text_buffer_length": "vLLM's (from stop strings)",
    "detokenize": "the worker: on, except for draft jobs without stop strings",
    "output_kind": "the worker: DELTA", "extra_args": "the worker: the request's drafts",
    "_eos_token_id": "vLLM's", "_all_stop_token_ids": "vLLM's", "_watermarking_skipped": "vLLM's",
    "_bad_words_token_ids": "vLLM's",
}
"""Each field of vLLM 0.32's ``SamplingParams``: where the worker's value comes from."""


def _same(value: Any, default: Any) -> bool:
    """``value`` equals ``default`` as JSON values: booleans are not numbers, 0 == 0.0."""
    if isinstance(value, bool) or isinstance(default, bool):
        return isinstance(value, bool) and isinstance(default, bool) and value == default
    return value == default


def check_fields(body: Mapping[str, Any], table: Mapping[str, Served | Refused]) -> None:
    """Refuse (``InvalidRequest`` naming the field) the first field of ``body`` that ``table``
    does not serve: unknown, or refused and not at one of its defaults."""
    for name, value in body.items():
        entry = table.get(name)
        if entry is None:
            raise InvalidRequest(name, "is not a field BubbleSpec knows: unknown fields are refused, not ignored "
                                       "(docs/INTEGRATIONS.md lists the fields)")
        if isinstance(entry, Refused) and value is not None and not any(_same(value, d) for d in entry.defaults):
            shown = "".join(f", {d!r}" for d in entry.defaults)
            raise InvalidRequest(name, f"is not supported by BubbleSpec ({entry.why}); leave it out (or null{shown}) "
                                       f"(docs/INTEGRATIONS.md), got {value!r:.60}")


def check_stream_options(body: Mapping[str, Any]) -> None:
    """``stream`` a boolean; ``stream_options`` only with ``stream`` (vLLM's rule), its
    ``include_usage`` served, ``continuous_usage_stats`` refused unless false."""
    if body.get("stream") not in (None, True, False):
        raise InvalidRequest("stream", f"must be a boolean, got {body.get('stream')!r:.40}")
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options", f"must be an object, got {options!r:.40}")
    if options and not body.get("stream"):
        raise InvalidRequest("stream_options", "can only be defined when `stream=True` (as in vLLM)")
    for key, value in options.items():
        if key not in ("include_usage", "continuous_usage_stats"):
            raise InvalidRequest("stream_options", f"{key!r:.40} is not a stream option (include_usage, "
                                                   "continuous_usage_stats)")
        if value not in (None, True, False):
            raise InvalidRequest("stream_options", f"{key} must be a boolean, got {value!r:.40}")
    if options.get("continuous_usage_stats"):
        raise InvalidRequest("stream_options", "continuous_usage_stats is not supported by BubbleSpec (chunks are "
                                               "whole choices); leave it false")
