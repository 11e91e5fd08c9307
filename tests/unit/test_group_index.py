"""One suffix structure per prompt group (``worker/group_index.py``): what it holds, what a
search may return, and its bounds (pure, no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest

from bubblespec.worker.group_index import GroupIndex, GroupRule
from bubblespec.worker.ngram_table import PositionTable, ngram_keys


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_a_text_held_twice_is_one_text_counted_as_the_better_source() -> None:
    group = GroupIndex()
    assert group.add("sibling", arr(1, 2, 3), finished=True) is not None
    assert group.add("future", arr(1, 2, 3)) is None  # a later sample's stored draft: the same tokens
    assert group.add("history", arr(1, 2, 3)) is None  # ranks after future: stays future
    assert group.add("future", arr()) is None
    assert [(c.source, c.tokens.tolist()) for c in group.candidates()] == [("future", [1, 2, 3])]
    job = group.add("sibling", (), live=True)  # a draft job's run of the same prompt
    group.extend(job, arr(1, 2, 4))
    group.finish(job, "future")
    assert [c.source for c in group.candidates()] == ["future", "future"]
    again = group.add("sibling", (), live=True)
    group.extend(again, arr(1, 2, 4))
    group.finish(again)  # word for word a text the group holds: not kept twice
    assert len(group.candidates()) == 2


def test_on_a_tie_a_stored_draft_goes_before_a_sibling() -> None:
    group = GroupIndex()
    group.add("sibling", arr(7, 8, 9, 5), finished=True)
    group.add("history", arr(7, 8, 9, 6))
    cand, at = group.find(arr(7, 8, 9))
    assert cand.source == "history" and cand.tokens[at] == 6


def test_the_samples_own_text_and_a_sibling_behind_it_are_never_found() -> None:
    group = GroupIndex()
    own = group.add("sibling", arr(5, 6, 7, 5, 6), live=True)
    behind = group.add("sibling", arr(5, 6, 7, 5), live=True)
    assert group.find(arr(5, 6, 7, 5, 6), exclude=own) is None  # only its own past, and a sibling behind it
    group.extend(behind, arr(6, 9))  # now ahead of it
    cand, at = group.find(arr(5, 6, 7, 5, 6), exclude=own)
    assert cand is behind.candidate and cand.tokens[at] == 9


def test_a_finished_sample_stays_and_the_oldest_go_past_the_bound() -> None:
    group = GroupIndex(GroupRule(max_finished=2))
    docs = [group.add("sibling", (), live=True) for _ in range(3)]
    for i, doc in enumerate(docs):
        group.extend(doc, arr(10 * i, 1, 2, 3, 40 + i))
        group.finish(doc)
    assert [c.tokens[0] for c in group.candidates()] == [10, 20]
    cand, at = group.find(arr(1, 2, 3))
    assert cand.tokens[at] in (41, 42)  # never the dropped first one's 40
    group.forget_finished()
    assert group.candidates() == [] and group.find(arr(1, 2, 3)) is None


def test_dropped_texts_are_swept_from_the_map() -> None:
    group = GroupIndex(GroupRule(max_finished=1))
    for i in range(6):
        group.add("sibling", np.arange(100) + i, finished=True)
    assert len(group.candidates()) == 1
    assert group.indexed <= 2 * 100  # rebuilt once the dropped outnumbered the kept


def test_past_its_token_bound_a_group_keeps_texts_without_indexing_them() -> None:
    group = GroupIndex(GroupRule(max_tokens=8))
    group.add("history", arr(1, 2, 3, 4, 5, 6, 7, 8, 9))
    late = group.add("future", arr(20, 21, 22, 23))
    assert late is not None and late.candidate in group.candidates()
    assert group.find(arr(21, 22)) is None  # not indexed
    assert group.find(arr(2, 3))[0].tokens[0] == 1


@pytest.mark.parametrize("field,value", [("min_match", 0), ("max_occurrences", 0), ("max_finished", 0),
                                         ("max_tokens", 0), ("max_match", 2)])
def test_a_bad_rule_names_its_field(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        GroupRule(**{field: value})


def test_the_position_table_agrees_with_a_dict_of_lists_through_its_growth() -> None:
    rng = np.random.default_rng(3)
    table, plain = PositionTable(min_bits=2), {}
    value = 0
    for _ in range(200):  # batches of 1-40 entries over 60 keys: many chains share buckets, the buckets double
        keys = rng.integers(0, 60, int(rng.integers(1, 41))).astype(np.uint64)
        values = np.arange(value, value + len(keys))
        value += len(keys)
        table.add(keys, values)
        for k, v in zip(keys.tolist(), values.tolist()):
            plain.setdefault(k, []).append(v)
        k = int(rng.integers(0, 61))
        assert table.newest(k, 5) == plain.get(k, [])[::-1][:5]
    assert table.n == value and all(table.newest(k, 10**6) == v[::-1] for k, v in plain.items())


def test_ngram_keys_key_each_window_and_tell_orders_apart() -> None:
    keys = ngram_keys(arr(1, 2, 3, 1, 2, 3, 3, 2, 1), 3)
    assert len(keys) == 7 and keys[0] == keys[3] and keys[0] != keys[6]  # "1 2 3" twice; "3 2 1" differs
    assert ngram_keys(arr(4, 5), 3).tolist() == [] and ngram_keys(arr(4, 5), 1).tolist() == [4, 5]


def test_texts_grown_piece_by_piece_index_as_texts_added_whole() -> None:
    rng = np.random.default_rng(11)
    for _ in range(30):
        texts = [rng.integers(0, 5, int(rng.integers(1, 60))) for _ in range(int(rng.integers(1, 5)))]
        whole, grown = GroupIndex(), GroupIndex()
        for t in texts:
            whole.add("sibling", t, finished=True)
        docs = [grown.add("sibling", (), live=True) for _ in texts]
        for doc, t in zip(docs, texts):
            at = 0
            while at < len(t):  # 1-7 tokens a step, searches in between (each flushes what grew)
                step = int(rng.integers(1, 8))
                grown.extend(doc, t[at:at + step])
                at += step
                grown.find(rng.integers(0, 5, 4))
        for doc in docs:
            grown.finish(doc)
        for _ in range(20):
            q = rng.integers(0, 5, int(rng.integers(0, 10)))
            a, b = whole.find(q), grown.find(q)
            assert (a is None) == (b is None)
            if a is not None:
                assert a[1] == b[1] and np.array_equal(a[0].tokens, b[0].tokens)


def _tables(group: GroupIndex) -> list[list[int]]:
    out = []
    for table in (group._ones, group._ends):
        n = table.n
        out += [table._key[:n].tolist(), table._val[:n].tolist(), table._next[:n].tolist(), table._head.tolist()]
    return out


def test_a_few_new_tokens_index_as_the_vectorised_path_indexes_them() -> None:
    rng = np.random.default_rng(5)
    for trial in range(8):
        few, vector = GroupIndex(), GroupIndex()
        vector.SMALL_FLUSH = 0  # every update through numpy
        assert few.SMALL_FLUSH > 8  # a pass's updates below go one by one
        for g in (few, vector):
            g.add("future", np.arange(30) % 7)
        docs = [(few.add("sibling", (), live=True), vector.add("sibling", (), live=True)) for _ in range(3)]
        searched = 0
        for _ in range(400):  # 1-8 tokens to one or more running texts, a search; now and then a new text
            for a, b in docs:
                if rng.random() < 0.6:
                    new = rng.integers(0, 6, int(rng.integers(1, 9)))
                    few.extend(a, new)
                    vector.extend(b, new)
            if rng.random() < 0.05:
                text = rng.integers(0, 6, int(rng.integers(1, 40)))
                few.add("history", text)
                vector.add("history", text)
            q = rng.integers(0, 6, int(rng.integers(1, 6)))
            x, y = few.find(q, exclude=docs[0][0]), vector.find(q, exclude=docs[0][1])
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                assert x[1] == y[1] and np.array_equal(x[0].tokens, y[0].tokens)
                searched += 1
            assert _tables(few) == _tables(vector), trial
        assert searched > 0 and few.indexed == vector.indexed > 0
        assert len(few._ends._head) > 1 << 10  # the buckets doubled along the way (1,024 to start)


def test_a_request_whose_sources_all_collapsed_searches_only_on_probe_steps() -> None:
    from bubblespec.worker.draft_index import DraftLength, RequestDrafter

    rule = DraftLength(max_tokens=4, prior=0.7, probe_every=8)
    group = GroupIndex()
    group.add("sibling", arr(*range(10, 80)), finished=True)
    d = RequestDrafter([], rule, group=group)
    searches = []
    find = group.find
    group.find = lambda *a, **k: searches.append(1) or find(*a, **k)  # type: ignore[method-assign]
    assert d.propose(arr(10, 11, 12), cap=4) == [13, 14, 15]
    d.observe(1)  # rejected: the sibling acceptance falls to 0.49, still above the 0.3 floor
    assert not d.nothing_pays(4)
    d.accepts["sibling"] = 0.1  # collapsed
    searched, held = [], []
    for i in range(16):  # one step each; the request has left the sibling's text
        searches.clear()
        d.propose(arr(10, 11, 12, *([99] * (i + 1))), cap=4)
        searched.append(bool(searches))
        held.append(d.held_back)
        d.observe(1)
    assert [i for i, x in enumerate(searched) if x] == [7, 15]  # the probe steps (8th and 16th pass) only
    assert [i for i, x in enumerate(held) if not x] == [7, 15]  # the others held back, as the cost fit must know


def test_a_dropped_text_is_not_held_by_the_content_map() -> None:
    group = GroupIndex(GroupRule(max_finished=2))
    for i in range(10):
        group.add("sibling", np.arange(50) + i, finished=True)
    assert len(group._kept) == len(group.candidates()) == 2  # the dropped texts' buffers are free
    assert group.add("sibling", np.arange(50), finished=True) is not None  # gone, so new again


def test_the_proposer_drafts_the_same_on_both_index_paths() -> None:
    import argparse

    from bubblespec.bench import propose_cost

    # a bench-shaped step on a fake runner (bench/propose_cost.py), once per path of GroupIndex._flush
    args = argparse.Namespace(k=8, draft_token_seconds=3e-5, pass_seconds=4e-3)
    for seed in range(3):
        rows = propose_cost.make_workload(6, 2, 2, 0.5, seed)
        few = propose_cost.run_step(rows, GroupIndex.SMALL_FLUSH, args)[1]
        vector = propose_cost.run_step(rows, 0, args)[1]
        assert few == vector and len(few) > 10
        assert sum(len(d) for step in few for d in step) > 100  # drafts were proposed, not only empty lists
