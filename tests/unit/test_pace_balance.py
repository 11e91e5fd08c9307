"""Balancing by worker pace (core/balance.py ``pace_factors``, records.py ``Pace``): a worker
whose requests advance slower takes less of a step, with the in-process core and a fake clock."""

from __future__ import annotations

from bubblespec.scheduler.core.balance import PACE_DEAD_BAND, PACE_FACTOR_RANGE, pace_factors
from bubblespec.scheduler.core.records import PACE_MIN_PASSES, Pace
from bubblespec.scheduler.core.status import snapshot
from bubblespec.scheduler.core.types import Assign

from tests.unit.test_balance import prompts_step, split
from tests.unit.test_core import complete, hello, make_core, of


def _paced(wid: str, seconds_per_pass: float, passes: int = 100):
    core, _ = make_core()
    core.add_worker(hello(wid))
    w = core.workers[wid]
    w.pace.record(seconds_per_pass * passes, passes)
    return w


def test_a_pace_counts_only_after_enough_passes():
    pace = Pace()
    pace.record(1.0, int(PACE_MIN_PASSES) - 1)
    assert pace.seconds_per_pass == 0.0
    pace.record(1.0, 10)
    assert pace.seconds_per_pass > 0.0


def test_pace_factors_are_relative_to_the_median_with_a_dead_band_and_bounds():
    ws = [_paced("a", 0.010), _paced("b", 0.010 * (1 + PACE_DEAD_BAND / 2)), _paced("c", 0.010),
          _paced("d", 0.050), _paced("e", 0.001)]
    f = pace_factors(ws)
    assert set(f) == {"d", "e"}  # a, b, c within the band of the median (c's 0.010)
    assert f["d"] == PACE_FACTOR_RANGE[1] and f["e"] == PACE_FACTOR_RANGE[0]
    assert pace_factors(ws[:1]) == {} and pace_factors([]) == {}


def test_a_worker_whose_requests_ran_slower_takes_less_and_not_the_longest_group():
    core, clock = make_core()
    core.add_worker(hello("a", capacity=8))
    core.add_worker(hello("b", capacity=8))
    prompts = [(5, 6 + i) for i in range(8)]
    assigns = of(core.submit_step(prompts_step("s1", prompts)), Assign)
    assert {a.worker_id for a in assigns} == {"a", "b"}
    clock.now = 1.0  # b's requests: 20 passes in 1 s (p0: 100)
    for a in [a for a in assigns if a.worker_id == "b"]:
        complete(core, a, tokens=20 if a.request.prompt_id != "p0" else 100)
    clock.now = 5.0  # a's: 20 passes in 5 s (p0, the long one, 100; wherever it ran)
    for a in [a for a in assigns if a.worker_id == "a"]:
        complete(core, a, tokens=20 if a.request.prompt_id != "p0" else 100)
    assert core.workers["a"].pace.seconds_per_pass > 1.5 * core.workers["b"].pace.seconds_per_pass
    shown = {w["worker_id"]: w["seconds_per_pass"] for w in snapshot(core)["workers"]}
    assert shown["a"] > 1.5 * shown["b"] > 0  # the status page shows each worker's pace
    clock.now = 6.0
    per = split(of(core.submit_step(prompts_step("s2", prompts)), Assign))
    assert "p0" in per["b"]  # the longest predicted response goes to the faster worker
    predicted = {w: sum(100 if p == "p0" else 20 for p in ids) for w, ids in per.items()}
    assert predicted["a"] < predicted["b"]  # by predicted tokens the slower worker holds less
