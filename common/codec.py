"""Protobuf <-> dataclass conversion: the only place that knows both.

Used by the SDK, the scheduler shell and the worker (edges only).
"""

from __future__ import annotations

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common.types import (
    Completion, FinishReason, Prompt, PromptLogprob, Provenance, SamplingParams, SchedulingPolicy, SourceStats,
    StepSummary,
)

__all__ = [
    "completion_from_pb", "completion_to_pb", "int64_seed", "policy_from_pb", "policy_to_pb", "prompt_from_pb",
    "prompt_to_pb", "sampling_from_pb", "sampling_to_pb", "summary_from_pb", "summary_to_pb",
]

_POLICY_TO_PB = {
    SchedulingPolicy.STATIC: pb.SCHEDULING_POLICY_STATIC,
    SchedulingPolicy.QUEUE: pb.SCHEDULING_POLICY_QUEUE,
    SchedulingPolicy.LONGEST_FIRST: pb.SCHEDULING_POLICY_LONGEST_FIRST,
}
_POLICY_FROM_PB: dict[int, SchedulingPolicy] = {v: k for k, v in _POLICY_TO_PB.items()}
_FINISH_TO_PB = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
                 FinishReason.ABORT: pb.FINISH_REASON_ABORT}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def policy_to_pb(policy: SchedulingPolicy | None) -> pb.SchedulingPolicy:
    return pb.SCHEDULING_POLICY_UNSPECIFIED if policy is None else _POLICY_TO_PB[policy]


def policy_from_pb(value: int) -> SchedulingPolicy | None:
    """None for UNSPECIFIED; ValueError for numbers this version does not know."""
    if value == pb.SCHEDULING_POLICY_UNSPECIFIED:
        return None
    if value not in _POLICY_FROM_PB:
        raise ValueError(f"unknown scheduling policy {value}")
    return _POLICY_FROM_PB[value]


def int64_seed(seed: int) -> int:
    """``seed`` modulo 2**64 as a signed int64 (two's complement): the same seed for torch's
    generator, which reads any seed modulo 2**64. Sample i of a step uses seed + i, which
    passes 2**63 - 1 where the step's seed is near it; vLLM's own ``n`` > 1 does the same sum."""
    return (seed + 2**63) % 2**64 - 2**63


def sampling_to_pb(sp: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_tokens=sp.max_tokens,
        stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), n=sp.n, ignore_eos=sp.ignore_eos,
        logprobs_mode=sp.logprobs_mode, min_tokens=sp.min_tokens,
        include_stop_str_in_output=sp.include_stop_str_in_output, logprobs=sp.logprobs,
    )
    if sp.seed is not None:
        msg.seed = int64_seed(sp.seed)
    if not sp.skip_special_tokens:  # unset = True
        msg.skip_special_tokens = False
    if not sp.spaces_between_special_tokens:
        msg.spaces_between_special_tokens = False
    if sp.prompt_logprobs is not None:
        msg.prompt_logprobs = sp.prompt_logprobs
    if sp.cache_salt is not None:
        msg.cache_salt = sp.cache_salt
    return msg


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Proto3 zeros mean "unset" for top_p, top_k and n; unset booleans of vLLM's that default
    to true (``skip_special_tokens``, ``spaces_between_special_tokens``) are true."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        top_k=msg.top_k if msg.top_k != 0 else -1,
        max_tokens=msg.max_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        seed=msg.seed if msg.HasField("seed") else None,
        n=msg.n,
        ignore_eos=msg.ignore_eos,
        logprobs_mode=msg.logprobs_mode,
        min_tokens=msg.min_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(msg.spaces_between_special_tokens
                                       if msg.HasField("spaces_between_special_tokens") else True),
        logprobs=msg.logprobs,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        cache_salt=msg.cache_salt or None,
    )


def prompt_to_pb(p: Prompt) -> pb.Prompt:
    if p.text is not None:
        return pb.Prompt(prompt_id=p.prompt_id, text=p.text, max_tokens=p.max_tokens)
    return pb.Prompt(prompt_id=p.prompt_id, token_ids=pb.TokenIds(ids=list(p.token_ids or ())), max_tokens=p.max_tokens)


def prompt_from_pb(msg: pb.Prompt) -> Prompt:
    kind = msg.WhichOneof("content")
    return Prompt(
        prompt_id=msg.prompt_id,
        text=msg.text if kind == "text" else None,
        token_ids=tuple(msg.token_ids.ids[:]) if kind == "token_ids" else None,  # [:]: see completion_from_pb
        max_tokens=msg.max_tokens,
    )


def provenance_to_pb(p: Provenance) -> pb.Provenance:
    return pb.Provenance(
        forward_passes=p.forward_passes,
        sources=[pb.SourceStats(source=s.source, drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens)
                 for s in p.sources],
    )


def provenance_from_pb(msg: pb.Provenance) -> Provenance:
    if not msg.sources:  # most completions (no drafts): one shared, immutable object per forward-pass count
        passes = msg.forward_passes
        known = _PLAIN_PROVENANCE.get(passes)
        if known is None:
            known = Provenance(passes)
            if len(_PLAIN_PROVENANCE) < _PLAIN_PROVENANCE_MAX:
                _PLAIN_PROVENANCE[passes] = known
        return known
    return Provenance(
        forward_passes=msg.forward_passes,
        sources=tuple(SourceStats(s.source, s.drafted_tokens, s.accepted_tokens) for s in msg.sources),
    )


_PLAIN_PROVENANCE_MAX = 4096
_PLAIN_PROVENANCE: dict[int, Provenance] = {}


def completion_to_pb(c: Completion) -> pb.Completion:
    msg = pb.Completion(
        step_id=c.step_id, prompt_id=c.prompt_id, sample_index=c.sample_index, token_ids=list(c.token_ids),
        logprobs=list(c.logprobs), text=c.text, finish_reason=_FINISH_TO_PB[c.finish_reason],
        policy_version=c.policy_version, worker_id=c.worker_id, provenance=provenance_to_pb(c.provenance),
        prompt_tokens=c.prompt_tokens, adapter=c.adapter, adapter_version=c.adapter_version,
    )
    if isinstance(c.stop_reason, str):
        msg.stop_string = c.stop_reason
    elif c.stop_reason is not None:
        msg.stop_token_id = c.stop_reason
    if c.top_logprobs:
        msg.top_logprobs.extend(pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
                                for top in c.top_logprobs)
    if c.version_spans:
        msg.version_spans.extend(pb.VersionSpan(start=i, policy_version=v) for i, v in c.version_spans)
    if c.prompt_logprobs:
        msg.prompt_logprobs.extend(
            pb.PromptLogprob(token_id=p.token_id, logprob=p.logprob, rank=p.rank, token=p.token,
                             top_token_ids=[t for t, _, _ in p.top], top_logprobs=[lp for _, lp, _ in p.top],
                             top_tokens=[text for _, _, text in p.top])
            for p in c.prompt_logprobs)
    return msg


def _stop_reason(msg: pb.Completion) -> str | int | None:
    kind = msg.WhichOneof("stop_reason")
    return None if kind is None else getattr(msg, kind)


def _top_logprobs(msg: pb.Completion) -> tuple[tuple[tuple[int, float], ...], ...]:
    return tuple(tuple(zip(t.token_ids[:], t.logprobs[:], strict=False)) for t in msg.top_logprobs)


def _prompt_logprobs(msg: pb.Completion) -> tuple[PromptLogprob, ...]:
    return tuple(PromptLogprob(p.token_id, p.logprob, p.rank, p.token,
                               tuple(zip(p.top_token_ids[:], p.top_logprobs[:], p.top_tokens[:], strict=False)))
                 for p in msg.prompt_logprobs)


def completion_from_pb(msg: pb.Completion) -> Completion:
    # positional, in Completion's field order (cheaper than keywords on the scheduler's per-completion path);
    # a repeated field copied by a slice first: one C loop, half the cost of iterating the container item by item
    args = (msg.step_id, msg.prompt_id, msg.sample_index, tuple(msg.token_ids[:]), tuple(msg.logprobs[:]),
            msg.text, _FINISH_FROM_PB.get(msg.finish_reason, FinishReason.STOP), msg.policy_version,
            msg.worker_id, msg.prompt_tokens, provenance_from_pb(msg.provenance))
    if msg.top_logprobs or msg.version_spans or msg.prompt_logprobs or msg.WhichOneof("stop_reason") is not None \
            or msg.adapter:
        return Completion(*args, stop_reason=_stop_reason(msg), top_logprobs=_top_logprobs(msg),
                          version_spans=tuple((s.start, s.policy_version) for s in msg.version_spans),
                          prompt_logprobs=_prompt_logprobs(msg), adapter=msg.adapter,
                          adapter_version=msg.adapter_version)
    return Completion(*args)


def summary_to_pb(s: StepSummary) -> pb.StepSummary:
    return pb.StepSummary(
        step_id=s.step_id, policy_version=s.policy_version, completions=s.completions,
        makespan_seconds=s.makespan_seconds, generated_tokens=s.generated_tokens,
        provenance=provenance_to_pb(s.provenance), busy_worker_seconds=s.busy_worker_seconds,
        idle_worker_seconds=s.idle_worker_seconds, drafting_worker_seconds=s.drafting_worker_seconds,
        requests_moved=s.requests_moved, requests_requeued=s.requests_requeued,
    )


def summary_from_pb(msg: pb.StepSummary) -> StepSummary:
    return StepSummary(
        step_id=msg.step_id, policy_version=msg.policy_version, completions=msg.completions,
        makespan_seconds=msg.makespan_seconds, generated_tokens=msg.generated_tokens,
        provenance=provenance_from_pb(msg.provenance), busy_worker_seconds=msg.busy_worker_seconds,
        idle_worker_seconds=msg.idle_worker_seconds, drafting_worker_seconds=msg.drafting_worker_seconds,
        requests_moved=msg.requests_moved, requests_requeued=msg.requests_requeued,
    )
