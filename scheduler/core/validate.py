"""Validation of trainer requests: every check names the offending field.

``build_step`` turns a trainer's request (client types) into a ``StepSpec`` or raises
``InvalidRequest``. It reads nothing but its arguments, so a refused request changes no state.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from bubblespec.common.types import LOGPROBS_MODES, Prompt, SamplingParams, SchedulingPolicy
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits, PromptSpec, StepSpec

__all__ = [
    "Limits", "build_step", "check_cache_salt", "check_id", "check_request_bytes", "check_sampling", "check_weights_path",
    "prompt_tokens", "worker_message_bound",
]

_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
Tokenize = Callable[[str], tuple[int, ...]]


@dataclass(frozen=True)
class Limits:
    """Request-size limits of the service (scheduler settings). Counts and bytes both: every
    field a trainer sends that reaches a worker is bounded, so the largest message the
    scheduler sends a worker is bounded too (``worker_message_bound``; docs/RELIABILITY.md)."""

    max_prompts: int = 65536
    """Prompts per step."""
    max_samples: int = 16_384
    """Samples per prompt (``sampling.n``): vLLM's own limit (``VLLM_MAX_N_SEQUENCES``)."""
    max_requests: int = 1 << 20
    """Requests (prompts times ``sampling.n``) of one step or call."""
    max_lookahead: int = 65536
    """Lookahead prompts per step, and prompts per Announce."""
    max_stop_strings: int = 16
    """Stop strings per request."""
    max_stop_string_bytes: int = 1024
    """UTF-8 bytes of one stop string."""
    max_stop_token_ids: int = 1024
    """Stop token ids per request."""
    max_logprobs: int = 20
    """Top alternatives per token (``sampling.logprobs``): vLLM's ``max_logprobs``, which the
    workers' engines leave at its default (20); an engine refuses a request that asks for more."""
    max_prompt_text_bytes: int = 2**20
    """UTF-8 bytes of one text prompt (checked before it is tokenized). Token-id prompts are
    bounded by the model length."""
    max_weights_path_bytes: int = 4096
    """UTF-8 bytes of an UpdatePolicy ``weights_path`` (sent to every worker)."""
    max_request_bytes: int = 32 * 2**20
    """Serialized bytes of one Generate request. The gRPC message limit
    (``SchedulerSettings.max_message_bytes``) applies first: keep this one below it."""
    max_announce_bytes: int = 32 * 2**20
    """Serialized bytes of one Announce request."""


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_request_bytes(size: int, limit: int, field: str = "request") -> None:
    """A whole request (``message.ByteSize()``) within its limit."""
    if size > limit:
        raise InvalidRequest(field, f"is {size} bytes; at most {limit} bytes are accepted")


def check_weights_path(path: str, limits: Limits) -> None:
    if _utf8_len(path) > limits.max_weights_path_bytes:
        raise InvalidRequest("weights_path", f"is {_utf8_len(path)} bytes; at most {limits.max_weights_path_bytes}")


def worker_message_bound(limits: Limits, max_model_len: int) -> int:
    """Most bytes one message from the scheduler to a worker can take, for requests that
    passed ``limits`` on a model of ``max_model_len`` tokens. The largest are ``Assignment``
    and ``DraftJob``: ids (128 characters each), a prompt (< max_model_len token ids, 5
    bytes each at most as varints) and the sampling parameters (stop strings and stop token
    ids bounded here); ``LoadPolicy`` carries a weights path. Each term is over-counted:
    tags and length prefixes take at most 6 bytes per field or item."""
    ids = 3 * (128 + 6) + 6 * 11  # request key / job id, step id, prompt id; integer fields
    prompt = 5 * max_model_len + 6
    sampling = 6 + 17 * 11 + limits.max_stop_strings * (limits.max_stop_string_bytes + 6) \
        + 5 * limits.max_stop_token_ids + 6
    load = limits.max_weights_path_bytes + 6 + 11
    return 16 + max(ids + prompt + sampling, load)


def check_id(value: str, field: str) -> None:
    """Ids (step, prompt, worker) are 1-128 characters of [A-Za-z0-9._:-]: no "/", no paths."""
    if not isinstance(value, str) or not _ID.match(value):
        raise InvalidRequest(field, f"must be 1-128 characters of [A-Za-z0-9._:-], got {value!r:.80}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return _is_int(x) or isinstance(x, float)


_JUST_INT = {int}


def _plain_ids_in_vocab(ids: tuple[object, ...], vocab_size: int) -> bool:
    """Fast path of the per-token check (a step's prompts: 65,536 with the lookahead at the
    simulator's scale): True when every id is a plain ``int`` in [0, vocab_size). False only
    sends the ids through the per-token loop, which accepts int subclasses other than bool
    as before and names the first bad id."""
    if not ids:
        return True
    if set(map(type, ids)) != _JUST_INT:  # type() over the ids in C: no Python frame per token
        return False
    ints = cast("tuple[int, ...]", ids)
    return min(ints) >= 0 and max(ints) < vocab_size


def check_sampling(sp: SamplingParams, limits: Limits, model: ModelLimits) -> None:
    if not _is_int(sp.n) or not 1 <= sp.n <= limits.max_samples:
        raise InvalidRequest("sampling.n", f"must be between 1 and {limits.max_samples}, got {sp.n!r:.40}")
    if not _is_real(sp.temperature) or not math.isfinite(sp.temperature) or sp.temperature < 0:
        raise InvalidRequest("sampling.temperature", f"must be a finite number >= 0, got {sp.temperature!r:.40}")
    if not _is_real(sp.top_p) or not math.isfinite(sp.top_p) or not 0 < sp.top_p <= 1:
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {sp.top_p!r:.40}")
    if not _is_int(sp.top_k) or sp.top_k == 0 or sp.top_k < -1:
        raise InvalidRequest("sampling.top_k", f"must be -1 (off) or >= 1, got {sp.top_k!r:.40}")
    if not _is_int(sp.max_tokens) or not 1 <= sp.max_tokens < model.max_model_len:
        raise InvalidRequest(
            "sampling.max_tokens",
            f"must be between 1 and {model.max_model_len - 1} (model length), got {sp.max_tokens!r:.40}",
        )
    if len(sp.stop) > limits.max_stop_strings or any(not isinstance(s, str) or not s for s in sp.stop):
        raise InvalidRequest("sampling.stop", f"at most {limits.max_stop_strings} non-empty strings")
    for i, s in enumerate(sp.stop):
        if _utf8_len(s) > limits.max_stop_string_bytes:
            raise InvalidRequest(f"sampling.stop[{i}]",
                                 f"is {_utf8_len(s)} bytes; at most {limits.max_stop_string_bytes} bytes per stop string")
    if len(sp.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequest("sampling.stop_token_ids",
                             f"at most {limits.max_stop_token_ids} ids, got {len(sp.stop_token_ids)}")
    for i, tok in enumerate(sp.stop_token_ids):
        if not _is_int(tok) or not 0 <= tok < model.vocab_size:
            raise InvalidRequest(f"sampling.stop_token_ids[{i}]",
                                 f"{tok!r:.40} is outside the vocabulary [0, {model.vocab_size})")
    if sp.seed is not None and (not _is_int(sp.seed) or not -(2**63) <= sp.seed < 2**63):
        raise InvalidRequest("sampling.seed", f"must be an int64, in [-2**63, 2**63), got {sp.seed!r:.40}")
    if not _is_int(sp.min_tokens) or not 0 <= sp.min_tokens <= sp.max_tokens:
        raise InvalidRequest("sampling.min_tokens", f"must be between 0 and max_tokens ({sp.max_tokens}), "
                             f"got {sp.min_tokens!r:.40}")
    if not _is_int(sp.logprobs) or not 0 <= sp.logprobs <= limits.max_logprobs:
        raise InvalidRequest("sampling.logprobs", f"must be between 0 and {limits.max_logprobs} (top alternatives "
                             f"per token), got {sp.logprobs!r:.40}")
    if sp.prompt_logprobs is not None and (not _is_int(sp.prompt_logprobs)
                                           or not 0 <= sp.prompt_logprobs <= limits.max_logprobs):
        raise InvalidRequest("sampling.prompt_logprobs", f"must be between 0 and {limits.max_logprobs} (alternatives "
                             f"per prompt position; vLLM's max_logprobs), got {sp.prompt_logprobs!r:.40}")
    check_cache_salt(sp.cache_salt, "sampling.cache_salt")
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
        if not isinstance(getattr(sp, name), bool):
            raise InvalidRequest(f"sampling.{name}", f"must be a boolean, got {getattr(sp, name)!r:.40}")
    if sp.logprobs_mode not in ("", *LOGPROBS_MODES):
        raise InvalidRequest("sampling.logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)} "
                             f"('' = the scheduler's default), got {sp.logprobs_mode!r:.40}")


MAX_CACHE_SALT_CHARS = 128
"""vLLM 0.32's limit on ``cache_salt`` (``generate/base/protocol.py``)."""


def check_cache_salt(salt: object, field: str) -> None:
    """vLLM's rule: None, or a non-empty string of at most 128 characters without ``@``, ``/``,
    ``\\`` or NUL."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise InvalidRequest(field, f"must be a non-empty string if provided (as in vLLM), got {salt!r:.40}")
    if len(salt) > MAX_CACHE_SALT_CHARS or any(c in salt for c in "@/\\\x00"):
        raise InvalidRequest(field, f"must be at most {MAX_CACHE_SALT_CHARS} characters and must not contain '@', '/', "
                                    f"'\\' or NUL (as in vLLM), got {salt!r:.40}")


def prompt_tokens(p: Prompt, field: str, model: ModelLimits, tokenize: Tokenize | None,
                  limits: Limits | None = None) -> tuple[int, ...]:
    if (p.text is None) == (p.token_ids is None):
        raise InvalidRequest(field, "set exactly one of text and token_ids")
    if p.text is not None:
        cap = (limits or Limits()).max_prompt_text_bytes
        if isinstance(p.text, str) and _utf8_len(p.text) > cap:
            raise InvalidRequest(f"{field}.text", f"is {_utf8_len(p.text)} bytes; at most {cap} bytes per text prompt")
        if tokenize is None:
            raise InvalidRequest(f"{field}.text", "the scheduler has no tokenizer configured; send token_ids")
        ids = tuple(tokenize(p.text))
        bad = next((t for t in ids if not _is_int(t) or not 0 <= t < model.vocab_size), None)
        if bad is not None:  # a tokenizer that does not match the workers' model
            raise InvalidRequest(f"{field}.text", f"tokenizes to {bad!r:.40}, outside the vocabulary [0, {model.vocab_size})")
    else:
        ids = tuple(p.token_ids)  # type: ignore[arg-type]
        if not _plain_ids_in_vocab(ids, model.vocab_size):  # else: find the first bad one, name it
            for j, tok in enumerate(ids):
                if not _is_int(tok) or not 0 <= tok < model.vocab_size:
                    raise InvalidRequest(f"{field}.token_ids[{j}]",
                                         f"{tok!r:.40} is outside the vocabulary [0, {model.vocab_size})")
    if not ids:
        raise InvalidRequest(field, "prompt is empty")
    if len(ids) >= model.max_model_len:
        raise InvalidRequest(field, f"prompt has {len(ids)} tokens; the model length is {model.max_model_len}")
    return ids


def _prompts(prompts: Sequence[Prompt], sp: SamplingParams, model: ModelLimits, tokenize: Tokenize | None,
             limits: Limits) -> tuple[PromptSpec, ...]:
    seen: set[str] = set()
    out = []
    for i, p in enumerate(prompts):
        field = f"prompts[{i}]"
        check_id(p.prompt_id, f"{field}.prompt_id")
        if p.prompt_id in seen:
            raise InvalidRequest(f"{field}.prompt_id", f"duplicate prompt id {p.prompt_id!r}")
        seen.add(p.prompt_id)
        ids = prompt_tokens(p, field, model, tokenize, limits)
        if not _is_int(p.max_tokens):
            raise InvalidRequest(f"{field}.max_tokens", f"must be an integer, got {p.max_tokens!r:.40}")
        max_tokens = p.max_tokens or sp.max_tokens
        if max_tokens < 0:
            raise InvalidRequest(f"{field}.max_tokens", f"must be >= 0, got {p.max_tokens}")
        if max_tokens < sp.min_tokens:
            raise InvalidRequest(f"{field}.max_tokens", f"{max_tokens} is below sampling.min_tokens ({sp.min_tokens})")
        if len(ids) + max_tokens > model.max_model_len:
            raise InvalidRequest(
                f"{field}.max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model length {model.max_model_len}",
            )
        out.append(PromptSpec(p.prompt_id, ids, max_tokens))
    return tuple(out)


def build_step(
    *,
    step_id: str,
    policy_version: int,
    prompts: Sequence[Prompt],
    sampling: SamplingParams,
    lookahead: Sequence[Prompt] = (),
    policy: SchedulingPolicy = SchedulingPolicy.QUEUE,
    use_drafts: bool = True,
    straggler_watch: bool = True,
    limits: Limits,
    model: ModelLimits,
    tokenize: Tokenize | None = None,
    resumable: bool = True,
) -> StepSpec:
    """Validate a Generate request; raise ``InvalidRequest`` naming the first bad field.
    ``resumable`` False: an independent call, never resumed by its id (HTTP calls get fresh
    ids), so no ``fingerprint`` of its content is made ('')."""
    check_id(step_id, "step_id")
    if not prompts:
        raise InvalidRequest("prompts", "the batch is empty")
    if len(prompts) > limits.max_prompts:
        raise InvalidRequest("prompts", f"at most {limits.max_prompts} prompts per step, got {len(prompts)}")
    if len(lookahead) > limits.max_lookahead:
        raise InvalidRequest("lookahead", f"at most {limits.max_lookahead} prompts, got {len(lookahead)}")
    check_sampling(sampling, limits, model)
    if len(prompts) * sampling.n > limits.max_requests:
        raise InvalidRequest("sampling.n", f"{len(prompts)} prompts x n {sampling.n} = {len(prompts) * sampling.n} "
                             f"requests, at most {limits.max_requests} per step or call")
    specs = _prompts(prompts, sampling, model, tokenize, limits)
    ahead = tuple(prompt_tokens(p, f"lookahead[{i}]", model, tokenize, limits) for i, p in enumerate(lookahead))
    fingerprint = ""
    if resumable:
        digest = hashlib.sha256(repr((policy_version, specs, sampling, ahead, policy.value, use_drafts)).encode())
        fingerprint = digest.hexdigest()[:32]
    return StepSpec(
        step_id=step_id, policy_version=policy_version, prompts=specs, sampling=sampling,
        lookahead=ahead, policy=policy, use_drafts=use_drafts, straggler_watch=straggler_watch,
        fingerprint=fingerprint,
    )
