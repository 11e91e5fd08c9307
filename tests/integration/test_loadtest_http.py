"""``bubblespec loadtest --http`` end to end, small: the real scheduler process, real
redis-server, simulated-engine workers and HTTP clients in processes of their own, calling
``/v1/completions``. No vLLM here: the engine is the simulated one."""

from __future__ import annotations

import math
import shutil

import pytest
from bubblespec.cli.loadtest import LoadSettings
from bubblespec.cli.loadtest_http import (
    HTTP_ENGINE,
    failed,
    http_settings,
    run_http_loadtest,
    summary_text,
)


def test_http_defaults_apply_only_where_no_flag_or_variable_sets_them():
    base = LoadSettings(connections=4096, workers=64, http=True)
    s = http_settings(base, ["loadtest", "--http"], {})
    assert s.capacity == 64 and s.step_seconds == HTTP_ENGINE["step_seconds"]
    assert s.max_tokens == HTTP_ENGINE["max_tokens"] and s.median_tokens == HTTP_ENGINE["median_tokens"]
    s = http_settings(LoadSettings(capacity=8, max_tokens=256, http=True),
                      ["--capacity", "8", "--max-tokens=256"], {"BUBBLESPEC_STEP_SECONDS": "0.02"})
    assert (s.capacity, s.max_tokens, s.step_seconds) == (8, 256, 0.02)
    assert s.median_tokens == HTTP_ENGINE["median_tokens"]


@pytest.mark.timeout(90)
async def test_small_http_loadtest_answers_every_call_once():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    settings = http_settings(LoadSettings(http=True, workers=4, connections=64, rounds=3, choices=2,
                                          worker_processes=2, client_processes=2), [], {})
    result = await run_http_loadtest(settings)
    assert [r.round for r in result.steps] == [1, 2, 3]
    for r in result.steps:
        assert (r.calls, r.answered, r.completions) == (64, 64, 128)
        assert (r.lost, r.misrouted, r.duplicates, r.refused_429) == (0, 0, 0, 0)
        assert r.statuses == {"200": 64} and r.worker_completions_sent == 128 and r.engine_reruns == 0
        assert r.completions_per_second > 0 and r.seconds > 0
        assert 0 < r.engine_p50_ms <= r.call_p50_ms <= r.call_p99_ms
        assert 0 < r.added_p50_ms <= r.added_p99_ms < r.call_p99_ms
        assert r.scheduler_rss_mib > 10 and r.scheduler_rss_peak_mib >= r.scheduler_rss_mib * 0.9
        assert r.scheduler_cpu_share > 0 and r.scheduler_cpu_ms_per_completion > 0
        assert r.clients_cpu_share > 0 and r.workers_cpu_share > 0  # clients and agents in processes of their own
        assert r.core_probe_ms > 0
    s = result.summary
    assert s["calls"] == s["calls_expected"] == s["answered"] == 192
    assert s["completions"] == s["completions_expected"] == s["metrics_completions_total"] == 384
    assert s["worker_completions_sent"] == 384 and s["statuses"] == {"200": 192}
    assert not failed(s)
    for name in ("call", "engine", "added", "to_engine", "from_engine"):
        assert 0 < s[f"{name}_p50_ms"] <= s[f"{name}_p99_ms"], name
    assert s["added_p50_ms"] < s["call_p50_ms"]
    assert s["completions_per_second"] > 0 and s["scheduler_cpu_ms_per_completion"] > 0
    assert s["memory"]["verdict"].startswith("n/a") and math.isnan(s["memory"]["growth_mib"])  # 3 rounds < 10
    assert s["reference_ms"] > 0 and s["core_probe_ms"] > 0
    text = summary_text(result)
    assert "192 answered 200 with the right choices, 0 lost" in text
    assert "completions: 384 of 384" in text and "after round 1" in text
