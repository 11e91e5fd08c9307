"""Draft matching and the adaptive draft-length rule (pure, no vLLM)."""

import numpy as np

from bubblespec.worker.draft_index import Candidate, DraftLength, RequestDrafter

RULE = DraftLength(max_tokens=4, token_budget=64, min_accept_prob=0.3, prior=0.7)


def arr(*xs):
    return np.array(xs, dtype=np.int64)


def test_aligned_candidate_proposes_its_continuation():
    d = RequestDrafter([Candidate("future", arr(1, 2, 3, 4, 5, 6, 7, 8))], RULE)
    assert d.propose(arr(1, 2), cap=4) == [3, 4, 5]  # prior 0.7: 0.7**3 >= 0.3 > 0.7**4
    d.observe(4)  # all three accepted + bonus
    assert d.stats.accepted["future"] == 3 and d.stats.drafted["future"] == 3


def test_divergence_resyncs_on_the_generated_suffix():
    d = RequestDrafter([Candidate("history", arr(5, 6, 7, 8, 9, 10, 11))], RULE)
    assert d.propose(arr(5, 6), cap=4)[:1] == [7]
    d.observe(1)  # rejected
    # generation went elsewhere, then re-joined the candidate's text at 8 9
    assert d.propose(arr(5, 6, 42, 8, 9), cap=4)[:1] == [10]


def test_no_match_proposes_nothing():
    d = RequestDrafter([Candidate("history", arr(5, 6, 7))], RULE)
    assert d.propose(arr(9, 9, 9), cap=4) == []


def test_siblings_are_live_and_replaceable():
    d = RequestDrafter([], RULE)
    d.set_siblings([Candidate("sibling", arr(1, 2, 3, 4))])
    assert d.propose(arr(1, 2), cap=4)[:2] == [3, 4]
    d.set_siblings([Candidate("sibling", arr(1, 2, 3, 4, 5, 6))])
    d.observe(3)
    assert d.propose(arr(1, 2, 3, 4), cap=4)[:2] == [5, 6]


def test_length_rule_follows_acceptance_and_batch():
    assert RULE.batch_cap(8) == 4 and RULE.batch_cap(32) == 2 and RULE.batch_cap(128) == 0
    assert RULE.for_request(0.95, steps=1, cap=4) == 4
    assert RULE.for_request(0.5, steps=1, cap=4) == 1
    assert RULE.for_request(0.1, steps=1, cap=4) == 0  # collapsed: no draft ...
    assert RULE.for_request(0.1, steps=8, cap=4) == 1  # ... except a probe every 8 steps
    assert RULE.for_request(0.95, steps=1, cap=0) == 0


def test_acceptance_average_drops_after_rejections():
    d = RequestDrafter([Candidate("future", arr(*range(10, 60)))], RULE)
    before = d.accept
    d.propose(arr(10), cap=4)
    d.observe(1)
    assert d.accept < before
