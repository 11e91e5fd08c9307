"""The exactness contract on a CUDA vLLM: the CPU tier's checks (tests/support/exactness.py),
run on two GPU engines (speculation off: the reference; the BubbleSpec proposer on)."""

from __future__ import annotations

import pytest

from tests.factories import token_prompts
from tests.support.exactness import check_greedy_identity, check_sampling_keeps_distribution, check_weight_reload

pytestmark = pytest.mark.gpu


async def test_gpu_greedy_is_token_identical_with_any_drafts(gpu_reference, gpu_engine, gpu_model, tmp_path):
    await check_greedy_identity(gpu_reference, gpu_engine, gpu_model, tmp_path)


async def test_gpu_sampling_with_adversarial_drafts_keeps_the_distribution(gpu_reference, gpu_engine):
    await check_sampling_keeps_distribution(gpu_reference, gpu_engine)


async def test_gpu_weight_reload_in_place(gpu_engine, gpu_model, tmp_path):
    """The speculative engine (what a worker reloads on a policy update) loads other weights,
    refuses a partial checkpoint, and serves its first outputs again after loading them back."""
    await check_weight_reload(gpu_engine, gpu_model, tmp_path, token_prompts(8, seed=31))
