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


def test_a_rejected_sibling_does_not_shorten_a_stored_draft():
    """Acceptance is averaged per source: a sibling's rejected proposals must not cut the
    length of a stored draft that continues the request later."""
    d = RequestDrafter([Candidate("future", arr(7, 8, 9, 10, 11, 12))], RULE)
    generated = [1, 2, 1, 2]
    for said in (20, 21, 22):
        d.set_siblings([Candidate("sibling", arr(*generated, 30, 31))])  # ahead, on another path
        assert d.propose(arr(*generated), cap=4)[:1] == [30]  # shorter as its acceptance falls
        d.observe(1)  # rejected: the target said something else
        generated += [said, 1, 2]
    d.set_siblings([Candidate("sibling", arr(*generated, 30, 31))])
    assert d.propose(arr(*generated, 7, 8), cap=4) == [9, 10, 11]  # the prior's length (0.7**3 >= 0.3)
    assert d.accepts["sibling"] < RULE.min_accept_prob < d.accepts["future"] == RULE.prior


def test_a_sibling_in_step_with_the_request_proposes_nothing():
    """Under greedy decoding a sibling that started with the request is the request itself:
    with no token ahead, a match in it is only the request's own past."""
    d = RequestDrafter([], RULE)
    d.set_siblings([Candidate("sibling", arr(1, 2, 1, 2))])
    assert d.propose(arr(1, 2, 1, 2), cap=4) == []
    d.set_siblings([Candidate("sibling", arr(1, 2, 1, 2, 3))])  # one token ahead: it continues the request
    assert d.propose(arr(1, 2, 1, 2), cap=4) == [3]


def test_resync_prefers_the_longest_match_then_the_nearest():
    history = arr(4, 5, 6, 1, 2, 9, 9, 3, 2, 7, 7, 3, 2, 8)  # "3 2" ends at 8 and at 12
    d = RequestDrafter([Candidate("history", history)], RULE)
    assert d.propose(arr(7, 3, 2), cap=4) == [8]  # "7 3 2" (at 12) beats the nearer "9 3 2"'s "3 2"
    d = RequestDrafter([Candidate("history", history)], RULE)
    assert d.propose(arr(0, 3, 2), cap=4) == [7, 7, 3]  # "3 2" twice: the occurrence nearest position 3


def _brute_force_resync(candidates, generated, match_len=3):
    """The resync rule written out plainly: the longest suffix (up to ``match_len``) of
    ``generated`` found in any candidate (not counting its last token), then the occurrence
    nearest ``len(generated)``, the first candidate on a tie."""
    g = len(generated)
    for m in range(min(match_len, g), 0, -1):
        best = None
        for idx, tokens in enumerate(candidates):
            for start in range(len(tokens) - m):
                if list(tokens[start:start + m]) == list(generated[g - m:]):
                    key = (abs(start + m - g), idx, start + m)
                    if best is None or key[0] < best[0]:
                        best = key
        if best is not None:
            return best[1], best[2]
    return None


def test_resync_agrees_with_the_rule_written_out_plainly():
    rng = np.random.default_rng(7)
    for _ in range(400):
        cands = [rng.integers(0, 4, int(rng.integers(1, 30))) for _ in range(int(rng.integers(1, 4)))]
        generated = rng.integers(0, 4, int(rng.integers(1, 12)))
        d = RequestDrafter([Candidate("history", c) for c in cands], RULE)
        found = d._search(generated)
        aligned = [i for i, c in enumerate(cands) if len(c) > len(generated) and list(c[:len(generated)]) == list(generated)]
        assert found == ((aligned[0], len(generated)) if aligned else _brute_force_resync(cands, generated))
