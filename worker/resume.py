"""A request the scheduler moves between workers, on the worker's side (pure).

The scheduler moves a long request off a busy worker to an idle one (``scheduler/core/moves.py``):

- the busy worker stops it and sends what it generated: ``partial`` (``Abort.keep_partial`` ->
  ``Aborted.partial``);
- the idle worker goes on from there: ``resumed`` makes the engine request (the prompt and the
  partial are its context; ``max_tokens`` counts the partial; a seeded request gets
  ``resume_seed``, fresh draws; stored drafts are shifted to the position it goes on from),
  and ``joined`` makes its completion (the partial's tokens, logprobs, text and passes, then
  what followed). Prompt logprobs (``SamplingParams.prompt_logprobs``) come with a request's
  first output: a partial that has them hands them on and the idle worker does not compute them
  again; one stopped before its first output has none, and the idle worker computes them over
  ``prompt + partial`` and keeps the original prompt's (``joined_prompt_logprobs``): a
  position's logprobs depend only on the tokens before it, so they are the same numbers.

Generation from ``prompt + partial`` samples the continuation from the same conditional
distribution the first worker would have used, so the joined completion is exact
(docs/EXACTNESS.md). vLLM detokenizes the new tokens with the prompt as their left context, so
the partial's text and the new text join into the text of all the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bubblespec.common.rules import resume_seed
from bubblespec.common.types import Completion, FinishReason, PromptLogprob, Provenance
from bubblespec.worker.engine import EngineOutput, EngineRequest

__all__ = ["Yielded", "joined", "joined_prompt_logprobs", "joined_top_logprobs", "partial", "resumed"]


def resumed(request: EngineRequest, before: Completion) -> EngineRequest:
    """``request`` (as assigned: the original prompt and sampling) going on after ``before``."""
    n = len(before.token_ids)
    left = request.sampling.max_tokens - n
    if left < 1:
        raise ValueError(f"resume: {n} tokens already, max_tokens is {request.sampling.max_tokens}")
    seed = request.sampling.seed
    sampling = replace(request.sampling, max_tokens=left, min_tokens=max(0, request.sampling.min_tokens - n),
                       seed=None if seed is None else resume_seed(seed, n),
                       prompt_logprobs=None if before.prompt_logprobs else request.sampling.prompt_logprobs)
    drafts = tuple((source, tokens[n:]) for source, tokens in request.drafts if len(tokens) > n)
    return replace(request, prompt_token_ids=request.prompt_token_ids + tuple(before.token_ids), sampling=sampling,
                   drafts=drafts, predicted_tokens=max(0.0, request.predicted_tokens - n))


def joined(before: Completion | None, final: EngineOutput) -> tuple[tuple[int, ...], tuple[float, ...], str, Provenance]:
    """(token ids, logprobs, text, provenance) of a request that went on after ``before``."""
    if before is None:
        return final.token_ids, final.logprobs, final.text, final.provenance
    return (tuple(before.token_ids) + tuple(final.token_ids), tuple(before.logprobs) + tuple(final.logprobs),
            before.text + final.text, before.provenance + final.provenance)


def joined_top_logprobs(before: Completion | None, final: EngineOutput) -> tuple:
    """``Completion.top_logprobs`` of a request that went on after ``before``: one entry per token
    where both parts have them, else ()."""
    if before is None or not before.token_ids:
        return tuple(final.top_logprobs)
    if len(before.top_logprobs) != len(before.token_ids) or len(final.top_logprobs) != len(final.token_ids):
        return ()
    return tuple(before.top_logprobs) + tuple(final.top_logprobs)


def joined_prompt_logprobs(before: Completion | None, final: EngineOutput,
                           prompt_tokens: int) -> tuple[PromptLogprob, ...]:
    """``Completion.prompt_logprobs`` of a request of a ``prompt_tokens``-token prompt that went on
    after ``before``: the partial's where it has them, else the final run's over the prompt alone
    (that run's prompt was the prompt and the partial)."""
    if before is not None and before.prompt_logprobs:
        return tuple(before.prompt_logprobs)
    return tuple(final.prompt_logprobs[:max(0, prompt_tokens - 1)])


@dataclass(frozen=True)
class Yielded:
    """A progress output and the lengths of its lists when the engine yielded it. The lists are
    the engine's live ones (``VllmEngine.generate``), which go on growing: the final chunk's
    tokens go into them before the engine's last await (the proposer's stats), so a request
    stopped in that await would otherwise send a partial holding its whole response, end of
    text included, and the worker it moved to would generate past the response's end. Only the
    lengths are kept per output; ``frozen`` copies, once, for a stopped request."""

    out: EngineOutput
    lengths: tuple[int, int, int, int]

    @classmethod
    def of(cls, out: EngineOutput) -> Yielded:
        return cls(out, (len(out.token_ids), len(out.logprobs), len(out.top_logprobs), len(out.text)))

    def frozen(self) -> EngineOutput:
        """The output as it was when yielded."""
        out, (tokens, logprobs, tops, pieces) = self.out, self.lengths
        text = out.text if isinstance(out.text, str) else "".join(out.text[:pieces])
        return EngineOutput(out.key, tuple(out.token_ids[:tokens]), tuple(out.logprobs[:logprobs]), text,
                            out.finish_reason, out.provenance, out.stop_reason, tuple(out.top_logprobs[:tops]),
                            out.prompt_logprobs)


def partial(step_id: str, prompt_id: str, sample_index: int, before: Completion | None, last: EngineOutput | None,
            version: int, worker_id: str, prompt_tokens: int, provenance: Provenance | None) -> Completion:
    """What a stopped request generated: ``before`` (if it had moved here) and ``last``, its
    latest progress output; ``provenance``: the engine's count of its passes and drafts (None:
    one token a pass). Passes and accepted tokens are kept to the tokens sent (a pass after the
    last progress output made tokens that are not in it)."""
    tokens = tuple(last.token_ids) if last is not None else ()
    logprobs = tuple(last.logprobs) if last is not None else ()
    tops = tuple(last.top_logprobs) if last is not None and len(last.top_logprobs) == len(tokens) else ()
    text = "" if last is None else last.text if isinstance(last.text, str) else "".join(last.text)
    if provenance is None:
        provenance = Provenance(forward_passes=len(tokens))
    accepted = min(provenance.accepted(), len(tokens))
    sources, left = [], accepted
    for s in provenance.sources:  # accepted tokens kept to the tokens sent, source by source
        took = min(s.accepted_tokens, left)
        left -= took
        sources.append(replace(s, accepted_tokens=took))
    mine = Completion(step_id, prompt_id, sample_index, tokens, logprobs if len(logprobs) == len(tokens) else (),
                      text, FinishReason.STOP, version, worker_id, prompt_tokens,
                      Provenance(len(tokens) - accepted, tuple(sources)), top_logprobs=tops,
                      prompt_logprobs=tuple(last.prompt_logprobs[:max(0, prompt_tokens - 1)]) if last is not None
                      else ())
    if before is None:
        return mine
    last_part = EngineOutput("", mine.token_ids, mine.logprobs, mine.text, None, mine.provenance, top_logprobs=tops)
    ids, lps, txt, prov = joined(before, last_part)
    return replace(mine, token_ids=ids, logprobs=lps if len(lps) == len(ids) else (), text=txt, provenance=prov,
                   top_logprobs=joined_top_logprobs(before, last_part),
                   prompt_logprobs=tuple(before.prompt_logprobs) or mine.prompt_logprobs)
