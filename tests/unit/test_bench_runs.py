"""``bubblespec bench --runs N``: each run's table, their medians, and exactness over runs."""

from __future__ import annotations

import pytest

from bubblespec.cli.bench import (
    BenchConfig,
    combine_runs,
    core_speed_line,
    draft_cost_line,
    equal_speed_line,
    summarize,
    table_lines,
    time_split_line,
)
from bubblespec.cli.main import main


def _row(arm: str, step: int, makespan: float, run: int = 1) -> dict:
    return {"arm": arm, "step": step, "run": run, "makespan_seconds": makespan, "forward_passes_per_token": 1.0,
            "accepted_per_forward_pass": 0.0, "bubble_share": 0.1, "drafting_worker_seconds": 0.0,
            "busy_worker_seconds": 1.0, "idle_worker_seconds": 0.0,
            "by_source": {"future": {"accepted": 3, "drafted": 4}} if arm == "bubblespec" else {}}


def _run(base: float, fast: float, order: list[str], run: int) -> list[dict]:
    times = {"baseline": base, "queue": base, "static+drafts": base, "bubblespec": fast}
    return [_row(arm, step, times[arm], run) for arm in order for step in (1, 2, 3)]


def test_each_runs_speedup_is_kept_and_the_summary_is_their_median():
    exact = dict.fromkeys(["baseline", "queue", "static+drafts", "bubblespec"], True)
    order = ["baseline", "queue", "static+drafts", "bubblespec"]
    runs = [summarize(_run(10.0, 5.0, order, 1), exact),
            summarize(_run(9.0, 9.0, order[1:] + order[:1], 2), exact),  # rotated: the table keeps ARMS order
            summarize(_run(12.0, 4.0, order[2:] + order[:2], 3), exact)]
    assert [t["arm"] for t in runs[1]] == order
    table = {t["arm"]: t for t in combine_runs(runs)}
    assert table["bubblespec"]["speedup_runs"] == [2.0, 1.0, 3.0]
    assert table["bubblespec"]["speedup_median"] == 2.0
    assert table["bubblespec"]["makespan_seconds_median"] == 5.0
    assert table["bubblespec"]["acceptance_by_source"] == {"future": 0.75}
    assert table["baseline"]["speedup_runs"] == [1.0, 1.0, 1.0]
    assert "total 2.00x  runs 2.00x 1.00x 3.00x" in table_lines(list(table.values()))[-1]


def test_an_arm_inexact_in_any_run_is_inexact():
    order = ["baseline", "queue", "static+drafts", "bubblespec"]
    ok = dict.fromkeys(order, True)
    bad = {**ok, "queue": False}
    table = {t["arm"]: t for t in combine_runs([summarize(_run(10.0, 5.0, order, 1), ok),
                                                summarize(_run(10.0, 5.0, order, 2), bad)])}
    assert table["queue"]["exact"] is False
    assert table["bubblespec"]["exact"] is True


def test_runs_below_one_is_refused_naming_the_flag(capsys):
    with pytest.raises(ValueError, match="runs"):
        BenchConfig(runs=0)
    assert main(["bench", "--runs", "0"]) == 2
    assert "runs must be >= 1" in capsys.readouterr().err


def test_the_draft_cost_line_names_each_engines_figures_and_where_they_came_from() -> None:
    line = draft_cost_line([
        {"draft_token_seconds": 3.1e-5, "drafted_request_seconds": 2.8e-5, "source": "measured", "steps": 900},
        {"draft_token_seconds": 3.0e-5, "drafted_request_seconds": 0.0, "source": "measured", "steps": 850},
        {"draft_token_seconds": 0.0, "drafted_request_seconds": 0.0, "source": "none", "steps": 0},
        {}])
    assert line == ("A draft token's cost, per engine: 3.1e-05 s (+2.8e-05 s a drafted request) measured over 900 passes; "
                    "3e-05 s measured over 850 passes; none yet (none: by acceptance); none yet (no proposer: by acceptance)")


def test_the_core_speed_line_is_each_arms_median_step_of_the_cores_mean() -> None:
    rows = [{"arm": "baseline", "core_probe_ms": {"0": 0.8, "1": 1.0}},
            {"arm": "baseline", "core_probe_ms": {"0": 1.2, "1": 1.4}},
            {"arm": "baseline", "core_probe_ms": {"0": 0.9, "1": None}},  # a step too short for core 1's samples
            {"arm": "queue", "core_probe_ms": {"0": 1.6, "1": 1.6}},
            {"arm": "queue"}]  # no probe in this row
    assert core_speed_line(rows) == ("Core speed while each arm ran (probe ms, lower is faster; bench/machine.py): "
                                     "baseline 0.90, queue 1.60")
    assert core_speed_line([{"arm": "baseline"}]) == ""


def test_the_speedup_at_equal_core_speed_divides_each_steps_makespan_by_its_cores_probe() -> None:
    exact = dict.fromkeys(["baseline", "queue", "static+drafts", "bubblespec"], True)
    order = ["baseline", "queue", "static+drafts", "bubblespec"]
    rows = _run(10.0, 5.0, order, 1)
    for r in rows:  # the baseline ran on cores twice as slow as the others'; queue's step 3 has no probe
        if not (r["arm"] == "queue" and r["step"] == 3):
            r["core_probe_ms"] = {"0": 2.0, "1": 2.0} if r["arm"] == "baseline" else {"0": 0.8, "1": 1.2}
    table = {t["arm"]: t for t in summarize(rows, exact)}
    assert table["queue"]["speedup_median"] == 1.0
    assert table["queue"]["speedup_equal_speed_median"] == pytest.approx(0.5)  # as fast, on cores twice as fast
    assert table["bubblespec"]["speedup_equal_speed_median"] == pytest.approx(1.0)
    assert equal_speed_line(list(table.values())) == (
        "At equal core speed (each step's makespan over its cores' probe figure): "
        "queue 0.50x, static+drafts 0.50x, bubblespec 1.00x")
    # a run without the probe leaves the figure to the runs that had it
    combined = {t["arm"]: t for t in combine_runs([summarize(_run(10.0, 5.0, order, 2), exact), list(table.values())])}
    assert combined["bubblespec"]["speedup_equal_speed_median"] == pytest.approx(1.0)
    assert equal_speed_line(summarize(_run(10.0, 5.0, order, 3), exact)) == ""


def test_differences_name_each_completion_that_parts_from_the_baseline_and_where() -> None:
    from bubblespec.cli.bench import differences

    base = [[(1, 2, 3), (4, 5)], [(6,)]]  # two steps: two completions, then one
    outputs = {(0, "baseline"): base, (0, "queue"): base, (1, "baseline"): base,
               (0, "bubblespec"): [[(1, 2, 3), (4, 9, 9)], [(6,)]],
               (1, "bubblespec"): [[(1, 2, 3), (4, 5)], [(6, 7)]]}
    assert differences(outputs, 2) == [
        {"arm": "bubblespec", "run": 1, "step": 1, "completion": 1, "at": 1, "length": 3, "baseline_length": 2},
        {"arm": "bubblespec", "run": 2, "step": 2, "completion": 0, "at": 1, "length": 2, "baseline_length": 1},
    ]


def _with_tail(row: dict, workers: dict[str, tuple[float, int, int]]) -> dict:
    """``row`` with per-worker (done seconds, longest response, its forward passes)."""
    row["per_worker"] = {w: {"done_seconds": d, "longest": n, "longest_forward_passes": p} for w, (d, n, p) in workers.items()}
    return row


def test_the_tail_splits_an_arms_time_into_fewer_passes_and_longer_ones():
    exact = dict.fromkeys(["baseline", "bubblespec"], True)
    rows = []
    for step in (2, 3):
        # baseline: the last worker (2.0 s) ran its 200-token request in 200 passes: 10 ms a pass
        rows.append(_with_tail(_row("baseline", step, 2.0), {"w0": (1.0, 90, 90), "w1": (2.0, 200, 200)}))
        # drafts: 50 passes for 200 tokens, each 20 ms; the other worker's figures are not the tail's
        rows.append(_with_tail(_row("bubblespec", step, 1.0), {"w0": (1.0, 200, 50), "w1": (0.5, 10, 1)}))
    table = {t["arm"]: t for t in summarize(rows, exact)}
    assert table["baseline"]["tail_passes_per_token"] == 1.0 and table["baseline"]["tail_ms_per_pass"] == pytest.approx(10.0)
    assert table["bubblespec"]["tail_passes_per_token"] == 0.25 and table["bubblespec"]["tail_ms_per_pass"] == pytest.approx(20.0)
    line = time_split_line(list(table.values()))
    assert "baseline 1.00 passes a token at 10.0 ms a pass" in line
    assert "bubblespec 0.25 passes a token (0.25x) at 20.0 ms (2.00x): 0.50x the time" in line
    assert time_split_line(summarize([_row("baseline", 2, 1.0), _row("bubblespec", 2, 1.0)], exact)) == ""  # no figures


def test_total_time_is_the_summed_steps_where_the_median_of_step_ratios_sits_between_alternating_steps():
    """Steps 2 and 4 drafted (4x), 3 and 5 not (0.8x): the median of the four ratios is 2.4x,
    the time over the four steps only 1.2x the baseline's."""
    exact = dict.fromkeys(["baseline", "queue", "static+drafts", "bubblespec"], True)
    times = {2: (2.0, 0.5), 3: (4.0, 5.0), 4: (2.0, 0.5), 5: (4.0, 5.0)}
    rows = [_row("baseline", 1, 3.0), _row("bubblespec", 1, 3.0)]
    rows += [_row("baseline", step, base) for step, (base, _) in times.items()]
    rows += [_row("bubblespec", step, fast) for step, (_, fast) in times.items()]
    table = {t["arm"]: t for t in summarize(rows, exact)}
    assert table["bubblespec"]["speedup_median"] == pytest.approx(2.4)
    assert table["bubblespec"]["speedup_total"] == pytest.approx(12.0 / 11.0)
    assert table["baseline"]["speedup_total"] == pytest.approx(1.0)
    combined = {t["arm"]: t for t in combine_runs([summarize(rows, exact)] * 3)}
    assert combined["bubblespec"]["speedup_total"] == pytest.approx(12.0 / 11.0)
    assert "  total 1.09x  runs 2.40x 2.40x 2.40x" in table_lines(list(combined.values()))[-1]
