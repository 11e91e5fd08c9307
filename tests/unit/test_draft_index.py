"""Draft matching over a group's texts and the adaptive draft-length rule (pure, no vLLM)."""

import numpy as np

from bubblespec.worker.draft_index import Candidate, DraftLength, RequestDrafter
from bubblespec.worker.group_index import GroupIndex, GroupRule

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


def test_a_running_siblings_text_is_followed_as_it_grows():
    group = GroupIndex()
    sibling = group.add("sibling", arr(1, 2, 3, 4), live=True)
    d = RequestDrafter([], RULE, group=group)
    assert d.propose(arr(1, 2), cap=4)[:2] == [3, 4]
    group.extend(sibling, arr(5, 6))
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


def test_a_rejected_sibling_does_not_shorten_a_stored_draft():
    """Acceptance is averaged per source: a sibling's rejected proposals must not cut the
    length of a stored draft that continues the request later."""
    group = GroupIndex()
    d = RequestDrafter([Candidate("future", arr(7, 8, 9, 10, 11, 12))], RULE, group=group)
    generated = [1, 2, 1, 2]
    sibling = None
    for said in (20, 21, 22):
        if sibling is not None:
            group.drop(sibling)
        sibling = group.add("sibling", arr(*generated, 30, 31), live=True)  # ahead, on another path
        assert d.propose(arr(*generated), cap=4)[:1] == [30]  # shorter as its acceptance falls
        d.observe(1)  # rejected: the target said something else
        generated += [said, 1, 2]
    group.drop(sibling)
    group.add("sibling", arr(*generated, 30, 31), live=True)
    assert d.propose(arr(*generated, 7, 8), cap=4) == [9, 10, 11]  # the prior's length (0.7**3 >= 0.3)
    assert d.accepts["sibling"] < RULE.min_accept_prob < d.accepts["future"] == RULE.prior


def test_a_sibling_in_step_with_the_request_proposes_nothing():
    """Under greedy decoding a sibling that started with the request is the request itself:
    with no token ahead, a match in it is only the request's own past."""
    group = GroupIndex()
    sibling = group.add("sibling", arr(1, 2, 1, 2), live=True)
    d = RequestDrafter([], RULE, group=group)
    assert d.propose(arr(1, 2, 1, 2), cap=4) == []
    group.extend(sibling, arr(3))  # one token ahead: it continues the request
    assert d.propose(arr(1, 2, 1, 2), cap=4) == [3]


def test_resync_prefers_the_longest_match_then_the_nearest():
    history = arr(4, 5, 6, 1, 2, 9, 9, 3, 2, 7, 7, 3, 2, 8)  # "3 2" ends at 8 and at 12
    d = RequestDrafter([Candidate("history", history)], RULE)
    assert d.propose(arr(7, 3, 2), cap=4) == [8]  # "7 3 2" (at 12) beats the nearer "9 3 2"'s "3 2"
    d = RequestDrafter([Candidate("history", history)], RULE)
    assert d.propose(arr(0, 3, 2), cap=4) == [7, 7, 3]  # "3 2" twice: the occurrence nearest position 3


def test_resync_takes_the_continuation_most_texts_agree_on():
    """Among the longest matches, the next token that most texts continue with wins, then the
    occurrence nearest the request's position."""
    group = GroupIndex()
    group.add("history", arr(1, 2, 3, 4, 5))  # the nearest "2 3" ...
    group.add("sibling", arr(9, 9, 9, 9, 9, 9, 2, 3, 7, 7), finished=True)  # ... against two texts saying 7
    group.add("sibling", arr(8, 8, 8, 8, 8, 8, 8, 2, 3, 7, 6), finished=True)
    d = RequestDrafter([], RULE, group=group)
    assert d.propose(arr(0, 2, 3), cap=4)[:1] == [7]
    d = RequestDrafter([], RULE, group=group)
    assert d.propose(arr(1, 2, 3), cap=4)[:1] == [4]  # a longer match beats the vote


def _brute_force_resync(texts, generated, most=24):
    """The resync rule written out plainly over distinct ``texts``: every position after a
    match of the output's last tokens (with a token there to propose); the longest match (up
    to ``most`` tokens); the next token that most texts continue with; the occurrence nearest
    ``len(generated)``; the text added first."""
    g = len(generated)
    if g == 0:
        return next(((i, 0) for i, t in enumerate(texts) if len(t)), None)
    found = []
    for idx, tokens in enumerate(texts):
        for end in range(1, len(tokens)):
            n = 0
            while n < min(most, end, g) and tokens[end - 1 - n] == generated[g - 1 - n]:
                n += 1
            if n:
                found.append((n, idx, end))
    if not found:
        return None
    top = max(n for n, _, _ in found)
    best = [(idx, end) for n, idx, end in found if n == top]
    votes = {}
    for idx, end in best:
        votes.setdefault(int(texts[idx][end]), set()).add(idx)
    most_votes = max(map(len, votes.values()))
    return min(((i, e) for i, e in best if len(votes[int(texts[i][e])]) == most_votes),
               key=lambda ie: (abs(ie[1] - g), ie[0], ie[1]))


def test_resync_agrees_with_the_rule_written_out_plainly():
    rng = np.random.default_rng(7)
    rule = GroupRule(max_occurrences=10_000)  # the plain rule looks at every occurrence
    for _ in range(400):
        texts = []
        for _ in range(int(rng.integers(1, 4))):
            t = rng.integers(0, 4, int(rng.integers(1, 30)))
            if not any(len(t) == len(u) and np.array_equal(t, u) for u in texts):  # the index keeps one of each
                texts.append(t)
        generated = rng.integers(0, 4, int(rng.integers(0, 12)))
        group = GroupIndex(rule)
        for t in texts:
            group.add("history", t)
        found = group.find(generated)
        want = _brute_force_resync(texts, generated)
        got = None if found is None else (next(i for i, t in enumerate(texts) if t is not None and np.array_equal(
            found[0].tokens, t)), found[1])
        assert got == want, (texts, generated)
