"""Plain data types shared by the SDK, the scheduler and the worker.

Frozen dataclasses only; conversion to and from protobuf lives in ``codec``. The SDK
re-exports the public ones (``bubblespec.client``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

__all__ = [
    "Completion",
    "FinishReason",
    "Prompt",
    "PromptLogprob",
    "Provenance",
    "SamplingParams",
    "SchedulingPolicy",
    "SourceStats",
    "StepResult",
    "StepSummary",
]


LOGPROBS_MODES = ("processed", "raw")
"""Values of ``SamplingParams.logprobs_mode`` and ``EngineSettings.logprobs_mode``."""


class SchedulingPolicy(str, enum.Enum):
    """How the scheduler spreads a step's requests over workers."""

    STATIC = "static"  # even split up front: today's data-parallel rollout (the baseline)
    QUEUE = "queue"  # shared queue, each worker refilled up to its capacity
    LONGEST_FIRST = "longest-first"  # queue ordered by predicted length


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    """Stopped by a ``/pause?mode=abort`` before its end (vLLM's ``abort``): what it generated."""


@dataclass(frozen=True, repr=False)
class SamplingParams:
    """Sampling parameters of a step (vLLM semantics). ``seed`` is any int64, as vLLM's HTTP API
    takes it; sample i of a prompt uses seed + i taken modulo 2**64, the seed torch's generator
    gets from vLLM's own ``seed + i`` for ``n`` > 1 (torch reads a seed modulo 2**64)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    logprobs_mode: str = ""
    """What ``Completion.logprobs`` holds: ``processed`` (log-probabilities under the distribution
    each token was sampled from: temperature, top_k and top_p applied; the behaviour policy of
    importance ratios) or ``raw`` (the model's log-softmax before them); '' = the scheduler's
    default (``SchedulerSettings.default_logprobs_mode``, processed unless configured). Each
    worker's engine returns one mode (``EngineSettings.logprobs_mode``, processed by default); a
    step asking for a mode no connected worker returns is refused, naming ``sampling.logprobs_mode``."""
    min_tokens: int = 0
    """Tokens generated before EOS, ``stop_token_ids`` or ``stop`` may end a response (vLLM's
    ``min_tokens``); at most ``max_tokens``."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of ``Completion.text`` (vLLM's)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of ``Completion.text`` (vLLM's); token ids are the same either way."""
    spaces_between_special_tokens: bool = True
    """vLLM's: spaces between special tokens in the text, where they are kept."""
    logprobs: int = 0
    """Top alternatives per token: each completion's ``top_logprobs`` holds the ``logprobs``
    most likely tokens at each position with their logprobs (the same kind as
    ``Completion.logprobs``, ``logprobs_mode``), most likely first; 0 = none. At most
    ``Limits.max_logprobs`` (vLLM's ``max_logprobs``, 20). Every completion carries the
    sampled token's logprob whatever this is."""
    prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs``: set, each completion's ``prompt_logprobs`` holds, for every
    prompt token from the second on, its logprob given the tokens before it, its rank, and this
    many most likely tokens there (0: the prompt token alone). They are the model's log-softmax
    whatever ``logprobs_mode`` says (vLLM applies no sampling processor to prompt positions). At
    most ``Limits.max_logprobs``."""
    cache_salt: str | None = None
    """vLLM's ``cache_salt``: requests share cached prefix blocks on a worker only when their
    salts are equal (prefix-cache isolation); the outputs are the same either way. A non-empty
    string of at most 128 characters without ``@``, ``/``, ``\\`` or NUL (vLLM's rule)."""

    def __repr__(self) -> str:
        """The dataclass's repr, leaving out the fields from ``min_tokens`` on where they hold
        their defaults: a step's fingerprint hashes this repr (``build_step``), and the journal of
        a step that does not use them keeps the fingerprint schedulers wrote before they existed."""
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                          if f.name not in _LATER_FIELDS or getattr(self, f.name) != f.default)
        return f"SamplingParams({shown})"


_LATER_FIELDS = frozenset(("min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                           "spaces_between_special_tokens", "logprobs", "prompt_logprobs", "cache_salt"))


@dataclass(frozen=True)
class Prompt:
    """One prompt: text or token ids. ``max_tokens`` (0 = the step's) overrides per prompt."""

    prompt_id: str
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    max_tokens: int = 0


@dataclass(frozen=True)
class SourceStats:
    source: str
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class Provenance:
    """How a completion was produced: engine steps and draft tokens by source."""

    forward_passes: int = 0
    sources: tuple[SourceStats, ...] = ()

    def accepted(self, source: str | None = None) -> int:
        return sum(s.accepted_tokens for s in self.sources if source in (None, s.source))

    def drafted(self, source: str | None = None) -> int:
        return sum(s.drafted_tokens for s in self.sources if source in (None, s.source))

    def __add__(self, other: Provenance) -> Provenance:
        merged: dict[str, list[int]] = {}
        for s in (*self.sources, *other.sources):
            acc = merged.setdefault(s.source, [0, 0])
            acc[0] += s.drafted_tokens
            acc[1] += s.accepted_tokens
        return Provenance(
            forward_passes=self.forward_passes + other.forward_passes,
            sources=tuple(SourceStats(k, d, a) for k, (d, a) in sorted(merged.items())),
        )


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt position of ``Completion.prompt_logprobs`` (vLLM's ``prompt_logprobs`` entry):
    the prompt token there, its logprob given the tokens before it and its rank in the vocabulary
    (1 = most likely), and the ``SamplingParams.prompt_logprobs`` most likely (token id, logprob,
    token text) there, most likely first. Texts are vLLM's ``decoded_token``s."""

    token_id: int
    logprob: float
    rank: int
    token: str = ""
    top: tuple[tuple[int, float, str], ...] = ()


@dataclass(frozen=True)
class Completion:
    """One finished sample of one prompt, as the trainer receives it: its tokens, text, finish
    reason, logprobs when asked, the policy version that made it and its draft provenance."""

    step_id: str
    prompt_id: str
    sample_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: FinishReason
    policy_version: int
    worker_id: str = ""
    prompt_tokens: int = 0
    provenance: Provenance = field(default_factory=Provenance)
    version_spans: tuple[tuple[int, int], ...] = ()
    """(first token index, policy version) of each span of ``token_ids`` made with one policy
    version, where a request went on across a policy update (``/pause?mode=keep``); () when
    ``policy_version`` made every token."""
    stop_reason: str | int | None = None
    """What stopped it, as vLLM's ``stop_reason``: the matched stop string, or the stop token id
    (``SamplingParams.stop_token_ids``) it generated; None for EOS and for ``length``."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    """Per token, its position's ``SamplingParams.logprobs`` most likely (token id, logprob)
    pairs, most likely first; () when none were asked for."""
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    """With ``SamplingParams.prompt_logprobs`` set: one entry per prompt token from the second on
    (vLLM's list without its leading None); () otherwise. After a keep pause across a policy
    update they are the first version's (``version_spans[0]``), which read the prompt."""
    adapter: str = ""
    """The LoRA adapter it ran with ('' = the base model alone); ``policy_version`` stays the base
    model's version."""
    adapter_version: int = 0
    """The adapter's version (1 at its first ``/v1/load_lora_adapter``, +1 at each reload); 0
    without an adapter."""

    @property
    def key(self) -> tuple[str, str, int]:
        """Idempotency key: (step id, prompt id, sample index)."""
        return (self.step_id, self.prompt_id, self.sample_index)


@dataclass(frozen=True)
class StepSummary:
    step_id: str
    policy_version: int
    completions: int
    makespan_seconds: float
    generated_tokens: int
    provenance: Provenance = field(default_factory=Provenance)
    busy_worker_seconds: float = 0.0
    idle_worker_seconds: float = 0.0
    drafting_worker_seconds: float = 0.0
    requests_moved: int = 0
    requests_requeued: int = 0

    @property
    def forward_passes_per_token(self) -> float:
        return self.provenance.forward_passes / max(1, self.generated_tokens)

    @property
    def bubble_share(self) -> float:
        total = self.busy_worker_seconds + self.idle_worker_seconds + self.drafting_worker_seconds
        return self.idle_worker_seconds / total if total > 0 else 0.0


@dataclass(frozen=True)
class StepResult:
    """Everything ``generate`` returns: completions in (prompt order, sample index) order."""

    completions: tuple[Completion, ...]
    summary: StepSummary
