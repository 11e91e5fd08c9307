"""The proposer skips its search after fruitless ones (``draft_index.SearchBackoff``): in a
batch whose samples diverge it searches in few steps; a proposal that drafts, or a request that
joins, searches again at once. The proposer runs on the fake runner of
test_finished_siblings.py (no vLLM)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from bubblespec.worker.draft_index import SearchBackoff
from bubblespec.worker.group_index import GroupIndex
from tests.unit.test_finished_siblings import Batch


def test_the_skips_double_up_to_the_cap_and_a_draft_resets_them() -> None:
    b = SearchBackoff(most=4)
    pattern = []
    for _ in range(14):
        skipped = b.skip()
        pattern.append(int(skipped))
        if not skipped:
            b.searched(False)
    assert pattern == [0, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1]  # skip 1, 2, 4, then 4 again
    b.searched(True)
    assert not b.skip()
    b.searched(False)
    b.reset()
    assert not b.skip()


def _counting_finds(monkeypatch) -> list[int]:
    calls = [0]
    find = GroupIndex.find

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return find(self, *args, **kwargs)

    monkeypatch.setattr(GroupIndex, "find", counted)
    return calls


def test_a_diverging_batch_searches_in_few_steps(monkeypatch) -> None:
    calls = _counting_finds(monkeypatch)
    rng = np.random.default_rng(3)
    b = Batch()
    for i in range(16):  # one group whose samples share no 1-gram past the first token
        b.add(f"r{i}", answer=np.concatenate([[7], rng.permutation(np.arange(1000 + 60 * i, 1060 + 60 * i))]))
    steps = 0
    while b.batch.req_ids:
        b.step()
        steps += 1
    p = b.proposer
    assert p.drafted_proposals == 0 and p.skipped > 0.8 * steps
    assert 0 < calls[0] <= 16 * (steps - p.skipped)  # the searching steps' rows only


def test_a_joining_request_and_a_drafting_proposal_search_at_once(monkeypatch) -> None:
    calls = _counting_finds(monkeypatch)
    b = Batch()
    b.add("first")  # alone: nothing to draft from, so it backs off
    for _ in range(12):
        b.step()
    assert b.proposer.skipped > 0
    before = calls[0]
    b.add("second")  # joins behind the first: the first's output continues it
    b.step()
    assert calls[0] > before and b.state["second"]["draft"]  # searched, and drafted, the step it joined
    skipped, steps = b.proposer.skipped, 1
    while b.state["second"]["done"] + 8 < b.state["first"]["done"]:  # until it catches up with the first
        assert b.state["second"]["draft"]
        b.step()
        steps += 1
    assert steps >= 2 and b.proposer.skipped == skipped  # each of those proposals drafted: none skipped


def test_a_request_drafts_from_its_own_text_in_steps_that_skip_the_search() -> None:
    b = Batch()
    b.proposer.suffix = replace(b.proposer.suffix, enabled=True)
    # 40 tokens that repeat nothing, then a 4-token pattern over and over
    answer = np.concatenate([np.arange(500, 540), np.tile([11, 12, 13, 14], 40)])
    b.add("alone", prompt=(1, 2, 3), answer=answer)  # no other text in its group: every search is fruitless
    drafted_at = []
    while b.batch.req_ids:
        b.step()
        drafted_at.append(bool(b.state["alone"]["draft"]))
    p = b.proposer
    assert p.skipped > 0  # the group search backed off while the output repeated nothing
    repeating = drafted_at[40:]  # one token a step until the pattern recurs
    start = repeating.index(True)
    assert start <= 12 and all(repeating[start:-1])  # then its own text drafts every step, skipped or not


def test_a_request_with_drafts_off_beside_them_does_not_keep_the_search_on(monkeypatch) -> None:
    calls = _counting_finds(monkeypatch)
    rng = np.random.default_rng(4)
    b = Batch()
    for i in range(8):
        b.add(f"r{i}", answer=np.concatenate([[7], rng.permutation(np.arange(1000 + 60 * i, 1060 + 60 * i))]))
    b.add("off", answer=np.arange(2000, 2061))
    b.requests["off"].sampling_params.extra_args["bubblespec"]["enabled"] = False  # the proposer keeps no drafter for it
    steps = 0
    while b.batch.req_ids:
        b.step()
        steps += 1
    assert b.proposer.skipped > 0.8 * steps and calls[0] <= 8 * (steps - b.proposer.skipped)
