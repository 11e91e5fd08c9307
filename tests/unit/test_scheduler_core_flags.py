"""`bubblespec scheduler` (and `up`) flags for the scheduling core's tunables, with their
BUBBLESPEC_* environment variables: each sets its ``CoreSettings`` field, and a bad count is
refused at start naming the setting (``CoreSettings.__post_init__``)."""

from __future__ import annotations

import pytest

from bubblespec.cli.commands import _scheduler_settings
from bubblespec.cli.main import build_parser
from bubblespec.scheduler.core.settings import CoreSettings


def settings(*argv: str, command: str = "scheduler"):
    return _scheduler_settings(build_parser().parse_args([command, *argv]))


def test_without_flags_the_core_has_its_defaults() -> None:
    assert settings().core == CoreSettings()


def test_each_flag_sets_its_field() -> None:
    core = settings("--spread-samples", "--draft-jobs-beside-requests", "2", "--min-requests-beside-draft-jobs", "8",
                    "--no-draft-beside-first-step", "--min-requests-beside-draft-jobs-at-tail", "3").core
    assert core.spread_samples is True
    assert core.max_draft_jobs_beside_requests == 2
    assert core.min_requests_beside_draft_jobs == 8
    assert core.draft_beside_first_step is False
    assert core.min_requests_beside_draft_jobs_at_tail == 3
    assert core.max_draft_jobs_per_worker == CoreSettings().max_draft_jobs_per_worker  # the rest untouched


def test_up_takes_the_same_flags() -> None:
    assert settings("--spread-samples", "--draft-jobs-beside-requests", "0", command="up").core == CoreSettings(
        spread_samples=True, max_draft_jobs_beside_requests=0)


def test_environment_sets_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUBBLESPEC_SPREAD_SAMPLES", "true")
    monkeypatch.setenv("BUBBLESPEC_DRAFT_JOBS_BESIDE_REQUESTS", "16")
    core = settings().core
    assert core.spread_samples is True and core.max_draft_jobs_beside_requests == 16


@pytest.mark.parametrize(("flag", "field"), [("--draft-jobs-beside-requests", "max_draft_jobs_beside_requests"),
                                             ("--min-requests-beside-draft-jobs", "min_requests_beside_draft_jobs"),
                                             ("--min-requests-beside-draft-jobs-at-tail",
                                              "min_requests_beside_draft_jobs_at_tail")])
def test_a_negative_count_is_refused_naming_the_setting(flag: str, field: str) -> None:
    with pytest.raises(SystemExit, match=f"bad scheduler flag: {field}: must be a whole number >= 0, got -1"):
        settings(flag, "-1")


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_core_settings_refuse_a_count_that_is_not_a_whole_number_at_least_zero(value) -> None:
    with pytest.raises(ValueError, match="max_draft_jobs_per_worker: must be a whole number >= 0"):
        CoreSettings(max_draft_jobs_per_worker=value)


@pytest.mark.parametrize("raw", ["1", "TRUE", "yes", "on", " on "])
def test_a_boolean_variable_reads_the_usual_spellings_of_on(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("BUBBLESPEC_SPREAD_SAMPLES", raw)
    assert settings().core.spread_samples is True


@pytest.mark.parametrize("raw", ["0", "false", "No", "off", ""])
def test_a_boolean_variable_reads_the_usual_spellings_of_off(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("BUBBLESPEC_DRAFT_BESIDE_FIRST_STEP", raw)
    assert settings().core.draft_beside_first_step is False


@pytest.mark.parametrize(("var", "raw", "message"), [
    ("BUBBLESPEC_SPREAD_SAMPLES", "ture", "BUBBLESPEC_SPREAD_SAMPLES='ture' is not a boolean"),
    ("BUBBLESPEC_DRAFT_JOBS_BESIDE_REQUESTS", "four", "BUBBLESPEC_DRAFT_JOBS_BESIDE_REQUESTS='four' is not a valid int"),
    ("BUBBLESPEC_ORPHAN_GRACE_SECONDS", "30s", "BUBBLESPEC_ORPHAN_GRACE_SECONDS='30s' is not a valid float"),
])
def test_a_variable_that_is_not_its_flags_type_ends_the_command_naming_it(
        monkeypatch: pytest.MonkeyPatch, var: str, raw: str, message: str) -> None:
    """Read as off (or as a traceback) it would start a scheduler other than the one asked for."""
    monkeypatch.setenv(var, raw)
    with pytest.raises(SystemExit, match=message):
        build_parser()


def test_no_worker_timeout_flag_and_its_variable_0_waits_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings().core.no_worker_timeout_seconds == 60.0
    assert settings("--no-worker-timeout-seconds", "5").core.no_worker_timeout_seconds == 5.0
    assert settings("--no-worker-timeout-seconds", "0").core.no_worker_timeout_seconds is None
    monkeypatch.setenv("BUBBLESPEC_NO_WORKER_TIMEOUT_SECONDS", "2.5")
    assert settings(command="up").core.no_worker_timeout_seconds == 2.5
    with pytest.raises(SystemExit, match="bad scheduler flag: no_worker_timeout_seconds: must be a finite number > 0"):
        settings("--no-worker-timeout-seconds", "-1")
