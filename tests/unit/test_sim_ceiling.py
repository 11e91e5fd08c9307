"""``bench/sim/ceiling.py``: the makespan bound no draft planner can beat under the models."""

from __future__ import annotations

import pytest

from bubblespec.bench.sim.ceiling import best_rate, step_ceiling
from bubblespec.bench.sim.costs import GPU_H100_7B
from bubblespec.bench.sim.simulator import SimSettings, simulate
from bubblespec.bench.sim.workload import AcceptanceModel, LengthModel, Workload

ACCEPT = AcceptanceModel()


@pytest.mark.parametrize("policy,drafting", [("queue", True), ("static", True), ("longest-first", True), ("queue", False)])
@pytest.mark.parametrize("seed", [0, 1])
def test_no_simulated_step_ends_before_the_bound(policy, drafting, seed):
    workload = Workload(lengths=LengthModel(median_tokens=120, max_tokens=1024))
    r = simulate(policy, 8, 256, 3, GPU_H100_7B, drafting, seed, workload=workload, acceptance=ACCEPT,
                 settings=SimSettings(capacity=32, samples=4))
    for step, s in enumerate(r.steps):
        c = step_ceiling(workload, ACCEPT, GPU_H100_7B, seed, step, 64, 4, drafts=0)
        assert s.makespan_seconds >= c.floor_seconds * (1 - 1e-9), (step, s.makespan_seconds, c)
        if not drafting:  # without drafts the floor is the longest response at one token per pass
            assert s.makespan_seconds >= c.no_draft_floor_seconds * (1 - 1e-9)


def test_more_drafts_never_lower_the_bound_and_lower_the_self_draft_acceptance_needed():
    workload = Workload(lengths=LengthModel(median_tokens=200, max_tokens=2048))
    bounds = [step_ceiling(workload, ACCEPT, GPU_H100_7B, 0, 1, 256, 8, drafts=n) for n in (0, 16, 256)]
    assert bounds[0].speedup <= bounds[1].speedup <= bounds[2].speedup
    assert bounds[2].speedup > bounds[0].speedup  # a prompt's longest of 256 drafts covers more than of 4
    needed = [b.suffix_needed for b in bounds]
    assert all(x is not None for x in needed) and needed[0] >= needed[1] >= needed[2]


def test_when_every_sample_has_the_same_length_drafts_cover_all_of_it():
    workload = Workload(lengths=LengthModel(median_tokens=300, prompt_sigma=0.5, sample_sigma=0.0, max_tokens=4096))
    c = step_ceiling(workload, ACCEPT, GPU_H100_7B, 0, 1, 32, 4, drafts=0)
    name, length, covered, alpha = c.binding
    assert covered == length
    prefill = GPU_H100_7B.prefill_seconds(workload.prompt_tokens)
    # all of it at the best drafted rate (binding's acceptance is rounded to 0.01)
    assert prefill + length / best_rate(alpha + 0.005, GPU_H100_7B, 32) <= c.floor_seconds
    assert c.floor_seconds <= prefill + length / best_rate(alpha - 0.005, GPU_H100_7B, 32)
    assert c.suffix_needed == 0.0 or c.speedup < 1.8


def test_an_unreachable_target_says_so():
    workload = Workload(lengths=LengthModel(median_tokens=200, max_tokens=2048))
    assert step_ceiling(workload, ACCEPT, GPU_H100_7B, 0, 1, 64, 4, drafts=0, target=1000.0).suffix_needed is None
