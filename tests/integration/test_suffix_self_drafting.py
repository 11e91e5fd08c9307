"""Self-suffix drafting on a real vLLM CPU engine: a request with drafts on but no stored or
sibling draft drafts from its own prompt + output (source ``suffix``), and greedy decoding
returns exactly the tokens of an engine without speculation."""

from __future__ import annotations

import pytest

from bubblespec.client import SamplingParams
from bubblespec.worker.engine import VllmEngine
from tests.integration.conftest import engine_settings
from tests.support.exactness import check_provenance, run_engine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
async def suffix_engine(tiny_model):
    """A speculative engine with self-suffix drafting on, no draft store."""
    engine = VllmEngine(engine_settings(tiny_model, num_speculative_tokens=8, self_suffix_drafting=True))
    await engine.start()
    yield engine
    await engine.shutdown()


def _repetitive_prompts() -> list[tuple[int, ...]]:
    """Prompts that repeat a short pattern, as step-by-step arithmetic repeats its numbers."""
    return [tuple([7 + i, 20 + 3 * i, 41, 9 + i] * 6) for i in range(8)]


async def test_greedy_with_self_suffix_drafts_equals_speculation_off(reference_engine, suffix_engine):
    prompts = _repetitive_prompts()
    sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)  # long enough to repeat itself
    expected = [o.token_ids for o in await run_engine(reference_engine, prompts, sp, tag="ref")]
    outs = await run_engine(suffix_engine, prompts, sp, drafts=None, use_drafts=True, tag="suffix")
    assert [o.token_ids for o in outs] == expected, "self-suffix drafts changed a greedy output"
    check_provenance(outs, drafts_on=True, arm="suffix")
    drafted = sum(o.provenance.drafted("suffix") for o in outs)
    accepted = sum(o.provenance.accepted("suffix") for o in outs)
    print(f"self-suffix drafts: {accepted}/{drafted} accepted; "
          f"{sum(o.provenance.forward_passes for o in outs)} passes for {sum(map(len, expected))} tokens")
    assert accepted > 0, f"no self-suffix draft token was accepted ({drafted} drafted)"
    assert {s.source for o in outs for s in o.provenance.sources} <= {"suffix"}
    off = await run_engine(suffix_engine, prompts, sp, use_drafts=False, tag="off")
    assert [o.token_ids for o in off] == expected
    assert sum(o.provenance.drafted() for o in off) == 0, "a request with drafts off was drafted for"
