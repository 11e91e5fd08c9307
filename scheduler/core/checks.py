"""Checks a completion must pass before the scheduler delivers it, whoever produced it.

A live completion comes from a worker's stream; a replayed one from the step journal in Redis
(after a scheduler restart). Neither source is trusted: both go through ``check_completion``
(the body names the request it claims, its tokens are inside the vocabulary, its prompt logprobs
are those its request asked for), and a replayed
one also through ``check_replayed`` (it belongs to the step being resumed, to one of its
requests, and to the step's policy version). Pure: no I/O.
"""

from __future__ import annotations

from bubblespec.common.types import Completion, FinishReason
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits, RequestSpec, StepSpec, request_key

__all__ = ["check_completion", "check_prompt_logprobs", "check_replayed"]


def check_completion(c: Completion, key: str, limits: ModelLimits | None,
                     field: str = "completion.completion", request: RequestSpec | None = None,
                     partial: bool = False) -> Completion:
    """``c`` if it is the completion of request ``key`` with every token inside the vocabulary
    (and, given its ``request``, the prompt logprobs it asked for: ``check_prompt_logprobs``),
    else ``InvalidRequest`` naming ``field`` (or ``field.token_ids``)."""
    if request_key(c.step_id, c.prompt_id, c.sample_index) != key:
        raise InvalidRequest(field, f"is for {c.step_id!r:.40}/{c.prompt_id!r:.40}/{c.sample_index}, "
                             f"not for its request_key {key!r:.80}")
    if c.finish_reason is FinishReason.ABORT or c.version_spans:  # the scheduler's own to set (core/pool.py)
        what = "finish_reason abort" if c.finish_reason is FinishReason.ABORT else "version_spans"
        raise InvalidRequest(field, f"{what}: only the scheduler says that of a completion")
    vocab = limits.vocab_size if limits is not None else 0
    ids = c.token_ids
    lowest = min(ids, default=None)  # C-level scans, not a Python loop: this runs once per completion
    if lowest is not None and (lowest < 0 or max(ids) >= vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise InvalidRequest(f"{field}.token_ids", f"{bad} is outside the vocabulary [0, {vocab})")
    if request is not None:
        check_prompt_logprobs(c, request.prompt_token_ids, request.sampling.prompt_logprobs, vocab, field, partial)
    elif c.prompt_logprobs and (min(p.token_id for p in c.prompt_logprobs) < 0
                                or max(p.token_id for p in c.prompt_logprobs) >= vocab):
        raise InvalidRequest(f"{field}.prompt_logprobs", f"a token outside the vocabulary [0, {vocab})")
    return c


def check_prompt_logprobs(c: Completion, prompt: tuple[int, ...], asked: int | None, vocab: int, field: str,
                          partial: bool = False) -> None:
    """``c.prompt_logprobs`` are what its request asked for (``SamplingParams.prompt_logprobs``):
    none when it asked for none, else one per prompt token from the second on, naming that
    token, with ``asked`` alternatives (fewer only in a smaller vocabulary) inside the vocabulary
    and a rank >= 1; a ``partial`` (a stopped request's) may have none yet."""
    got = c.prompt_logprobs
    where = f"{field}.prompt_logprobs"
    if asked is None or (partial and not got):
        if got:
            raise InvalidRequest(where, f"{len(got)} entries; the request asked for none")
        return
    if len(got) != max(0, len(prompt) - 1):
        raise InvalidRequest(where, f"{len(got)} entries for a prompt of {len(prompt)} tokens (one per token from "
                                    "the second on)")
    width = min(asked, vocab)
    for i, p in enumerate(got):
        if p.token_id != prompt[i + 1]:
            raise InvalidRequest(f"{where}[{i}].token_id", f"{p.token_id} is not prompt token {i + 1} ({prompt[i + 1]})")
        if len(p.top) != width or p.rank < 1 or any(not 0 <= t < vocab for t, _, _ in p.top):
            raise InvalidRequest(f"{where}[{i}]", f"rank {p.rank} and {len(p.top)} alternatives; {width} inside the "
                                                  f"vocabulary [0, {vocab}) and a rank >= 1 were asked for")


def check_replayed(c: Completion, key: str, spec: StepSpec, limits: ModelLimits | None) -> Completion:
    """``check_completion``, and ``c`` is a completion of a request of ``spec`` (step, prompt,
    sample index below ``n``, at most the prompt's ``max_tokens`` tokens) made under the
    step's policy version; else ``InvalidRequest`` naming the journal field."""
    field = f"journal[{key!r:.80}]"
    check_completion(c, key, limits, field)
    if c.step_id != spec.step_id:
        raise InvalidRequest(f"{field}.step_id", f"{c.step_id!r:.40} is not the resumed step {spec.step_id!r:.40}")
    prompt = next((p for p in spec.prompts if p.prompt_id == c.prompt_id), None)
    if prompt is None:
        raise InvalidRequest(f"{field}.prompt_id", f"{c.prompt_id!r:.40} is not a prompt of step {spec.step_id!r:.40}")
    if not 0 <= c.sample_index < spec.sampling.n:
        raise InvalidRequest(f"{field}.sample_index", f"{c.sample_index} is outside [0, {spec.sampling.n})")
    if c.policy_version != spec.policy_version:
        raise InvalidRequest(f"{field}.policy_version",
                             f"{c.policy_version} is not the step's policy version {spec.policy_version}")
    if len(c.token_ids) > prompt.max_tokens:
        raise InvalidRequest(f"{field}.token_ids", f"{len(c.token_ids)} tokens; the request allows {prompt.max_tokens}")
    check_prompt_logprobs(c, prompt.token_ids, spec.sampling.prompt_logprobs, limits.vocab_size if limits else 0, field)
    return c
