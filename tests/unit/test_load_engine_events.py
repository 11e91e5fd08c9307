"""The simulated engine (``bench/load_engine.py``) draws a whole response when a request is
queued and wakes only at events (progress, end, arrival); what it yields must be what drawing
one token per step gave: the same tokens and logprobs, the same progress outputs."""

from __future__ import annotations

import asyncio
import random

from bubblespec.bench.load_engine import EOS_TOKEN_ID, FIRST_TOKEN_ID, LoadEngineSettings, LoadTestEngine
from bubblespec.common.types import FinishReason, SamplingParams
from bubblespec.worker.engine import EngineRequest


def _reference(rng: random.Random, vocab: int, limit: int, eos_at: int | None, stop_ids: frozenset[int]):
    """One token per step, with ``random``'s own methods (what the engine did before)."""
    tokens, logprobs = [], []
    while True:
        n = len(tokens) + 1
        token = EOS_TOKEN_ID if eos_at is not None and n >= eos_at else rng.randrange(FIRST_TOKEN_ID, vocab)
        tokens.append(token)
        logprobs.append(-rng.expovariate(2.0))
        if token == EOS_TOKEN_ID or token in stop_ids:
            return tuple(tokens), tuple(logprobs), FinishReason.STOP
        if n >= limit:
            return tuple(tokens), tuple(logprobs), FinishReason.LENGTH


def test_drawn_responses_equal_one_token_per_step_draws():
    for vocab in (4, 5, 1000, 32000, 50257):
        engine = LoadTestEngine(LoadEngineSettings(vocab_size=vocab))
        for seed in range(40):
            eos_at = None if seed % 3 == 0 else 1 + seed % 17
            stop = frozenset({FIRST_TOKEN_ID + seed % 7}) if seed % 4 == 0 else frozenset()
            got = engine._draw(random.Random(seed), 1 + seed % 23, eos_at, stop)
            assert got == _reference(random.Random(seed), vocab, 1 + seed % 23, eos_at, stop)


async def test_progress_outputs_come_every_progress_tokens_and_the_end_once():
    engine = LoadTestEngine(LoadEngineSettings(step_seconds=0.0005, batch_slope_seconds=0.0, progress_tokens=4,
                                               vocab_size=1000, max_model_len=128, max_num_seqs=2))
    await engine.start()
    try:
        sp = SamplingParams(max_tokens=18, ignore_eos=True)

        async def run(key: str):
            return [(len(o.token_ids), o.finish_reason) async for o in engine.generate(EngineRequest(key, (5, 6), sp))]

        outs = await asyncio.gather(*(run(f"r{i}") for i in range(5)))  # 5 requests, 2 slots: 3 wait
        for out in outs:
            assert out == [(4, None), (8, None), (12, None), (16, None), (18, FinishReason.LENGTH)]
        assert engine.num_running == 0 and engine.engine_steps == 3 * 18  # three waves of 18 steps
    finally:
        await engine.shutdown()



async def test_the_simulated_prefix_cache_counts_the_blocks_it_holds_and_forgets_the_oldest():
    engine = LoadTestEngine(LoadEngineSettings(step_seconds=0.0, batch_slope_seconds=0.0, max_model_len=512,
                                               prefix_cache_tokens=64))  # 4 blocks of 16
    await engine.start()

    async def run(prompt: tuple[int, ...]) -> tuple[int, ...]:
        sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outs = [o async for o in engine.generate(EngineRequest(f"k{len(prompt)}-{prompt[0]}", prompt, sampling))]
        return outs[-1].token_ids

    first = tuple(range(10, 42))  # 2 blocks
    response = await run(first)
    assert (engine.prefill.prompt_tokens, engine.prefill.cached_tokens) == (32, 0)
    await run(first + response + (7,) * 9)  # 57 tokens: the prompt's 2 blocks and the response's 1 are held
    assert (engine.prefill.prompt_tokens, engine.prefill.cached_tokens) == (89, 48)
    await run(tuple(range(100, 164)))  # 4 new blocks push every older one out
    await run(first)
    assert engine.prefill.cached_tokens == 48 + 0
    await engine.shutdown()
