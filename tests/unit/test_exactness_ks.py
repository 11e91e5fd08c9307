"""The statistics of tests/support/exactness_ks.py: under the null its p-values are uniform
enough for the KS test, and a small bias of the size a sampler bug makes is seen."""

from __future__ import annotations

import random

import pytest

from tests.support.exactness_ks import REPEATING, VOCAB, SourceResult, binned_pvalue, uniform_enough


def _result(name: str, draw_a, draw_b, reps: int = 100, n: int = 100) -> SourceResult:
    r = SourceResult(name)
    for _ in range(reps):
        r.p_token2.append(binned_pvalue(draw_a(n), draw_b(n)))
        r.p_token3.append(binned_pvalue(draw_a(n), draw_b(n)))
    return r


def test_the_same_distribution_gives_uniform_p_values() -> None:
    rng = random.Random(0)
    weights = [1 + (i % 7) for i in range(VOCAB)]

    def draw(n: int) -> list[int]:
        return rng.choices(range(VOCAB), weights=weights, k=n)

    assert uniform_enough(_result("null", draw, draw))


def test_a_biased_sampler_is_seen() -> None:
    rng = random.Random(1)
    fair = [1.0] * VOCAB
    biased = [1.5 if i % 4 == 0 else 1.0 for i in range(VOCAB)]  # one bin 1.5x as likely

    def draw_fair(n: int) -> list[int]:
        return rng.choices(range(VOCAB), weights=fair, k=n)

    def draw_biased(n: int) -> list[int]:
        return rng.choices(range(VOCAB), weights=biased, k=n)

    assert not uniform_enough(_result("biased", draw_fair, draw_biased))


def test_too_few_repetitions_are_refused() -> None:
    with pytest.raises(ValueError, match="too few"):
        uniform_enough(SourceResult("x", [0.5] * 5, [0.5] * 5))


def test_the_suffix_prompt_has_a_three_token_match_for_every_first_token() -> None:
    for t in range(VOCAB):
        tail = (*REPEATING[-2:], t)
        at = [i for i in range(len(REPEATING) - 4) if REPEATING[i:i + 3] == tail]
        assert at and at[0] + 5 <= len(REPEATING), t  # two tokens follow the match: a draft
