"""vLLM's logprobs as BubbleSpec's types: a completion's per-token logprobs and top
alternatives, and a prompt's logprobs (``RequestOutput.prompt_logprobs``) as ``PromptLogprob``s.
Pure functions over vLLM's ``Logprob`` objects (``worker/engine.py`` reads them from each output)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from bubblespec.common.types import PromptLogprob

if TYPE_CHECKING:
    from vllm.logprobs import Logprob, SampleLogprobs

__all__ = ["prompt_rows", "rank", "sample_positions", "top_alternatives"]


def sample_positions(logprobs: SampleLogprobs | None) -> Iterable[dict[int, Logprob]]:
    """A completion's logprobs per generated token (none: empty). Every generated position has
    them; vLLM's ``FlatLogprobs`` form is a sequence of optional positions only in its type."""
    return iter(logprobs) if logprobs else ()


def top_alternatives(step: dict[int, Logprob], n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely (token id, logprob) of one position's vLLM logprobs (the sampled
    token first, then the top ``n`` by rank; the sampled one is among them where it ranks within
    ``n``), most likely first."""
    ranked = sorted((lp.rank, tok, float(lp.logprob)) for tok, lp in step.items() if lp.rank is not None and lp.rank <= n)
    return tuple((tok, lp) for _, tok, lp in ranked[:n])  # a tie with the sampled token can rank n + 1 of them


def prompt_rows(rows: Sequence[Mapping[int, Logprob] | None], prompt: tuple[int, ...],
                n: int | None) -> tuple[PromptLogprob, ...]:
    """vLLM's ``RequestOutput.prompt_logprobs`` (None for the first prompt token, then per
    position a dict: the prompt token, then the ``n`` most likely by rank, each once) as
    ``PromptLogprob``s. Where the prompt token is among the ``n`` its entry holds that place's
    rank, as in vLLM's dict; the order of the ``n`` is vLLM's (its rank order)."""
    out = []
    for i, row in enumerate(rows[1:], start=1):
        token = prompt[i]
        if row is None:
            raise RuntimeError(f"vLLM sent no prompt logprobs for prompt position {i}")
        items = list(row.items())
        mine = row[token]
        others = items[1:] if len(items) > (n or 0) else sorted(items, key=lambda kv: rank(kv[1]))
        top = tuple((t, float(lp.logprob), lp.decoded_token or "") for t, lp in others[:n or 0])
        out.append(PromptLogprob(token, float(mine.logprob), rank(mine), mine.decoded_token or "", top))
    return tuple(out)


def rank(lp: Logprob) -> int:
    """A prompt logprob's rank (vLLM ranks every prompt position's entries)."""
    if lp.rank is None:
        raise RuntimeError("vLLM sent a prompt logprob without its rank")
    return int(lp.rank)
