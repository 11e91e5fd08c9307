"""``bench/sim/ceiling.py``: the makespan bound no draft planner can beat under the models."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bubblespec.bench.sim.ceiling import _context_floor, _fractional_makespan, best_rate, step_ceiling, work_floor
from bubblespec.bench.sim.costs import GPU_H100_7B, GPU_H100_7B_CONTEXT, GPU_H100_7B_FLASH
from bubblespec.bench.sim.simulator import SimSettings, simulate
from bubblespec.bench.sim.workload import AcceptanceModel, LengthModel, Workload

ACCEPT = AcceptanceModel()


@pytest.mark.parametrize("policy,drafting", [("queue", True), ("static", True), ("longest-first", True), ("queue", False)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("profile", [GPU_H100_7B, GPU_H100_7B_CONTEXT, GPU_H100_7B_FLASH], ids=lambda p: p.name)
def test_no_simulated_step_ends_before_the_bound(policy, drafting, seed, profile):
    workload = Workload(lengths=LengthModel(median_tokens=120, max_tokens=1024))
    r = simulate(policy, 8, 256, 3, profile, drafting, seed, workload=workload, acceptance=ACCEPT,
                 settings=SimSettings(capacity=32, samples=4))
    for step, s in enumerate(r.steps):
        c = step_ceiling(workload, ACCEPT, profile, seed, step, 64, 4, drafts=0, workers=8)
        assert s.makespan_seconds >= c.floor_seconds * (1 - 1e-9), (step, s.makespan_seconds, c)
        assert s.makespan_seconds >= c.work_floor_seconds * (1 - 1e-9), (step, s.makespan_seconds, c)
        if not drafting:  # without drafts the floor is the longest response at one token per pass
            assert s.makespan_seconds >= c.no_draft_floor_seconds * (1 - 1e-9)
            assert s.makespan_seconds >= c.no_draft_work_floor_seconds * (1 - 1e-9)


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


def test_a_context_aware_floor_is_the_sum_of_its_passes_and_above_the_context_blind_one():
    length, prompt = 3000, 512
    p = GPU_H100_7B_CONTEXT
    exact = sum(p.step_seconds(1, context_tokens=prompt + i) for i in range(length))
    assert _context_floor(length, 0.0, 0.0, 0.0, prompt, p, 32) == pytest.approx(exact, rel=1e-4)
    drafted = _context_floor(length, length, 0.7, 0.0, prompt, p, 32)
    assert drafted < exact  # drafts that cover it pay, deepest where the context is longest
    assert drafted >= length / best_rate(0.7, p, 32)  # the same drafts at no context cost less


def test_an_unreachable_target_says_so():
    workload = Workload(lengths=LengthModel(median_tokens=200, max_tokens=2048))
    assert step_ceiling(workload, ACCEPT, GPU_H100_7B, 0, 1, 64, 4, drafts=0, target=1000.0).suffix_needed is None


def _best_integral(levels: list[float], work: list[float], workers: int) -> float:
    """The least makespan over every assignment of whole requests (brute force)."""
    best = float("inf")
    for owner in itertools.product(range(workers), repeat=len(levels)):
        loads = [max((lv for lv, o in zip(levels, owner) if o == w), default=0.0)
                 + sum(u for u, o in zip(work, owner) if o == w) for w in range(workers)]
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_work_relaxation_never_exceeds_the_best_assignment_of_whole_requests(seed):
    rng = np.random.default_rng(seed)
    levels, work = rng.uniform(0, 10, 6), rng.uniform(0, 4, 6)
    for workers in (1, 2, 3):
        bound = _fractional_makespan(levels, work, workers)
        best = _best_integral(levels.tolist(), work.tolist(), workers)
        assert bound <= best * (1 + 1e-4)
        assert bound >= max(levels.max(), work.sum() / workers) * (1 - 1e-9)
        if workers == 1:  # one worker runs everything: its longest request's passes and all the work
            assert bound == pytest.approx(levels.max() + work.sum(), rel=2e-4)


def test_long_requests_share_a_worker_where_that_leaves_room_for_the_rest():
    # two long requests (level 10, work 1 each) and eight short ones (level 0.5, work 1) on two
    # workers: the long ones together take 10 + 1 + 1 = 12 and the short ones 0.5 + 8 = 8.5 on the
    # other; a long one on each worker would take at least 10 + 1 + 4 = 15
    levels, work = np.array([10.0, 10.0] + [0.5] * 8), np.ones(10)
    assert _best_integral(levels.tolist(), work.tolist(), 2) == 12.0
    assert _fractional_makespan(levels, work, 2) == pytest.approx(12.0, rel=2e-4)


def test_the_work_floor_counts_what_a_worker_runs_beside_its_longest_request():
    p = GPU_H100_7B
    lengths, alone = np.array([1000.0] * 64), 1000 * p.step_seconds(1) + p.prefill_seconds(16)
    one = work_floor(lengths, np.zeros(64), np.zeros(64), 16, p, 32, workers=64)
    assert one == pytest.approx(alone, rel=1e-3)  # a request per worker: each alone
    eight = work_floor(lengths, np.zeros(64), np.zeros(64), 16, p, 32, workers=8)
    assert eight == pytest.approx(1000 * p.step_seconds(8) + 8 * p.prefill_seconds(16), rel=1e-3)
    drafted = work_floor(lengths, lengths, np.full(64, 0.7), 16, p, 32, workers=8)
    assert drafted < eight  # drafts cut the passes and the per-sequence work
