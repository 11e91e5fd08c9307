"""The real worker's draft length by cost: ``DraftLength`` with ``draft_token_seconds`` follows
the shared paying rule (``common.rules.paying_draft_tokens``) against the batch's tokens/s that the
proposer measures (``StepRate``); unset, it decides exactly as the acceptance rule did. The
proposer runs here on a fake model runner and a fake clock (no vLLM)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from bubblespec.cli.commands import _engine_settings
from bubblespec.cli.main import build_parser
from bubblespec.worker.draft_index import DraftLength, RequestDrafter, StepRate, SuffixRule
from bubblespec.worker.engine import EngineSettings
from bubblespec.worker.proposer import BubbleSpecProposer

CPU_TINY_DRAFT_TOKEN = 6.24e-5  # a draft token of the bench's model, by the 2026-11-22 calibration (bench/sim/costs.py)


def _acceptance_rule(rule: DraftLength, accept: float, steps: int, cap: int) -> int:
    """The acceptance rule as it stood before the paying rule existed (a copy, to compare with)."""
    if cap <= 0:
        return 0
    if accept < rule.min_accept_prob:
        return 1 if steps % rule.probe_every == 0 else 0
    if accept >= 0.999:
        return cap
    return max(1, min(cap, int(math.log(rule.min_accept_prob) / math.log(accept))))


# --- the rule -----------------------------------------------------------------------------------


def test_a_compute_bound_batch_drafts_nothing_where_the_acceptance_rule_drafted() -> None:
    old, paying = DraftLength(max_tokens=8), DraftLength(max_tokens=8, draft_token_seconds=5e-4)
    cap = paying.batch_cap(32)  # 256 // 32 = 8
    # a pass over 32 requests making 1,600 tokens/s: bar = 5e-4 x 1600 = 0.8
    for accept in (0.5, 0.7, 0.79):
        assert old.for_request(accept, 1, cap) > 0
        assert paying.for_request(accept, 1, cap, tokens_per_second=1600.0) == 0
    assert paying.for_request(0.9, 1, cap, tokens_per_second=1600.0) == 2  # 0.9**2 = 0.81 > 0.8 > 0.9**3
    # bar >= 1: not even a surely accepted token pays, so no collapse probe either
    assert paying.for_request(0.999, 8, cap, tokens_per_second=4000.0) == 0
    assert paying.for_request(0.1, 8, cap, tokens_per_second=4000.0) == 0


def test_a_memory_bound_batch_drafts_deep_up_to_the_caps() -> None:
    rule = DraftLength(max_tokens=32, draft_token_seconds=CPU_TINY_DRAFT_TOKEN)
    # one request, ~5 ms a pass, ~4 tokens a pass: 800 tokens/s, bar 0.05
    assert _acceptance_rule(rule, 0.9, 1, rule.batch_cap(1)) == 11  # 0.9**11 >= 0.3
    assert rule.for_request(0.9, 1, rule.batch_cap(1), tokens_per_second=800.0) == 28  # 0.9**28 > 0.05
    assert rule.for_request(0.95, 1, rule.batch_cap(1), tokens_per_second=800.0) == 32  # max_tokens
    assert rule.for_request(0.95, 1, rule.batch_cap(64), tokens_per_second=800.0) == 4  # token_budget // 64


def test_a_collapsed_request_still_probes_where_a_draft_could_pay() -> None:
    rule = DraftLength(max_tokens=8, draft_token_seconds=5e-4)
    assert rule.for_request(0.1, 1, 8, tokens_per_second=600.0) == 0  # bar 0.3 > 0.1: nothing pays
    assert rule.for_request(0.1, 8, 8, tokens_per_second=600.0) == 1  # ... but the probe every 8 steps
    assert rule.for_request(0.1, 8, 8, tokens_per_second=20.0) == 1  # bar 0.01: 0.1 > bar > 0.1**2


def test_without_a_cost_or_a_rate_the_decisions_are_the_acceptance_rules() -> None:
    unset, costed = DraftLength(), DraftLength(draft_token_seconds=1e-3)
    for batch in (1, 16, 32, 64, 100, 300):
        cap = unset.batch_cap(batch)
        for accept in (0.05, 0.2, 0.3, 0.45, 0.7, 0.9, 0.9995):
            for steps in (1, 7, 8, 16):
                want = _acceptance_rule(unset, accept, steps, cap)
                assert unset.for_request(accept, steps, cap) == want
                assert unset.for_request(accept, steps, cap, tokens_per_second=5000.0) == want  # no cost: rate ignored
                assert costed.for_request(accept, steps, cap, tokens_per_second=0.0) == want  # no rate yet


@pytest.mark.parametrize("bad", [-1e-5, math.nan, math.inf])
def test_a_bad_draft_token_cost_is_refused_naming_the_field(bad: float) -> None:
    with pytest.raises(ValueError, match="draft_token_seconds"):
        DraftLength(draft_token_seconds=bad)
    with pytest.raises(ValueError, match="draft_token_seconds"):
        EngineSettings(draft_token_seconds=bad)
    with pytest.raises(ValueError, match="drafted_request_seconds"):
        DraftLength(drafted_request_seconds=bad)


def test_the_rules_length_pays_for_the_drafted_request_too() -> None:
    # 1,000 tokens/s, 1e-4 s a draft token (bar 0.1): acceptance 0.5 drafts 3 and nets 0.575 tokens
    free, costly = DraftLength(draft_token_seconds=1e-4), DraftLength(draft_token_seconds=1e-4, drafted_request_seconds=6e-4)
    assert free.for_request(0.5, 1, 8, tokens_per_second=1000.0) == 3
    assert costly.for_request(0.5, 1, 8, tokens_per_second=1000.0) == 0  # 0.6 tokens of the batch's time
    assert costly.for_request(0.9, 1, 8, tokens_per_second=1000.0) == 8  # nets 4.9 tokens


# --- the measured rate ---------------------------------------------------------------------------


def test_the_rate_counts_continuous_steps_only_and_smooths_them() -> None:
    rate = StepRate(ema=0.5)
    rate.observe(10, now=100.0, continued=False)
    assert rate.tokens_per_second() == 0.0  # nothing measured before a second step
    rate.observe(10, now=100.01, continued=True)
    assert rate.tokens_per_second() == pytest.approx(1000.0)
    rate.observe(30, now=160.0, continued=False)  # a new batch after an idle minute: not a step's time
    assert rate.tokens_per_second() == pytest.approx(1000.0)
    rate.observe(30, now=160.01, continued=True)  # (10+30)/2 tokens over 10 ms
    assert rate.tokens_per_second() == pytest.approx(2000.0)


# --- the proposer on a fake runner ----------------------------------------------------------------


class FakeEngine:
    """``n`` requests with distinct prompts, each with a perfect ``future`` draft; every step
    accepts the whole draft and takes ``pass_seconds + draft_token_seconds x drafted``."""

    def __init__(self, n: int, k: int, pass_seconds: float, draft_token_seconds: float | None, cost: float = 0.0,
                 measure: bool = False, answer_len: int = 600, between_per_draft: float = 0.0):
        extra: dict = {"cpu_sampler_fix": False, "measure_draft_cost": measure}
        if draft_token_seconds is not None:
            extra["draft_token_seconds"] = draft_token_seconds
        config = SimpleNamespace(additional_config={"bubblespec": extra},
                                 speculative_config=SimpleNamespace(num_speculative_tokens=k),
                                 model_config=SimpleNamespace(get_vocab_size=lambda: 1000),
                                 device_config=SimpleNamespace(device=SimpleNamespace(type="cpu")))
        self.proposer = BubbleSpecProposer(config)
        self.now = 0.0
        self.proposer.clock = lambda: self.now
        self.prompts = [(5 + i, 6 + i, 7 + i) for i in range(n)]
        self.answers = [100 + i + np.arange(answer_len, dtype=np.int64) % 600 for i in range(n)]
        requests = {f"r{i}": SimpleNamespace(prompt_token_ids=list(p), sampling_params=SimpleNamespace(extra_args={
            "bubblespec": {"key": f"k{i}", "drafts": [["future", a.astype("<u4").tobytes()]]}}))
            for i, (p, a) in enumerate(zip(self.prompts, self.answers))}
        self.proposer.attach(SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(requests)), requests=requests,
                                             execute_model=lambda: None))
        self.pass_seconds, self.cost, self.between_per_draft = pass_seconds, cost, between_per_draft
        self.generated = [0] * n
        self.drafts: list[list[int]] = [[] for _ in range(n)]

    def step(self) -> list[int]:
        """Run one engine step; return each request's draft length for the next."""
        drafted = sum(map(len, self.drafts))
        self.now += 1e-4 + self.between_per_draft * drafted  # the engine between passes: scheduling, output handling
        self.proposer.runner.execute_model()  # the pass starts (the proposer times it)
        self.now += self.pass_seconds + self.cost * drafted
        sampled = []
        for i, d in enumerate(self.drafts):
            take = len(d) + 1  # every draft token accepted, plus the bonus token
            sampled.append(self.answers[i][self.generated[i]:self.generated[i] + take].tolist())
            self.generated[i] += take
        width = 3 + max(self.generated)
        token_ids = np.zeros((len(self.prompts), width), dtype=np.int64)
        for i, p in enumerate(self.prompts):
            token_ids[i, :3] = p
            token_ids[i, 3:3 + self.generated[i]] = self.answers[i][:self.generated[i]]
        lengths = np.array([3 + g for g in self.generated])
        self.drafts = self.proposer.propose(sampled, lengths, token_ids)
        return [len(d) for d in self.drafts]


def test_the_proposer_stops_drafting_in_a_compute_bound_batch() -> None:
    # 32 requests, 20 ms a pass; a draft token costs 1 ms: the bar stays > 1, nothing can pay
    paying = FakeEngine(32, 8, 0.02, 1e-3, cost=1e-3)
    old = FakeEngine(32, 8, 0.02, None, cost=1e-3)
    assert paying.step() == old.step() == [3] * 32  # no rate measured yet: the acceptance rule (prior 0.7)
    for _ in range(10):
        assert paying.step() == [0] * 32
        assert min(old.step()) > 0
    assert 1e-3 * paying.proposer.rate.tokens_per_second() > 1  # the bar, on its way to 1e-3 x 32 / 0.02 = 1.6


def test_the_proposer_drafts_deep_on_a_memory_bound_engine() -> None:
    # one request, 5 ms a pass, a draft token 62 us (cpu-tiny, 2026-11-22): drafts reach num_speculative_tokens
    paying = FakeEngine(1, 32, 0.005, CPU_TINY_DRAFT_TOKEN, cost=CPU_TINY_DRAFT_TOKEN)
    old = FakeEngine(1, 32, 0.005, None, cost=CPU_TINY_DRAFT_TOKEN)
    lengths = [(paying.step()[0], old.step()[0]) for _ in range(6)]
    assert lengths[0] == (3, 3)
    assert all(new > was for new, was in lengths[1:]), lengths
    assert lengths[-1][0] == 32


def test_an_unset_cost_leaves_the_proposer_unchanged() -> None:
    unset = FakeEngine(4, 8, 0.01, None)
    zero = FakeEngine(4, 8, 0.01, 0.0)
    rule = DraftLength(max_tokens=8)
    for _ in range(12):
        assert unset.step() == zero.step()
    assert unset.proposer.rule == rule and zero.proposer.rule == rule
    assert unset.proposer.rate.tokens_per_second() == 0.0  # not even measured


def test_the_cost_reaches_the_engine_from_the_flag_and_the_environment(monkeypatch) -> None:
    assert _engine_settings(build_parser().parse_args(["worker"])).draft_token_seconds == 0.0
    s = _engine_settings(build_parser().parse_args(["worker", "--draft-token-seconds", "6.24e-5"]))
    assert s.draft_token_seconds == 6.24e-5
    monkeypatch.setenv("BUBBLESPEC_DRAFT_TOKEN_SECONDS", "1e-4")
    assert _engine_settings(build_parser().parse_args(["worker"])).draft_token_seconds == 1e-4


def test_the_bench_drafts_by_the_calibrated_cost_of_its_own_model_unless_told_otherwise() -> None:
    from bubblespec.bench.sim.costs import CPU_TINY

    assert build_parser().parse_args(["bench"]).draft_token_seconds == CPU_TINY.per_draft_token_seconds
    assert build_parser().parse_args(["bench", "--draft-token-seconds", "0"]).draft_token_seconds == 0.0
    for command in ("worker", "up", "demo"):  # a model of unknown cost: by acceptance only
        assert build_parser().parse_args([command]).draft_token_seconds == 0.0, command


def test_self_suffix_drafts_follow_the_paying_rule_too() -> None:
    rule = DraftLength(max_tokens=8, draft_token_seconds=1e-3)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    cheap = RequestDrafter([], rule, suffix=SuffixRule(), prompt_tokens=prompt)
    dear = RequestDrafter([], rule, suffix=SuffixRule(), prompt_tokens=prompt)
    assert cheap.propose(np.array([3], dtype=np.int64), cap=8, tokens_per_second=10.0)  # bar 0.01
    assert dear.propose(np.array([3], dtype=np.int64), cap=8, tokens_per_second=2000.0) == []  # bar 2
