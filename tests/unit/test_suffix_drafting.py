"""Self-suffix drafting: a request drafts from its own prompt + output where no candidate
continues it (worker/draft_index.py: SuffixIndex, SuffixRule; pure, no vLLM)."""

import numpy as np
import pytest

from bubblespec.worker.draft_index import Candidate, DraftLength, RequestDrafter, SuffixIndex, SuffixRule

RULE = DraftLength(max_tokens=4, token_budget=64, min_accept_prob=0.3, prior=0.7)
SUFFIX = SuffixRule(min_match=2, max_match=8, max_occurrences=4)


def arr(*xs):
    return np.array(xs, dtype=np.int64)


def test_index_proposes_what_followed_the_earlier_occurrence():
    idx = SuffixIndex(SUFFIX, [7, 1, 2, 3, 4, 9, 1, 2])
    assert idx.match() == (3, 2)  # 1 2 occurred ending before position 3
    assert idx.propose(3) == [3, 4, 9]


def test_longest_match_wins_over_the_most_recent():
    # "1 2" occurs twice before the end; only the first occurrence is preceded by 5 as the end is
    idx = SuffixIndex(SUFFIX, [5, 1, 2, 30, 8, 1, 2, 40, 5, 1, 2])
    assert idx.match() == (3, 3)
    assert idx.propose(1) == [30]


def test_most_recent_among_equal_matches():
    idx = SuffixIndex(SUFFIX, [1, 2, 30, 9, 1, 2, 40, 8, 1, 2])
    assert idx.propose(1) == [40]


def test_no_earlier_occurrence_or_too_short_proposes_nothing():
    assert SuffixIndex(SUFFIX, [1, 2, 3, 4]).propose(4) == []
    assert SuffixIndex(SUFFIX, [1, 2]).propose(4) == []
    assert SuffixIndex(SUFFIX, [3, 1, 2, 1]).propose(4) == []  # "2 1" never occurred before


def test_continuation_repeats_the_period_into_the_future():
    idx = SuffixIndex(SUFFIX, [4, 5, 6, 4, 5, 6, 4, 5])
    assert idx.propose(6) == [6, 4, 5, 6, 4, 5]
    assert SuffixIndex(SUFFIX, [9, 9, 9]).propose(3) == [9, 9, 9]


def test_extend_is_incremental_and_equals_a_fresh_index():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1, 5]
    grown = SuffixIndex(SUFFIX, seq[:4])
    for i in range(4, len(seq)):
        grown.extend(seq[i:i + 1])
        fresh = SuffixIndex(SUFFIX, seq[:i + 1])
        assert grown.match() == fresh.match() and grown.propose(3) == fresh.propose(3)
    assert grown.propose(2) == [9, 2]


def test_match_length_is_capped():
    rule = SuffixRule(min_match=2, max_match=3, max_occurrences=4)
    idx = SuffixIndex(rule, [1, 2, 3, 4, 5, 0, 1, 2, 3, 4])
    assert idx.match() == (4, 3)  # would be 4 long without the cap


@pytest.mark.parametrize("kwargs, field", [({"min_match": 0}, "min_match"), ({"min_match": 4, "max_match": 3}, "max_match"),
                                           ({"max_occurrences": 0}, "max_occurrences")])
def test_bad_rule_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SuffixRule(**kwargs)


def test_drafter_falls_back_to_its_own_text_and_counts_the_source():
    prompt = [11, 12, 13, 14]
    d = RequestDrafter([], RULE, suffix=SUFFIX, prompt_tokens=prompt)
    assert d.propose(arr(12, 13), cap=4) == [14, 12, 13]  # prompt "12 13 14" then the period
    d.observe(3)  # two accepted + a token of the target's own
    assert d.stats.drafted["suffix"] == 3 and d.stats.accepted["suffix"] == 2
    assert d.accept == RULE.prior  # stored-draft acceptance is kept apart from the suffix's


def test_a_candidate_that_continues_wins_over_the_suffix():
    d = RequestDrafter([Candidate("future", arr(12, 13, 50, 51))], RULE, suffix=SUFFIX, prompt_tokens=[11, 12, 13, 14])
    assert d.propose(arr(12, 13), cap=4) == [50, 51]
    d.observe(3)
    assert d.stats.drafted["future"] == 2 and d.stats.drafted["suffix"] == 0
    # generation left the candidate ("60 13 14" is nowhere in it): the request's own text takes over
    assert d.propose(arr(12, 13, 50, 51, 60, 13, 14), cap=4) == [12, 13, 50]
    d.observe(1)
    assert d.stats.drafted == {"future": 2, "history": 0, "sibling": 0, "suffix": 3}


def test_suffix_off_or_absent_proposes_nothing_without_candidates():
    assert RequestDrafter([], RULE, prompt_tokens=[1, 2, 1]).propose(arr(2), cap=4) == []
    off = SuffixRule(enabled=False, min_match=2)
    assert RequestDrafter([], RULE, suffix=off, prompt_tokens=[1, 2, 1]).propose(arr(2), cap=4) == []


def test_shorter_output_restarts_the_index_from_the_prompt():
    d = RequestDrafter([], RULE, suffix=SUFFIX, prompt_tokens=[1, 2, 3])
    d.propose(arr(7, 8, 9, 7, 8), cap=4)
    assert d.propose(arr(1, 2), cap=4)[:1] == [3]  # 7 8 9 forgotten: only the prompt matches
    assert d._suffix.tokens == [1, 2, 3, 1, 2]
