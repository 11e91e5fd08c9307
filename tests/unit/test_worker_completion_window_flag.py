"""`bubblespec worker --completion-batch-seconds` (and BUBBLESPEC_COMPLETION_BATCH_SECONDS) sets
the agent's completion window, ``WorkerSettings.completion_batch_seconds``."""

from __future__ import annotations

import pytest

from bubblespec.cli.commands import _worker_settings
from bubblespec.cli.main import build_parser
from bubblespec.worker.settings import WorkerSettings


def test_default_is_the_agents_default() -> None:
    s = _worker_settings(build_parser().parse_args(["worker"]))
    assert s.completion_batch_seconds == WorkerSettings().completion_batch_seconds


def test_flag_sets_the_window() -> None:
    s = _worker_settings(build_parser().parse_args(["worker", "--completion-batch-seconds", "0.2",
                                                    "--worker-id", "w7"]))
    assert s.completion_batch_seconds == 0.2
    assert s.worker_id == "w7"


def test_environment_sets_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUBBLESPEC_COMPLETION_BATCH_SECONDS", "0")
    assert _worker_settings(build_parser().parse_args(["worker"])).completion_batch_seconds == 0.0


@pytest.mark.parametrize("value", ["-0.1", "nan"])
def test_negative_or_nan_is_refused_naming_the_flag(value: str) -> None:
    with pytest.raises(ValueError, match="completion-batch-seconds"):
        _worker_settings(build_parser().parse_args(["worker", "--completion-batch-seconds", value]))
