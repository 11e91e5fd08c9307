"""Grouped drafts on one engine: a finished sample's response is a ``sibling`` draft for the
later and still-running samples of its group (the same prompt, adapter version and weights),
never for another group's; memory stays bounded (``worker/groups.py``). The proposer runs on a
fake model runner (no vLLM); tests/integration/test_drafting.py runs it on a vLLM engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bubblespec.worker.draft_index import Candidate, DraftLength, RequestDrafter
from bubblespec.worker.group_index import GroupIndex, GroupRule
from bubblespec.worker.groups import FinishedSamples
from bubblespec.worker.proposer import BubbleSpecProposer

PROMPT = (5, 6, 7)
ANSWER = np.arange(100, 160, dtype=np.int64)


class Batch:
    """A fake runner whose batch is the requests added and not yet finished; each runs ANSWER
    (or its own ``answer``), one token a step plus whatever of its draft matches."""

    def __init__(self) -> None:
        config = SimpleNamespace(additional_config={"bubblespec": {"cpu_sampler_fix": False}},
                                 speculative_config=SimpleNamespace(num_speculative_tokens=8),
                                 model_config=SimpleNamespace(get_vocab_size=lambda: 1000),
                                 device_config=SimpleNamespace(device=SimpleNamespace(type="cpu")))
        self.proposer = BubbleSpecProposer(config)
        self.requests: dict = {}
        self.batch = SimpleNamespace(req_ids=[])
        self.proposer.attach(SimpleNamespace(input_batch=self.batch, requests=self.requests, execute_model=lambda: None))
        self.state: dict[str, dict] = {}

    def add(self, rid: str, prompt=PROMPT, answer=ANSWER, weights: int = 0, adapter: str = "") -> None:
        self.requests[rid] = SimpleNamespace(prompt_token_ids=list(prompt), sampling_params=SimpleNamespace(extra_args={
            "bubblespec": {"key": rid, "drafts": [], "weights": weights, "adapter": adapter}}))
        self.batch.req_ids.append(rid)
        self.state[rid] = {"prompt": prompt, "answer": answer, "done": 0, "draft": [], "passes": 0}

    def step(self) -> None:
        sampled = []
        for rid in self.batch.req_ids:
            s = self.state[rid]
            ok = 0
            for t in s["draft"]:
                if s["done"] + ok < len(s["answer"]) and s["answer"][s["done"] + ok] == t:
                    ok += 1
                else:
                    break
            take = min(ok + 1, len(s["answer"]) - s["done"])
            sampled.append(s["answer"][s["done"]:s["done"] + take].tolist())
            s["done"] += take
            s["passes"] += 1
        width = max(len(self.state[r]["prompt"]) + self.state[r]["done"] for r in self.batch.req_ids)
        ids = np.zeros((len(self.batch.req_ids), width), dtype=np.int64)
        lengths = np.zeros(len(self.batch.req_ids), dtype=np.int64)
        for i, rid in enumerate(self.batch.req_ids):
            s = self.state[rid]
            row = list(s["prompt"]) + s["answer"][:s["done"]].tolist()
            ids[i, :len(row)], lengths[i] = row, len(row)
        drafts = self.proposer.propose(sampled, lengths, ids)
        for rid, d in zip(self.batch.req_ids, drafts):
            self.state[rid]["draft"] = d
        for rid in [r for r in self.batch.req_ids if self.state[r]["done"] >= len(self.state[r]["answer"])]:
            self.batch.req_ids.remove(rid)  # finished: gone from the batch (its drafter retires next step)

    def run(self) -> None:
        while self.batch.req_ids:
            self.step()
        self.step_empty()

    def step_empty(self) -> None:
        self.proposer.propose([], np.zeros(0, dtype=np.int64), np.zeros((0, 1), dtype=np.int64))


def test_a_later_sample_drafts_from_a_finished_one_and_takes_far_fewer_passes() -> None:
    b = Batch()
    b.add("first")
    b.run()
    assert b.state["first"]["passes"] == len(ANSWER)  # nothing to draft from
    b.add("second")
    b.run()
    stats = b.proposer.pop_stats(["second"])["second"]
    assert stats["accepted"]["sibling"] > 0.8 * len(ANSWER)
    assert b.state["second"]["passes"] < len(ANSWER) / 3


@pytest.mark.parametrize("other", [dict(prompt=(5, 6, 8)), dict(weights=1), dict(adapter="math@1")])
def test_another_groups_finished_sample_is_never_a_draft(other: dict) -> None:
    b = Batch()
    b.add("first")
    b.run()
    b.add("other", **other)
    b.run()
    assert b.state["other"]["passes"] == len(ANSWER)
    assert b.proposer.pop_stats(["other"])["other"]["drafted"]["sibling"] == 0


def test_a_running_sample_keeps_drafting_from_a_sibling_that_finished_beside_it() -> None:
    b = Batch()
    long = np.arange(100, 400, dtype=np.int64)
    b.add("first", answer=long)
    for _ in range(len(long) - 1):  # one token short of its end
        b.step()
    b.add("second", answer=long)  # starts far behind: the live first is ahead of it
    b.step()  # the first finishes
    b.step()  # ... and leaves the batch: its response stays a candidate of the second
    drafter = next(d for d in b.proposer.drafters.values() if d.key == "second")
    assert any(c.source == "sibling" and np.array_equal(c.tokens, long) for c in drafter.candidates)
    b.run()
    assert b.state["second"]["passes"] < len(long) / 4
    assert b.proposer.pop_stats(["second"])["second"]["accepted"]["sibling"] > 0.8 * len(long)


def test_the_store_is_bounded_by_tokens_and_by_group() -> None:
    store = FinishedSamples(max_tokens=100, per_group=2)
    for i in range(3):
        assert store.add(1, np.arange(10) + i)
    assert [r[0] for r in store.of(1)] == [1, 2] and store.tokens == 20  # the newest two
    assert store.add(2, np.arange(50)) and store.add(3, np.arange(40))  # 110 tokens: group 1 (least used) goes
    assert store.of(1) == [] and store.tokens == 90 and len(store) == 2
    assert not store.add(4, np.arange(101)) and not store.add(4, np.arange(0))  # longer than the bound; empty
    with pytest.raises(ValueError, match="per_group"):
        FinishedSamples(per_group=0)


def test_a_text_added_while_a_live_sibling_is_followed_keeps_the_cursor_on_it() -> None:
    group = GroupIndex()
    group.add("sibling", np.array([7, 8, 9, 10, 11]), live=True)
    d = RequestDrafter([Candidate("future", np.array([1, 2, 3]))], DraftLength(), prompt_len=0, group=group)
    assert d.propose(np.array([7, 8]), cap=2) == [9, 10]
    group.add("sibling", np.array([7, 8, 9, 4, 4]), finished=True)
    assert [c.tokens.tolist() for c in d.candidates] == [[7, 8, 9, 10, 11], [1, 2, 3], [7, 8, 9, 4, 4]]
    assert d.propose(np.array([7, 8, 9]), cap=2) == [10, 11]  # still the live sibling it was following


def test_a_group_keeps_at_most_sixteen_finished_siblings() -> None:
    group = GroupIndex()
    d = RequestDrafter([], DraftLength(), prompt_len=0, group=group)
    for i in range(20):
        group.add("sibling", np.array([i, i + 1]), finished=True)
    assert len(d.candidates) == GroupRule().max_finished == 16
    assert [c.tokens[0] for c in d.candidates] == list(range(4, 20))  # the newest
