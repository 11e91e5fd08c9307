"""The paying draft-length rule (``common.rules.paying_draft_tokens``): drafting turns
itself off where a draft token costs more than it saves and goes deep where a pass is
memory-bound; and the simulator's engines, which model the worker's proposer, follow it."""

from __future__ import annotations

from bubblespec.bench.sim.costs import GPU_H100_7B, CostProfile
from bubblespec.bench.sim.engine import Member, SimulatedEngine
from bubblespec.bench.sim.simulator import SimSettings, simulate
from bubblespec.bench.sim.workload import AcceptanceModel, LengthModel, Workload
from bubblespec.common.rules import paying_draft_tokens
from bubblespec.scheduler.core.settings import CoreSettings

# a verify-heavy engine: one draft token costs as much as a whole decode step at batch 1
COMPUTE_BOUND = CostProfile("compute-bound", base_seconds=2e-3, per_seq_seconds=1e-4, per_draft_token_seconds=2e-3,
                            prefill_per_token_seconds=0.0)


def test_a_draft_token_is_proposed_only_while_its_expected_gain_beats_its_cost() -> None:
    # bar = cost of a draft token x the batch's tokens/s; the j-th token pays while accept**j > bar
    assert paying_draft_tokens(0.7, 32, 5e-6, 250.0) == 18  # 0.7**18 = 0.0016 > 0.00125 > 0.7**19
    assert paying_draft_tokens(0.7, 8, 5e-6, 250.0) == 8  # the cap holds
    assert paying_draft_tokens(0.7, 8, 1e-3, 1000.0) == 0  # bar 1.0: no draft token can pay: off
    assert paying_draft_tokens(0.5, 8, 1e-3, 600.0) == 0  # bar 0.6 > 0.5: off
    assert paying_draft_tokens(0.5, 8, 1e-3, 400.0) == 1  # 0.5 > bar 0.4 > 0.5**2: one
    assert paying_draft_tokens(0.0, 8, 0.0, 0.0) == 0
    assert paying_draft_tokens(0.9, 0, 0.0, 0.0) == 0
    assert paying_draft_tokens(0.9, 6, 0.0, 100.0) == 6  # free draft tokens: the cap


def test_a_lone_request_at_the_tail_drafts_deep_on_a_memory_bound_engine() -> None:
    e = SimulatedEngine("w0", GPU_H100_7B, AcceptanceModel())
    m = Member("r", 4000, draft_len=4000, source="future", alpha=0.7)
    e.add(0.0, m)
    e.commit(0.0)
    fixed = AcceptanceModel(max_draft_tokens=8, paying=False).draft_tokens(0.7, 8)
    assert fixed == 3 and m.k > 8  # the fixed rule's 3; the pass costs 8 ms, a draft token 5 us


def test_a_busy_compute_bound_batch_turns_drafting_off() -> None:
    e = SimulatedEngine("w0", COMPUTE_BOUND, AcceptanceModel())
    members = [Member(f"r{i}", 1000, draft_len=1000, source="future", alpha=0.6) for i in range(32)]
    for m in members:
        e.add(0.0, m)
    e.commit(0.0)
    e.due(1.0)
    e.add(1.0, Member("x", 1000))  # a change of the batch makes it plan again, now from its real throughput
    e.commit(1.0)
    assert all(m.k == 0 for m in members)


def test_a_drafting_arm_is_not_slower_than_its_twin_where_verifying_is_expensive() -> None:
    workload = Workload(lengths=LengthModel(median_tokens=150, max_tokens=1024))

    def makespans(drafting: bool, acceptance: AcceptanceModel, first_step: bool = True) -> list[float]:
        settings = SimSettings(capacity=32, samples=4, core=CoreSettings(draft_beside_first_step=first_step))
        r = simulate("queue", 2, 256, 2, COMPUTE_BOUND, drafting, 0, workload=workload, settings=settings,
                     acceptance=acceptance)
        return [s.summary.makespan_seconds for s in r.steps]

    plain = makespans(False, AcceptanceModel())
    # no draft job beside requests before completions show drafts paying: here they never do
    assert sum(makespans(True, AcceptanceModel(), first_step=False)) <= sum(plain) * 1.001
    # the default runs jobs beside the first step's requests before any evidence: that step pays for them
    first = makespans(True, AcceptanceModel())[0]
    assert plain[0] < first <= plain[0] * 1.08
    # the scenario discriminates: the fixed rule (min_accept_prob alone) drafts there and loses
    assert sum(makespans(True, AcceptanceModel(max_draft_tokens=8, paying=False), first_step=False)) > sum(plain) * 1.05


def test_a_request_drafts_only_where_its_whole_draft_pays_for_its_own_cost_too() -> None:
    # bar 0.1 a token (1e-4 s x 1,000 tokens/s): 0.5 drafts 3 (0.5**3 > 0.1 > 0.5**4), and
    # gains 0.875 - 0.3 = 0.575 tokens net: a row's cost up to 0.575 tokens (5.75e-4 s) is paid
    assert paying_draft_tokens(0.5, 8, 1e-4, 1000.0, 5.7e-4) == 3
    assert paying_draft_tokens(0.5, 8, 1e-4, 1000.0, 5.8e-4) == 0
    # a sure draft: k tokens gain k(1 - bar) net
    assert paying_draft_tokens(1.0, 4, 1e-4, 1000.0, 3.5e-3) == 4
    assert paying_draft_tokens(1.0, 4, 1e-4, 1000.0, 3.7e-3) == 0
    # no row cost: the tokens' rule alone, whatever the acceptance and bar
    for accept in (0.05, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0):
        for rate in (10.0, 300.0, 1000.0, 5000.0):
            assert paying_draft_tokens(accept, 8, 1e-4, rate, 0.0) == paying_draft_tokens(accept, 8, 1e-4, rate)


# cheap draft tokens, dear drafted sequences: each drafted member costs a pass's worth (2 ms)
ROW_BOUND = CostProfile("row-bound", base_seconds=2e-3, per_seq_seconds=1e-4, per_draft_token_seconds=1e-5,
                        prefill_per_token_seconds=0.0, spec_pass_seconds=0.0, per_drafted_seq_seconds=2e-3)


def test_a_drafting_arm_is_not_slower_than_its_twin_where_each_drafted_sequence_is_expensive(monkeypatch) -> None:
    workload = Workload(lengths=LengthModel(median_tokens=150, max_tokens=1024))

    def makespans(drafting: bool) -> list[float]:
        settings = SimSettings(capacity=32, samples=4, core=CoreSettings(draft_beside_first_step=False))
        r = simulate("queue", 2, 256, 2, ROW_BOUND, drafting, 0, workload=workload, settings=settings,
                     acceptance=AcceptanceModel())
        return [s.summary.makespan_seconds for s in r.steps]

    plain = makespans(False)
    assert sum(makespans(True)) <= sum(plain) * 1.001
    # the scenario discriminates: a rule blind to the sequence's own cost drafts there and loses
    init = SimulatedEngine.__init__

    def blind(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._row_ratio = 0.0

    monkeypatch.setattr(SimulatedEngine, "__init__", blind)
    assert sum(makespans(True)) > sum(plain) * 1.05
