"""``bench/coverage.py``: the longest response's draft coverage against the passes before its
step, read from a bench report's step rows."""

from __future__ import annotations

import json

import pytest

from bubblespec.bench.coverage import longest_coverage, main, summarize


def _worker(longest: int, passes: int, accepted: int = 0, drafted: int = 0) -> dict:
    return {"requests": 4, "tokens": 4 * longest, "forward_passes": 4 * passes, "longest": longest,
            "longest_forward_passes": passes, "longest_accepted": {"future": accepted} if accepted else {},
            "longest_drafted": {"future": drafted} if drafted else {}, "done_seconds": 0.1}


def _row(run: int, arm: str, step: int, seconds: float, *workers: dict) -> dict:
    return {"run": run, "arm": arm, "step": step, "makespan_seconds": seconds,
            "per_worker": {f"w{i}": w for i, w in enumerate(workers)}}


def _report(lookahead: int = 2) -> dict:
    rows = []
    for step in (1, 2, 3, 4):
        rows.append(_row(0, "baseline", step, 0.4, _worker(100, 100), _worker(150, 150)))
    rows += [
        _row(0, "bubblespec", 1, 0.6, _worker(100, 100), _worker(150, 150)),  # no drafts yet: a slow step
        _row(0, "bubblespec", 2, 0.2, _worker(120, 9, 115, 115), _worker(40, 5, 38, 38)),
        # step 3: longest 200 tokens, drafted in full; 150 + 9 passes before it
        _row(0, "bubblespec", 3, 0.25, _worker(200, 14, 190, 196), _worker(60, 6, 55, 55)),
        # step 4: longest 300, only 60 accepted; 9 + 14 passes before it
        _row(0, "bubblespec", 4, 0.5, _worker(300, 240, 60, 90), _worker(80, 10, 75, 75)),
    ]
    return {"config": {"lookahead_steps": lookahead}, "steps": rows}


def test_each_step_gives_its_longest_response_and_the_passes_of_the_lookahead_steps_before_it():
    rows = longest_coverage(_report())
    assert [(r.step, r.length, r.accepted, r.drafted, r.passes_before) for r in rows] == [
        (3, 200, 190, 196, 150 + 9), (4, 300, 60, 90, 9 + 14)]  # steps 1-2 have no full window
    assert [r.drafted_in_full for r in rows] == [True, False]  # 190 >= 0.9 * 200; 60 < 270
    assert rows[0].speedup == pytest.approx(0.4 / 0.25)
    assert rows[1].speedup == pytest.approx(0.4 / 0.5)


def test_the_window_follows_the_reports_lookahead():
    rows = longest_coverage(_report(lookahead=3))
    assert [(r.step, r.passes_before) for r in rows] == [(4, 150 + 9 + 14)]


def test_the_summary_splits_steps_drafted_in_full_from_the_others(tmp_path, capsys):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report()))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out == summarize(longest_coverage(_report())) + "\n"
    assert "drafted in full :    1 steps, speedup median 1.60x, longest response median 200 tokens, " \
           "passes of the steps before median 159" in out
    assert "partly drafted  :    1 steps, speedup median 0.80x, longest response median 300 tokens, " \
           "passes of the steps before median 23" in out
    assert main([]) == 2
