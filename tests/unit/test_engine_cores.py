"""``EngineSettings.cpu_cores``: the cores a CPU engine's model runs on, checked when the settings
are made (a clear error naming the field) and before any engine process exists."""

from __future__ import annotations

import os

import pytest

from bubblespec.worker.engine import EngineSettings, VllmEngine, cpu_core_ids


@pytest.mark.parametrize(("text", "ids"), [("", ()), ("1", (1,)), ("0-3", (0, 1, 2, 3)), ("0,2", (0, 2)),
                                           (" 4 , 0-1 ", (4, 0, 1)), ("7-7", (7,))])
def test_core_lists_read_as_vllm_writes_them(text, ids):
    assert cpu_core_ids(text) == ids
    assert EngineSettings(cpu_cores=text).cpu_cores == text


@pytest.mark.parametrize("text", ["a", "-1", "1-", "3-1", "0,,x", "1.5", "0-2,1", "0|1"])
def test_a_bad_core_list_is_refused_naming_the_field(text):
    with pytest.raises(ValueError, match="cpu_cores"):
        EngineSettings(cpu_cores=text)


def test_tensor_parallel_workers_get_a_core_list_each_as_vllm_reads_them():
    assert EngineSettings(cpu_cores="0-1|2-3", tensor_parallel_size=2).cpu_cores == "0-1|2-3"
    for text, tp in (("0-1|2-3", 1), ("0-3", 2), ("0|1|2", 2), ("0-1|1-2", 2)):
        with pytest.raises(ValueError, match="cpu_cores"):
            EngineSettings(cpu_cores=text, tensor_parallel_size=tp)


async def test_a_core_this_process_cannot_use_fails_the_start_before_any_engine_process(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    from bubblespec.worker import engine

    built = []
    monkeypatch.setattr(engine, "_build_engine", lambda args, in_core: built.append(args))
    missing = max(os.sched_getaffinity(0)) + 1
    e = VllmEngine(EngineSettings(model=str(tmp_path / "model"), num_speculative_tokens=0, cpu_cores=f"0,{missing}"))
    with pytest.raises(ValueError, match=rf"cpu_cores: core\(s\) \[{missing}\] are not available"):
        await e.start()
    assert built == []


@pytest.mark.parametrize(("flag", "value", "field"), [("--cpu-cores", "3-1", "cpu_cores"),
                                                      ("--logprobs-mode", "bogus", "logprobs_mode"),
                                                      ("--draft-token-seconds", "-1", "draft_token_seconds"),
                                                      ("--draft-token-budget", "0", "draft_token_budget")])
def test_a_bad_engine_flag_ends_the_command_with_the_setting_named(flag, value, field, monkeypatch):
    """No engine, no scheduler dialled: the command ends before either, with one line naming the setting."""
    from bubblespec.cli import main as cli
    from bubblespec.worker import agent

    monkeypatch.setattr(agent.WorkerAgent, "__init__", lambda *a, **k: pytest.fail("a worker was built"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["worker", "--scheduler", "127.0.0.1:9", flag, value])
    assert str(exc.value).startswith(f"bubblespec: bad engine flag: {field}:")


def test_the_draft_token_budget_flag_reaches_the_engine_settings():
    from bubblespec.cli.commands import _engine_settings
    from bubblespec.cli.main import build_parser

    args = build_parser().parse_args(["worker", "--scheduler", "127.0.0.1:9", "--draft-token-budget", "1024"])
    assert _engine_settings(args).draft_token_budget == 1024
    assert _engine_settings(build_parser().parse_args(["worker"])).draft_token_budget == EngineSettings().draft_token_budget
