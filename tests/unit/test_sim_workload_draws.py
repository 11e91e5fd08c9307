"""The simulated workload's lengths are ``LengthModel.length`` of each draw, bit for bit, and
the token-id check's fast path refuses exactly what the per-token loop refuses."""

from __future__ import annotations

import enum

import numpy as np
import pytest

from bubblespec.bench.sim.workload import LengthModel, Workload
from bubblespec.common.types import Prompt
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits
from bubblespec.scheduler.core.validate import prompt_tokens


@pytest.mark.parametrize("lengths", [LengthModel(), LengthModel(median_tokens=50, prompt_sigma=1.3, sample_sigma=1.1,
                                                                 max_tokens=300)])
def test_step_lengths_are_the_scalar_rule_of_the_same_draws(lengths: LengthModel) -> None:
    wl = Workload(lengths=lengths)
    prompts = wl.step(3, 2, 2000, 8)
    # the same draws in the same order as the step makes them
    rng = np.random.default_rng([3, 2])
    scales = lengths.median_tokens * np.exp(lengths.prompt_sigma * rng.standard_normal(2000))
    zs = rng.standard_normal((2000, 8))
    acc = rng.standard_normal((2000, 8))
    dz = rng.standard_normal((2000, wl.draft_samples))
    for i, p in enumerate(prompts):
        assert p.scale == float(scales[i]) and type(p.scale) is float
        assert p.lengths == [lengths.length(float(scales[i]), float(z)) for z in zs[i]]
        assert all(type(n) is int for n in p.lengths)
        assert p.accept_z == [float(a) for a in acc[i]] and p.draft_z == [float(z) for z in dz[i]]
    assert min(n for p in prompts for n in p.lengths) >= 1
    assert max(n for p in prompts for n in p.lengths) == lengths.max_tokens  # the cap is reached and kept


def test_a_non_finite_scale_fails_as_the_scalar_rule_does() -> None:
    with pytest.raises(OverflowError):
        Workload(lengths=LengthModel(median_tokens=float("inf"))).step(0, 0, 4, 2)


class _Id(int, enum.Enum):
    SEVEN = 7


MODEL = ModelLimits(max_model_len=64, vocab_size=100)


@pytest.mark.parametrize(("ids", "bad"), [((1, 2, -1), 2), ((1, 100, 3), 1), ((True, 2), 0), ((1, 2.0), 1),
                                          ((5, "x"), 1)])
def test_token_id_fast_path_names_the_first_bad_id(ids: tuple, bad: int) -> None:
    with pytest.raises(InvalidRequest) as e:
        prompt_tokens(Prompt("p", token_ids=ids), "prompts[0]", MODEL, None)
    assert e.value.field == f"prompts[0].token_ids[{bad}]"
    assert "outside the vocabulary [0, 100)" in str(e.value)


def test_token_id_fast_path_accepts_what_the_loop_accepts() -> None:
    assert prompt_tokens(Prompt("p", token_ids=(0, 99, _Id.SEVEN)), "prompts[0]", MODEL, None) == (0, 99, 7)
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        prompt_tokens(Prompt("p", token_ids=()), "prompts[0]", MODEL, None)
