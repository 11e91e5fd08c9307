"""Argument checks of the SDK's public methods: no I/O, run before any network call.

Each malformed argument raises ``InvalidArgument`` whose message starts with the field it names,
in the scheduler's own notation (``prompts[0].token_ids[1]: ...``, ``sampling.top_k: ...``), so a
trainer sees the same kind of error whether the SDK or the scheduler refused the call. Checks here
cover types and what the wire format cannot carry (an int32 field given 2**40, a negative version);
limits that depend on the cluster (vocabulary, model length, sizes) stay with the scheduler.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping

import grpc

from bubblespec.client.errors import InvalidArgument
from bubblespec.common.types import Prompt, SamplingParams, SchedulingPolicy

__all__ = ["check_bool", "check_callable", "check_policy", "check_prompts", "check_sampling", "check_step",
           "check_str", "check_version"]

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
_POLICIES = ", ".join(p.value for p in SchedulingPolicy)


def fail(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {message}", grpc.StatusCode.INVALID_ARGUMENT)


def _kind(value: object) -> str:
    return type(value).__name__


def check_int(value: object, field: str, lo: int = INT32[0], hi: int = INT32[1]) -> int:
    """An integer (bools refused) within ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise fail(field, f"must be an integer, got {_kind(value)}")
    if not lo <= int(value) <= hi:
        raise fail(field, f"must be between {lo} and {hi}, got {int(value)}")
    return int(value)


def check_float(value: object, field: str) -> float:
    """A real number (bools refused); NaN and infinities pass to the scheduler, which names them."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise fail(field, f"must be a number, got {_kind(value)}")
    return float(value)


def check_bool(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise fail(field, f"must be True or False, got {_kind(value)}")
    return value


def check_str(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise fail(field, f"must be a str, got {_kind(value)}")
    return value


def check_callable(value: object, field: str) -> None:
    if value is not None and not callable(value):
        raise fail(field, f"must be callable or None, got {_kind(value)}")


def check_step(step: object, field: str = "step") -> str:
    """A step id: a str, or an int (sent as its decimal text); the scheduler checks its characters."""
    if isinstance(step, str):
        return step
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        return str(int(step))
    raise fail(field, f"must be a str or an int step id, got {_kind(step)}")


def check_version(value: object, field: str) -> int:
    """A policy version: a non-negative int64."""
    return check_int(value, field, 0, INT64[1])


def check_policy(policy: object) -> SchedulingPolicy | None:
    if policy is None or isinstance(policy, SchedulingPolicy):
        return policy
    if isinstance(policy, str) and policy in {p.value for p in SchedulingPolicy}:
        return SchedulingPolicy(policy)
    shown = repr(policy) if isinstance(policy, str) else _kind(policy)
    raise fail("policy", f"must be a SchedulingPolicy ({_POLICIES}) or None, got {shown[:40]}")


def _sequence(value: object, field: str, what: str) -> list:
    """A list-like value (not a str, bytes, mapping or None) as a list."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise fail(field, f"must be a list of {what}, got {_kind(value)}")
    return list(value)


def _is_prompt_like(value: object) -> bool:
    return isinstance(value, (str, Prompt)) or (isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)))


def _token_ids(value: object, field: str) -> tuple[int, ...]:
    ids = _sequence(value, field, "token ids")
    return tuple(check_int(t, f"{field}[{j}]") for j, t in enumerate(ids))


def _prompt(p: object, i: int, field: str) -> Prompt:
    where = f"{field}[{i}]"
    if isinstance(p, str):
        return Prompt(f"p{i}", text=p)
    if isinstance(p, Prompt):
        check_str(p.prompt_id, f"{where}.prompt_id")
        if (p.text is None) == (p.token_ids is None):
            raise fail(where, "a Prompt needs exactly one of text or token_ids")
        if p.text is not None:
            check_str(p.text, f"{where}.text")
        ids = None if p.token_ids is None else _token_ids(p.token_ids, f"{where}.token_ids")
        check_int(p.max_tokens, f"{where}.max_tokens")
        return p if ids is None or ids == p.token_ids else Prompt(p.prompt_id, None, ids, p.max_tokens)
    if p is None or isinstance(p, (bytes, Mapping)) or not isinstance(p, Iterable):
        raise fail(where, f"must be a text, a list of token ids or a Prompt, got {_kind(p)}")
    items = list(p)
    if items and all(_is_prompt_like(t) for t in items):
        raise fail(where, f"must be a text, a list of token ids or a Prompt, got a {_kind(p)} of "
                          f"{_kind(items[0])}; {field} is one flat list of prompts, not one list per step")
    return Prompt(f"p{i}", token_ids=_token_ids(items, f"{where}.token_ids"))


def check_prompts(prompts: object, field: str = "prompts") -> list[Prompt]:
    """Text, token-id lists or ``Prompt`` objects; unnamed prompts get ids ``p0, p1, ...``."""
    return [_prompt(p, i, field) for i, p in enumerate(_sequence(prompts, field, "prompts"))]


def _strings(value: object, field: str) -> tuple[str, ...]:
    return tuple(check_str(s, f"{field}[{j}]") for j, s in enumerate(_sequence(value, field, "strings")))


def check_sampling(sp: object, n: object = None, field: str = "sampling") -> None:
    """A ``SamplingParams`` whose fields have the types (and wire ranges) the scheduler expects."""
    if not isinstance(sp, SamplingParams):
        raise fail(field, f"must be a SamplingParams, got {_kind(sp)}")
    check_float(sp.temperature, f"{field}.temperature")
    check_float(sp.top_p, f"{field}.top_p")
    for name in ("top_k", "max_tokens", "n", "min_tokens", "logprobs"):
        check_int(getattr(sp, name), f"{field}.{name}")
    _strings(sp.stop, f"{field}.stop")
    _token_ids(sp.stop_token_ids, f"{field}.stop_token_ids")
    if sp.seed is not None:
        check_int(sp.seed, f"{field}.seed", *INT64)
    if sp.prompt_logprobs is not None:
        check_int(sp.prompt_logprobs, f"{field}.prompt_logprobs")
    if sp.cache_salt is not None:
        check_str(sp.cache_salt, f"{field}.cache_salt")
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
        check_bool(getattr(sp, name), f"{field}.{name}")
    if not isinstance(sp.logprobs_mode, str):
        raise fail(f"{field}.logprobs_mode", f"must be a str ('processed', 'raw' or ''), got {_kind(sp.logprobs_mode)}")
    if n is not None:
        check_int(n, "n", 1)
