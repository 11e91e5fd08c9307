"""The prompt side of vLLM 0.32's answers: ``prompt_logprobs``, ``echo`` (``/v1/completions``),
and the request fields that go with them, ``cache_salt`` and ``priority``.

- ``prompt_logprobs`` (completions, chat, ``/inference/v1/generate``'s ``sampling_params``): an
  integer >= 0, or -1 for the whole vocabulary, as vLLM takes it; above vLLM's ``max_logprobs``
  (20, ``Limits.max_logprobs``) refused as vLLM refuses it; with ``stream`` only 0 (vLLM: "not
  available when stream=True"), and then, as in vLLM, the stream carries none. The answer's
  ``prompt_logprobs`` is vLLM's list: None for the first prompt token, then per position a map
  from token id to ``{logprob, rank, decoded_token}``: the prompt token first, then the N most
  likely in rank order, each token once (``prompt_logprobs_json``). Completions put it in each
  choice, chat and generate at the top level. The workers compute them from the prefill pass,
  which never holds draft tokens, so speculation leaves them as plain vLLM's (docs/EXACTNESS.md).
- ``echo`` (completions): the prompt's text (a token-id prompt's decoded text; "" with
  ``return_token_ids``, as vLLM) before the completion's, and with ``logprobs`` the prompt's
  tokens in the logprobs before the completion's (the first with a null logprob), from prompt
  logprobs of width ``logprobs`` unless ``prompt_logprobs`` is given. ``max_tokens`` 0 with
  ``echo`` runs one token and answers the prompt alone, as vLLM does.
- ``cache_salt``: passed to each request's engine (vLLM's prefix-cache isolation); the
  answers are the same with any salt. Calls whose prompts are equal are one sibling group for
  drafts whatever their salts: a draft is verified by the target model either way, so sharing
  drafts across salts changes no output (docs/EXACTNESS.md).
- ``priority``: any int64, accepted and used for nothing, as ``vllm serve`` does with its
  default scheduling policy (fcfs), which never reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bubblespec.common.types import Completion, PromptLogprob
from bubblespec.scheduler.core.types import InvalidRequest

__all__ = ["check_priority", "echo_logprobs", "parse_prompt_logprobs", "prompt_logprobs_json"]

_FLOOR = -9999.0  # vLLM's clamp of -inf in answers (clamp_prompt_logprobs)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_prompt_logprobs(body: dict, max_logprobs: int) -> int | None:
    """``body``'s ``prompt_logprobs`` by vLLM's rules, or None when absent (null)."""
    value = body.get("prompt_logprobs")
    if value is None:
        return None
    if not _is_int(value):
        raise InvalidRequest("prompt_logprobs", f"`prompt_logprobs` must be an integer, got {value!r:.40}")
    if body.get("stream") and (value > 0 or value == -1):
        raise InvalidRequest("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True` (as in vLLM)")
    if value < -1:
        raise InvalidRequest("prompt_logprobs", f"`prompt_logprobs` must be a positive value or -1, got {value}")
    if value == -1 or value > max_logprobs:
        asked = "the whole vocabulary (-1)" if value == -1 else str(value)
        raise InvalidRequest("prompt_logprobs", f"Requested prompt logprobs of {asked}, which is greater than max "
                                                f"allowed: {max_logprobs} (as in vLLM)")
    return value


def check_priority(body: dict) -> None:
    """``priority`` an int64 (null: absent); its value is used for nothing, as in ``vllm serve``'s
    default fcfs scheduling."""
    value = body.get("priority")
    if value is not None and not (_is_int(value) and -(2**63) <= value < 2**63):
        raise InvalidRequest("priority", f"must be an integer (int64), got {value!r:.40}")


def _entry(logprob: float, rank: int, text: str) -> dict:
    return {"logprob": max(float(logprob), _FLOOR), "rank": rank, "decoded_token": text}


def _row(p: PromptLogprob) -> dict[str, dict]:
    """One position as vLLM builds it: the prompt token, then the alternatives in rank order (a
    token among them keeps its first place and takes the later entry, as a dict does)."""
    row = {str(p.token_id): _entry(p.logprob, p.rank, p.token)}
    for j, (t, lp, text) in enumerate(p.top):
        row[str(t)] = _entry(lp, j + 1, text)
    return row


def prompt_logprobs_json(c: Completion) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of ``c``'s prompt: None, then one map per prompt position."""
    return [None, *(_row(p) for p in c.prompt_logprobs)]


def echo_logprobs(prompt_ids: tuple[int, ...], c: Completion, k: int, token: Callable[[int], str],
                  as_ids: bool) -> dict:
    """The prompt's part of vLLM's completion ``logprobs`` under ``echo``: per prompt token its
    string (the first by ``token``, the others vLLM's ``decoded_token``, or ``token_id:<id>``
    with ``as_ids``), logprob (null for the first), and the first ``k + 1`` entries of its
    position's map (null for the first); ``text_offset`` from 0."""
    def name(t: int, text: str) -> str:
        return f"token_id:{t}" if as_ids else text

    tokens: list[str] = [token(prompt_ids[0])] if prompt_ids else []
    lps: list[float | None] = [None] if prompt_ids else []
    tops: list[dict[str, float] | None] = [None] if prompt_ids else []
    for p in c.prompt_logprobs:
        tokens.append(name(p.token_id, p.token))
        lps.append(max(float(p.logprob), _FLOOR))
        by_id = {p.token_id: (p.logprob, p.token)}
        for t, lp, text in p.top:
            by_id[t] = (lp, text)
        tops.append({name(t, text): max(float(lp), _FLOOR) for t, (lp, text) in list(by_id.items())[:k + 1]})
    offsets, at = [], 0
    for piece in tokens:
        offsets.append(at)
        at += len(piece)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}
