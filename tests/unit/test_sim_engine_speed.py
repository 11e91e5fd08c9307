"""The simulator's shortcuts give what the code they stand for gives, to the last bit.

The engines' re-planning takes the paying rule's log(threshold) once per re-plan instead of
once per member, looks the draft cap up in a table, and the simulator builds completions
without their dataclass ``__init__``. Each must give exactly what the plain call gives
(``tests/unit/test_sim_golden_figures.py`` holds whole runs to the last bit; these pin the
pieces, where a drift would show first).
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from dataclasses import replace

import pytest

from bubblespec.bench.sim.costs import GPU_H100_7B, GPU_H100_7B_FLASH
from bubblespec.bench.sim.engine import Member, SimulatedEngine, _cap_table
from bubblespec.bench.sim.simulator import _frozen
from bubblespec.bench.sim.workload import AcceptanceModel
from bubblespec.common.rules import paying_draft_tokens
from bubblespec.common.types import Completion, FinishReason, Provenance, SourceStats

ALPHAS = [0.0, 1e-9, 0.05, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999999]
THRESHOLDS = [1e-300, 1e-6, 0.001, 0.01, 0.05, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 0.999999]


def _engine(alphas: list[float]) -> tuple[SimulatedEngine, list[Member]]:
    e = SimulatedEngine("w", GPU_H100_7B, AcceptanceModel())
    members = [Member(f"r{i}", 100_000, draft_len=100_000.0, source="future", alpha=a) for i, a in enumerate(alphas)]
    for m in members:
        e.add(0.0, m)
    e.commit(0.0)
    return e, members


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("cap", [1, 2, 5, 8, 32])
def test_replanning_takes_the_paying_rules_draft_length(threshold, cap):
    e, members = _engine(ALPHAS)
    e.threshold = threshold
    e._rerate(cap)
    assert [m.k for m in members] == [paying_draft_tokens(a, cap, threshold, 1.0) for a in ALPHAS]


@pytest.mark.parametrize("threshold", [1e-6, 0.01, 0.05, 0.1, 0.3, 0.5])
def test_replanning_charges_a_drafted_members_own_cost_as_the_rule_does(threshold):
    # gpu-h100-7b-flash: a drafted sequence costs 28.2 us beside 15.5 us a draft token (1.8 tokens' bar)
    e = SimulatedEngine("w", GPU_H100_7B_FLASH, AcceptanceModel())
    members = [Member(f"r{i}", 100_000, draft_len=100_000.0, source="future", alpha=a) for i, a in enumerate(ALPHAS)]
    for m in members:
        e.add(0.0, m)
    e.commit(0.0)
    e.threshold = threshold
    e._rerate(8)
    row_bar = threshold * GPU_H100_7B_FLASH.per_drafted_seq_seconds / GPU_H100_7B_FLASH.per_draft_token_seconds
    want = [paying_draft_tokens(a, 8, threshold, 1.0, row_bar) for a in ALPHAS]
    assert [m.k for m in members] == want
    assert e.drafting == sum(1 for k in want if k) and e.draft_tokens == sum(want)
    # the rows' cost turned some members off that the tokens' bar alone would draft
    assert any(k == 0 < paying_draft_tokens(a, 8, threshold, 1.0) for a, k in zip(ALPHAS, want)) == (threshold >= 0.3)


@pytest.mark.parametrize("threshold", [0.0, -1.0, 1.0, 2.0, float("inf")])
def test_replanning_outside_the_usual_range_calls_the_rule_itself(threshold):
    e, members = _engine(ALPHAS)
    e.threshold = threshold
    e._rerate(8)
    assert [m.k for m in members] == [paying_draft_tokens(a, 8, threshold, 1.0) for a in ALPHAS]


def test_replanning_with_the_fixed_rule_is_the_fixed_rule():
    acceptance = replace(AcceptanceModel(), paying=False, max_draft_tokens=8)
    e = SimulatedEngine("w", GPU_H100_7B, acceptance)
    members = [Member(f"r{i}", 100_000, draft_len=100_000.0, source="future", alpha=a) for i, a in enumerate(ALPHAS)]
    for m in members:
        e.add(0.0, m)
    e.commit(0.0)
    e._rerate(3)
    assert [m.k for m in members] == [acceptance.draft_tokens(a, 3, e.threshold) for a in ALPHAS]


def test_the_cap_table_is_batch_cap():
    for acceptance in (AcceptanceModel(), replace(AcceptanceModel(), max_draft_tokens=7, token_budget=100)):
        assert _cap_table(acceptance) == [acceptance.batch_cap(b) for b in range(1025)]


def test_replanning_drops_stale_heap_entries_and_keeps_the_order():
    e, members = _engine([0.6 + 0.003 * i for i in range(64)])
    for cap in itertools.islice(itertools.cycle([1, 2, 3, 4]), 12):
        e.threshold = 0.01 * cap
        e._rerate(cap)
    live = sorted((t, s) for t, s, g, m in e._heap if m.gen == g)
    assert len(e._heap) <= 2 * len(e.members) + 32  # the stale ones went
    assert len(live) == len(members)  # one live entry per member, none lost
    assert {m.key for t, s, g, m in e._heap if m.gen == g} == {m.key for m in members}


def test_frozen_builds_the_constructors_object():
    prov = Provenance(12, (SourceStats("future", 30, 18),))
    fields = dict(step_id="s1", prompt_id="p3", sample_index=2, token_ids=(1, 2, 3), logprobs=(), text="",
                  finish_reason=FinishReason.STOP, policy_version=4, worker_id="w7", prompt_tokens=512, provenance=prov,
                  version_spans=((0, 3), (2, 4)), stop_reason=None, top_logprobs=(), prompt_logprobs=(),
                  adapter="math", adapter_version=2)
    built = _frozen(Completion, fields)
    assert built == Completion(**fields)
    assert built.__dict__ == Completion(**fields).__dict__
    # every field given: a field added to the type later must be given here too
    assert list(built.__dict__) == [f.name for f in dataclasses.fields(Completion)]
    stats = _frozen(SourceStats, {"source": "future", "drafted_tokens": 30, "accepted_tokens": 18})
    assert stats == SourceStats("future", 30, 18)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.text = "x"  # type: ignore[misc]


def _describe(o: object) -> str:
    """A cyclic object, named enough to find who made it."""
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_filename}:{o.f_lineno} {o.f_code.co_name}"
    if isinstance(o, types.FunctionType):
        return f"function {o.__module__}.{o.__qualname__}"
    if isinstance(o, dict):
        return f"dict keys {list(o)[:6]}"
    if isinstance(o, BaseException):
        return f"{type(o).__name__}: {o!s:.120}"
    return f"{type(o).__module__}.{type(o).__qualname__}"


def test_a_run_leaves_no_cyclic_garbage():
    """The core and its collaborators refer to each other; a finished run breaks those cycles
    (``_Simulation.close``), so its objects are freed when it ends instead of waiting for a full
    collection that walks every live object (seconds at 4,096 workers, inside a later run).

    Only the run's own objects count. After the whole unit suite, a ``SchedulerCore`` left by an
    earlier test (``test_control_routes.make_app``'s) survived the collection before the run
    with no referrer among the objects gc tracks, and turned up as cyclic garbage after it (its
    50 objects named by the message below); so every object alive before the run is held for
    its length and left out."""
    import gc

    from bubblespec.bench.sim.simulator import simulate

    gc.collect()
    was = gc.isenabled()
    gc.disable()  # no automatic collection may take the garbage away before the count below
    before = gc.get_objects()  # held: none of them is freed, or its id reused, during the run
    try:
        r = simulate("queue", 8, 512, 2, GPU_H100_7B, True, 0)
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage, to be named below
        gc.collect()
        old = {id(o) for o in before}
        garbage = [_describe(o) for o in gc.garbage if id(o) not in old]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        del before
        if was:
            gc.enable()
    assert not garbage, f"{len(garbage)} objects of the run in reference cycles after it: {garbage[:60]}"
    assert len(r.steps) == 2 and r.steps[-1].delivered == 512  # the results outlive the run's state
