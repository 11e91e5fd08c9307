"""Response-length history: what the core predicts a prompt's response length to be (pure).

``longest-first`` orders a step's queue by it, the balancer weighs workers' queued work by it
(``core/balance.py``) and the draft planner ranks announced prompts by it.
"""

from __future__ import annotations

__all__ = ["LengthHistory", "length_key"]


def length_key(prompt: tuple[int, ...]) -> int:
    """The history's key for a prompt: its hash, not the prompt itself. Keying by the token
    tuple kept every completed prompt's tokens alive (a Python int per token, ~1.3 KB for 32
    tokens, ~40 KB for 1,000) long after its step was trimmed; a hash costs the same for any
    prompt. Int tuples hash alike in every process; a collision only mixes two predictions."""
    return hash(prompt)


class LengthHistory:
    """A running mean of response lengths per prompt (at most ``max_prompts``, oldest
    forgotten first), and of the response / prompt length ratio for prompts never seen."""

    def __init__(self, max_prompts: int) -> None:
        self.max_prompts = max_prompts
        self.lengths: dict[int, float] = {}  # length_key(prompt) -> running mean of response lengths
        self.ratio = 0.0  # running mean of response length / prompt length, for unseen prompts

    def record(self, prompt: tuple[int, ...], length: int) -> None:
        """A response of ``length`` tokens to ``prompt`` was delivered."""
        key = length_key(prompt)
        previous = self.lengths.pop(key, float(length))  # re-insert: dicts keep insertion order
        self.lengths[key] = 0.5 * previous + 0.5 * length
        if len(self.lengths) > self.max_prompts:
            del self.lengths[next(iter(self.lengths))]
        ratio = length / max(1, len(prompt))
        self.ratio = ratio if not self.ratio else 0.95 * self.ratio + 0.05 * ratio

    def predicted(self, prompt: tuple[int, ...]) -> float:
        """Expected response length: the prompt's own history, else (a prompt never seen) its
        length times the running response/prompt length ratio. The fallback only orders
        unseen prompts by length, which predicts response length on many tasks (a longer
        problem statement, a longer solution) and costs nothing where it does not."""
        known = self.lengths.get(length_key(prompt))
        return known if known is not None else self.ratio * len(prompt)

    def clear(self) -> None:
        """Forget everything (benchmarks compare arms from scratch)."""
        self.lengths.clear()
        self.ratio = 0.0
