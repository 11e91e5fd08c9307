"""Draft lengths for a batch's last request (``worker/tail_drafts.py``) and the proposer that
uses them with the paying rule (``EngineSettings.draft_for_makespan``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bubblespec.common.rules import paying_draft_tokens
from bubblespec.worker.proposer import BubbleSpecProposer
from bubblespec.worker.tail_drafts import makespan_draft_tokens

CPU_TINY_DRAFT_TOKEN = 6.24e-5  # a draft token of the bench's model, by the 2026-11-22 calibration (bench/sim/costs.py)


def modelled_seconds(lengths, accept, k, pass_seconds, c) -> float:
    """The rule's own model: passes until the last request ends x the pass's cost."""
    a = np.asarray(accept, dtype=float)
    k = np.asarray(k, dtype=float)
    per_pass = np.where(a >= 1, k + 1, (1 - a ** (k + 1)) / (1 - np.where(a >= 1, 0.5, a)))
    return float(np.max(np.asarray(lengths) / per_pass)) * (pass_seconds + c * float(k.sum()))


def test_the_long_requests_draft_deep_and_the_short_ones_not_at_all():
    lengths = [300, 40, 30, 25, 20, 20, 15, 10]
    k = makespan_draft_tokens(lengths, [0.8] * 8, [32] * 8, 0.010, CPU_TINY_DRAFT_TOKEN)
    assert k[0] >= 8 and list(k[-4:]) == [0, 0, 0, 0]
    assert list(k) == sorted(k, reverse=True)  # never deeper for a shorter request at equal acceptance


def test_the_plan_is_never_slower_in_its_model_than_no_drafts_or_the_throughput_rule():
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 64))
        lengths = rng.integers(1, 400, n)
        accept = rng.uniform(0.2, 1.0, n)
        pass_seconds, c = float(rng.uniform(0.002, 0.03)), float(rng.choice([1e-5, 6.24e-5, 5e-4]))
        k = makespan_draft_tokens(lengths, accept, [32] * n, pass_seconds, c)
        assert k.dtype == np.int64 and len(k) == n and (k >= 0).all() and (k <= np.minimum(32, lengths)).all()
        tps = n / pass_seconds  # a pass without drafts makes a token per request
        throughput = [min(paying_draft_tokens(a, 32, c, tps), int(n_)) for a, n_ in zip(accept, lengths)]
        mine = modelled_seconds(lengths, accept, k, pass_seconds, c)
        assert mine <= modelled_seconds(lengths, accept, [0] * n, pass_seconds, c) + 1e-12
        assert mine <= modelled_seconds(lengths, accept, throughput, pass_seconds, c) * 1.05  # a grid, not the optimum


def test_nothing_is_drafted_where_no_draft_can_pay():
    assert list(makespan_draft_tokens([100, 50], [0.9, 0.9], [8, 8], 0.001, 1.0)) == [0, 0]  # a token costs 1000 passes
    assert list(makespan_draft_tokens([100, 50], [0.0, 0.0], [8, 8], 0.01, 1e-5)) == [0, 0]  # nothing is accepted
    assert list(makespan_draft_tokens([1, 1], [1.0, 1.0], [8, 8], 0.01, 1e-5)) == [0, 0]  # one token left: no draft helps
    assert len(makespan_draft_tokens([], [], [], 0.01, 1e-5)) == 0


@pytest.mark.parametrize("accept", [1.0, 0.9999999, 0.5])
def test_sure_and_near_sure_acceptance_agree_with_the_cap(accept):
    k = makespan_draft_tokens([200, 5], [accept, accept], [32, 32], 0.005, CPU_TINY_DRAFT_TOKEN)
    assert 0 <= k[1] <= k[0] <= 32


# --- the proposer on a fake runner that runs a batch to its end ----------------------------------


class Batch:
    """Requests with perfect ``future`` drafts of their whole answers, ``lengths`` tokens long;
    every draft token is accepted; a step takes ``pass_seconds + c x draft tokens``. Finished
    requests leave the batch. ``run`` returns the time until the last one ended."""

    def __init__(self, lengths: list[int], makespan: bool, c: float = CPU_TINY_DRAFT_TOKEN, pass_seconds: float = 0.01,
                 cover: list[int] | None = None, predicted: list[float] | None = None, jobs: list[bool] | None = None):
        extra = {"cpu_sampler_fix": False, "draft_token_seconds": c, "makespan": makespan}
        config = SimpleNamespace(additional_config={"bubblespec": extra},
                                 speculative_config=SimpleNamespace(num_speculative_tokens=32),
                                 model_config=SimpleNamespace(get_vocab_size=lambda: 5000),
                                 device_config=SimpleNamespace(device=SimpleNamespace(type="cpu")))
        self.proposer = BubbleSpecProposer(config)
        self.now = 0.0
        self.proposer.clock = lambda: self.now
        self.answers = {f"r{i}": np.arange(1000 + 7 * i, 1000 + 7 * i + n, dtype=np.int64) for i, n in enumerate(lengths)}
        self.prompts = {rid: (5 + i, 6 + i, 7 + i) for i, rid in enumerate(self.answers)}
        cover = cover or lengths  # tokens of each answer its draft holds (a partial draft: fewer)
        predicted = predicted or [0.0] * len(lengths)  # the scheduler's predicted lengths (0: none)
        jobs = jobs or [False] * len(lengths)  # draft jobs' rows (their drafts: their own partial runs)
        requests = {rid: SimpleNamespace(prompt_token_ids=list(self.prompts[rid]), sampling_params=SimpleNamespace(
            extra_args={"bubblespec": {"key": rid, "drafts": [["future", a[:n].astype("<u4").tobytes()]] if n else [],
                                       "predicted": p, "job": job}}))
            for (rid, a), n, p, job in zip(self.answers.items(), cover, predicted, jobs)}
        self.cover = dict(zip(self.answers, cover))
        self.caught_up: dict[str, int] = {}  # request -> the pass at which it had generated its draft's tokens
        self.batch = SimpleNamespace(req_ids=list(requests))
        self.proposer.runner = SimpleNamespace(input_batch=self.batch, requests=requests)
        self.pass_seconds, self.c = pass_seconds, c
        self.generated = dict.fromkeys(self.answers, 0)
        self.drafts = {rid: [] for rid in self.answers}
        self.drafted = 0
        self.passes = 0

    def run(self) -> float:
        while self.batch.req_ids:
            ids = list(self.batch.req_ids)
            self.passes += 1
            self.now += self.pass_seconds + self.c * sum(len(self.drafts[r]) for r in ids)
            sampled = []
            for rid in ids:
                take = min(len(self.drafts[rid]) + 1, len(self.answers[rid]) - self.generated[rid])
                sampled.append(self.answers[rid][self.generated[rid]:self.generated[rid] + take].tolist())
                self.generated[rid] += take
                if self.generated[rid] >= self.cover[rid]:
                    self.caught_up.setdefault(rid, self.passes)
            self.batch.req_ids = [r for r in ids if self.generated[r] < len(self.answers[r])]
            sampled = [s for r, s in zip(ids, sampled) if r in self.batch.req_ids]
            if not self.batch.req_ids:
                break
            width = 3 + max(self.generated.values())
            token_ids = np.zeros((len(self.batch.req_ids), width), dtype=np.int64)
            for row, rid in enumerate(self.batch.req_ids):
                token_ids[row, :3] = self.prompts[rid]
                token_ids[row, 3:3 + self.generated[rid]] = self.answers[rid][:self.generated[rid]]
            lengths = np.array([3 + self.generated[r] for r in self.batch.req_ids])
            out = self.proposer.propose(sampled, lengths, token_ids)
            self.drafts = dict(zip(self.batch.req_ids, out))
            self.drafted += sum(map(len, out))
        return self.now


def test_drafting_for_the_last_request_ends_the_batch_sooner_than_drafting_for_throughput():
    lengths = [400, 120] + [30] * 46  # one long response, one medium, a batch of short ones
    makespan, throughput = Batch(lengths, makespan=True), Batch(lengths, makespan=False)
    t_makespan, t_throughput = makespan.run(), throughput.run()
    assert t_makespan < 0.8 * t_throughput, (t_makespan, t_throughput)
    assert makespan.drafted < throughput.drafted  # fewer draft tokens verified in all
    assert makespan.generated == throughput.generated == dict(zip(makespan.answers, lengths))


def test_without_the_paying_rule_the_makespan_setting_changes_nothing():
    lengths = [200, 20, 20, 20]
    on, off = Batch(lengths, makespan=True, c=0.0), Batch(lengths, makespan=False, c=0.0)
    assert on.run() == off.run() and on.drafted == off.drafted


ONE_LONG = [400, 120] + [30] * 46
MANY_PARTIAL = [400, 200, 120] + [60] * 20 + [30] * 25


@pytest.mark.parametrize("lengths,cover", [
    (ONE_LONG, [0, 120] + [30] * 46),  # the longest response has no draft: the batch ends with it whatever the rule
    (ONE_LONG, [50, 120] + [30] * 46),  # its draft was cut short (a draft job stopped half-way)
    (MANY_PARTIAL, [100, 40, 120] + [60] * 20 + [10] * 25),  # most drafts partial
])
def test_partial_drafts_never_make_the_rule_for_the_last_request_slower(lengths, cover):
    """The rule predicts a request's remaining length from its draft's remaining tokens, which a
    partial draft understates; under the step's cost model it must still end no later than the
    cost rule alone (0.1%: with no draft for the longest, both verify nearly the same tokens)."""
    on, off = Batch(lengths, makespan=True, cover=cover), Batch(lengths, makespan=False, cover=cover)
    assert on.run() <= off.run() * 1.001
    assert on.generated == off.generated == dict(zip(on.answers, lengths))


def test_a_draft_job_catches_up_with_its_own_partial_draft_beside_an_undrafted_request():
    """A draft job restarted after a stop (a step began) carries its earlier partial run as its
    draft. Beside a long request no draft covers, the makespan plan would give it no draft
    tokens (it ends before that request whatever it drafts), so it would generate its 120
    tokens again one a pass; the paying rule lets it verify them many a pass."""
    lengths, cover, predicted = [400, 300], [0, 120], [400.0, 0.0]
    job = Batch(lengths, makespan=True, cover=cover, predicted=predicted, jobs=[False, True])
    request = Batch(lengths, makespan=True, cover=cover, predicted=predicted, jobs=[False, False])
    job.run(), request.run()
    assert request.caught_up["r1"] >= 100  # as a request: about one token a pass
    assert job.caught_up["r1"] <= 40, job.caught_up
    assert job.generated == request.generated == dict(zip(job.answers, lengths))
    assert job.passes == request.passes == 400  # the undrafted request ends the batch either way
