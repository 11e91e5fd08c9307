"""Simulated rollout workloads: long-tailed response lengths and draft acceptance.

Lengths. Every prompt has a latent scale (lognormal around ``median_tokens``); each sample of
the prompt, and each draft pre-generated for it, draws its length around that scale with a
second lognormal factor, capped at ``max_tokens``. Most responses are short; a few run 5-20x
the median (with the defaults the 99th percentile is ~8x the median and the longest of 65,536
reach the cap). Samples of one prompt are correlated, so a draft of a prompt predicts the
length of its real responses the way it does in RL rollouts. All draws come from
``numpy.random.default_rng([seed, step])``: a step's workload is the same for every policy.

Acceptance. A draft from source ``s`` (``future``: pre-generated in a bubble for this prompt;
``history``: an earlier response of the same prompt) has a per-token acceptance ``alpha``
(each request gets its own, spread around the source's mean). The j-th draft token of a pass
is accepted with probability ``alpha**j`` (verification stops at the first rejection), so k
drafted tokens give ``alpha * (1 - alpha**k) / (1 - alpha)`` accepted tokens per pass in
expectation. ``k`` follows the worker's draft-length rule (``worker/draft_index.py``,
``DraftLength``): draft while ``alpha**j >= min_accept_prob``, at most ``max_draft_tokens``, and
at most ``token_budget // batch`` so verification never makes a step compute-bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bubblespec.common.rules import paying_draft_tokens

__all__ = ["AcceptanceModel", "LengthModel", "SimPrompt", "TraceWorkload", "Workload", "expected_accepted"]


@dataclass(frozen=True)
class LengthModel:
    """Long-tailed response lengths: prompt scale x sample noise, both lognormal, capped."""

    median_tokens: float = 400.0
    """Median response length (tokens)."""
    prompt_sigma: float = 0.7
    """Log-space spread of the per-prompt scale (hard prompts run long for every sample)."""
    sample_sigma: float = 0.6
    """Log-space spread of one sample around its prompt's scale."""
    max_tokens: int = 8192
    """Cap (the step's ``max_tokens``); responses that reach it finish with reason ``length``."""

    def __post_init__(self) -> None:
        if not self.median_tokens >= 1 or self.max_tokens < 1:
            raise ValueError("median_tokens and max_tokens must be >= 1")
        if self.prompt_sigma < 0 or self.sample_sigma < 0:
            raise ValueError("sigmas must be >= 0")

    def length(self, scale: float, z: float) -> int:
        """Length of one sample (or draft) of a prompt with ``scale``, for noise ``z ~ N(0, 1)``."""
        return int(min(self.max_tokens, max(1, round(scale * math.exp(self.sample_sigma * z)))))


@dataclass(frozen=True)
class AcceptanceModel:
    """Per-token acceptance of drafts by source, and the draft-length rule of the worker."""

    future: float = 0.7
    """Mean per-token acceptance of ``future`` drafts (generated under policy v, verified by v+1).
    Assumption: 0.6-0.8 for low-entropy RL policies; tune per model."""
    history: float = 0.6
    """Mean per-token acceptance of ``history`` drafts (an earlier sample of the same prompt).
    Assumption, somewhat below ``future`` as a finished sibling is one sample among many."""
    suffix: float = 0.0
    """What-if, off by default (no source): mean per-token acceptance of self-drafts, i.e. suffix
    matching on the request's own text (vLLM's suffix method, SRT) past the end of its draft.
    No measured or published per-token figure for RL rollouts sets it; this only asks what
    self-drafting would need to reach."""
    spread: float = 0.5
    """Log-odds standard deviation of a request's acceptance around its source's mean."""
    max_draft_tokens: int = 32
    """At most this many draft tokens per request and pass (vLLM ``num_speculative_tokens``).
    With ``token_budget`` 256, more than 8 only in batches under 32 (deep drafts at the tail,
    where a pass is memory-bound); the worker's ``DraftLength`` default is 8."""
    token_budget: int = 256
    """Draft tokens one pass may verify over the whole batch (the worker's ``DraftLength``)."""
    min_accept_prob: float = 0.3
    """With ``paying`` off: draft the j-th token only while ``alpha**j`` stays at or above this
    (the worker's ``DraftLength`` rule)."""
    paying: bool = True
    """Draft length by cost (``common.rules.paying_draft_tokens``): the j-th token
    only while ``alpha**j`` exceeds the pass's cost of a draft token times the batch's
    tokens/s, so drafting turns itself off where it costs more than it saves and goes deep
    where a pass is memory-bound. Off: the fixed ``min_accept_prob`` rule."""

    siblings: tuple[tuple[int, float], ...] = ()
    """Live siblings (grouped drafts): ``(n, alpha)`` rows, n ascending; once n of a request's
    group have finished, its own-text acceptance (``suffix``) becomes that row's alpha (with
    its spread). Empty: off (own text only)."""
    epoch_history: float = 0.0
    """What-if: mean acceptance of the prompt's response from an earlier epoch, a ``history``
    draft every request has (used where it beats the draft it found); 0: off (the first epoch)."""
    loop_share: float = 0.0
    """What-if: the share of truncated responses whose last ``loop_tokens`` tokens loop."""
    loop_alpha: float = 0.99
    """Per-token acceptance of own-text drafts over text that loops (near-certain tokens)."""
    loop_tokens: int = 3000
    """Tokens a looping response loops for before the cap."""

    def __post_init__(self) -> None:
        if any(n < 1 or not 0 <= a < 1 for n, a in self.siblings) or list(self.siblings) != sorted(self.siblings):
            raise ValueError(f"siblings must be (n >= 1, alpha in [0, 1)) rows, n ascending, got {self.siblings}")
        if not 0 <= self.epoch_history < 1:
            raise ValueError(f"epoch_history must be in [0, 1), got {self.epoch_history}")
        if not 0 <= self.loop_share <= 1 or not 0 < self.loop_alpha < 1 or self.loop_tokens < 0:
            raise ValueError("loop_share must be in [0, 1], loop_alpha in (0, 1), loop_tokens >= 0")
        for name in ("future", "history", "suffix"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 < self.min_accept_prob < 1:
            raise ValueError("min_accept_prob must be in (0, 1)")

    def alpha(self, source: str, z: float) -> float:
        """Per-token acceptance of one request's drafts from ``source``; ``z ~ N(0, 1)``."""
        mean = getattr(self, source)
        if mean <= 0:
            return 0.0
        logit = math.log(mean / (1 - mean)) + self.spread * z
        return min(0.99, 1 / (1 + math.exp(-logit)))

    def own_text_mean(self, finished_siblings: int) -> float:
        """Mean own-text acceptance once ``finished_siblings`` of the group have finished."""
        mean = self.suffix
        for n, a in self.siblings:
            if finished_siblings >= n:
                mean = max(mean, a)
        return mean

    def spread_alpha(self, mean: float, z: float) -> float:
        """``alpha``'s spread around an explicit ``mean``."""
        if mean <= 0:
            return 0.0
        logit = math.log(mean / (1 - mean)) + self.spread * z
        return min(0.99, 1 / (1 + math.exp(-logit)))

    def batch_cap(self, batch_size: int) -> int:
        return max(0, min(self.max_draft_tokens, self.token_budget // max(1, batch_size)))

    def draft_tokens(self, alpha: float, cap: int, threshold: float | None = None) -> int:
        """Draft tokens per pass for a request with acceptance ``alpha`` under ``cap``;
        ``threshold``: with ``paying``, a draft token's cost times the batch's tokens/s."""
        if cap <= 0 or alpha <= 0:
            return 0
        if self.paying and threshold is not None:
            return paying_draft_tokens(alpha, cap, threshold, 1.0)
        if alpha < self.min_accept_prob:
            return 0  # the worker would only probe now and then: ignored here
        return max(1, min(cap, int(math.log(self.min_accept_prob) / math.log(alpha))))


def expected_accepted(alpha: float, k: int) -> float:
    """Expected accepted draft tokens per pass with ``k`` drafted, per-token acceptance ``alpha``."""
    if k <= 0 or alpha <= 0:
        return 0.0
    if alpha >= 1:
        return float(k)
    return alpha * (1 - alpha**k) / (1 - alpha)


@dataclass
class SimPrompt:
    """One prompt of a simulated step and the lengths its samples and drafts will have."""

    prompt_id: str
    token_ids: tuple[int, ...]
    scale: float
    lengths: list[int]
    """Length of sample i."""
    accept_z: list[float]
    """Acceptance noise of sample i (see ``AcceptanceModel.alpha``)."""
    draft_z: list[float]
    """Length noise of the j-th draft job (cycled)."""


@dataclass(frozen=True)
class Workload:
    """What every simulated step asks for."""

    lengths: LengthModel = LengthModel()
    """Response-length distribution."""
    prompt_tokens: int = 512
    """Prompt length used by the cost model (prefill). Prompts' token ids stay short (a unique
    id) so that the core's per-prompt dictionaries hash cheaply."""
    draft_samples: int = 4
    """Distinct draft lengths pre-drawn per prompt (the j-th draft job uses j mod this)."""

    def step(self, seed: int, step: int, prompts: int, samples: int) -> list[SimPrompt]:
        """The prompts of step ``step``: deterministic in (seed, step)."""
        rng = np.random.default_rng([seed, step])
        lm = self.lengths
        scales = lm.median_tokens * np.exp(lm.prompt_sigma * rng.standard_normal(prompts))
        zs = rng.standard_normal((prompts, samples))
        acc = rng.standard_normal((prompts, samples))
        dz = rng.standard_normal((prompts, self.draft_samples))
        s0, s1 = 1 + step % 30000, 1 + step // 30000
        return [
            SimPrompt(
                prompt_id=f"p{i}",
                token_ids=(s0, s1, 1 + i % 30000, 1 + i // 30000),
                scale=scale,
                lengths=lengths,
                accept_z=a_row,
                draft_z=d_row,
            )  # ``tolist``: the very doubles of the arrays, as Python floats
            for i, (scale, lengths, a_row, d_row) in enumerate(
                zip(scales.tolist(), _lengths(lm, scales, zs), acc.tolist(), dz.tolist()))
        ]


def _lengths(lm: LengthModel, scales: np.ndarray, zs: np.ndarray) -> list[list[int]]:
    """``lm.length(scales[i], zs[i, j])`` for every sample, as lists, bit for bit: the products
    are IEEE multiplications either way, ``exp`` stays ``math.exp`` (numpy's may differ in the
    last bit) and ``rint`` rounds half to even as ``round`` does. Non-finite values (only from
    extreme settings) take the scalar path, which raises as it always did."""
    noise = np.array(list(map(math.exp, (lm.sample_sigma * zs).ravel().tolist())), dtype=np.float64)
    raw = scales[:, None] * noise.reshape(zs.shape)
    if not np.isfinite(raw).all():
        return [[lm.length(float(s), float(z)) for z in row] for s, row in zip(scales, zs)]
    return np.clip(np.rint(raw), 1, lm.max_tokens).astype(np.int64).tolist()


@dataclass(frozen=True)
class TraceWorkload:
    """Replays recorded response lengths instead of drawing them: ``steps[s][i]`` is the length
    of every sample (and every draft) of prompt ``i`` in step ``s``, as a greedy real run
    produced them. Used to simulate the very workload a real benchmark ran."""

    steps: tuple[tuple[int, ...], ...]
    prompt_tokens: int = 16
    max_tokens: int = 8192

    def __post_init__(self) -> None:
        if not self.steps or not all(self.steps) or min(min(s) for s in self.steps) < 1:
            raise ValueError("steps must hold at least one step of lengths >= 1")

    @property
    def lengths(self) -> LengthModel:
        median = float(np.median([n for s in self.steps for n in s]))
        return LengthModel(median_tokens=median, prompt_sigma=0.0, sample_sigma=0.0, max_tokens=self.max_tokens)

    def step(self, seed: int, step: int, prompts: int, samples: int) -> list[SimPrompt]:
        lengths = self.steps[step % len(self.steps)]
        if prompts > len(lengths):
            raise ValueError(f"step {step} of the trace has {len(lengths)} prompts, {prompts} asked for")
        return [SimPrompt(prompt_id=f"p{i}", token_ids=(1 + step, 1 + i), scale=float(n), lengths=[n] * samples,
                          accept_z=[0.0] * samples, draft_z=[0.0])
                for i, n in enumerate(lengths[:prompts])]
