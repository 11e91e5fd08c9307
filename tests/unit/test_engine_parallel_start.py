"""Two ``VllmEngine``s start at the same time: the engine build (vLLM's config, then ``AsyncLLM``; tens of
seconds per engine: the engine process loads, compiles and profiles the model) runs for both at
once, each from its own long-lived lifeline thread, and each engine's core binding travels in
its own ``Lifeline`` rather than through this process's shared environment.

The engine build (``engine._build_engine``: vLLM's config, then ``AsyncLLM``) is replaced by a
stand-in that waits for the other start (a barrier): starts that ran one after the other would
never meet there.
"""

from __future__ import annotations

import asyncio
import os
import threading
from types import SimpleNamespace

import pytest
from bubblespec.worker import engine
from bubblespec.worker.engine import EngineSettings, VllmEngine


async def test_two_engines_build_at_once_each_with_its_own_core_binding(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    both_building = threading.Barrier(2, timeout=60)
    seen = []

    def build(args, in_core):
        lifeline = args.additional_config["bubblespec_lifeline"]
        seen.append({"method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
                     "bind_here": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                     "bind_there": lifeline.environ, "cpus": lifeline.cpus, "in_core": in_core,
                     "vllm_stats": not args.disable_log_stats,
                     "thread": threading.current_thread().name})
        both_building.wait()  # BrokenBarrierError if the other start cannot begin until this one ends
        return SimpleNamespace(tokenizer=None, errored=False, shutdown=lambda: None,
                               model_config=SimpleNamespace(get_vocab_size=lambda: 128, dtype="torch.float32"),
                               vllm_config=SimpleNamespace(lora_config=None))  # LoRA off, as vLLM's AsyncLLM has it

    monkeypatch.setattr(engine, "_build_engine", build)
    engines = [VllmEngine(EngineSettings(model=str(tmp_path / "model"), num_speculative_tokens=0, cpu_cores=core))
               for core in ("0", "1")]
    await asyncio.gather(*(e.start() for e in engines))
    assert sorted(s["bind_there"]["VLLM_CPU_OMP_THREADS_BIND"] for s in seen) == ["0", "1"]
    assert all(s["in_core"] for s in seen)  # vLLM's CPU platform, one worker: the model runs in the engine core
    assert sorted(s["cpus"] for s in seen) == [(0,), (1,)]  # ...bound there by the lifeline
    assert not any(s["vllm_stats"] for s in seen)  # nothing serves vLLM's own stats here: not recorded
    assert all(s["bind_here"] is None for s in seen)  # nothing per-engine in this process's environment
    assert all(s["method"] == "spawn" for s in seen)  # the lifeline needs spawned engine processes
    assert seen[0]["thread"] != seen[1]["thread"] and all(s["thread"].startswith("bubblespec-engine-start") for s in seen)
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ  # removed once both starts ended
    assert all(e.info.vocab_size == 128 for e in engines)


async def test_an_operator_set_start_method_stays(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    seen = []

    def build(args, in_core):
        seen.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))
        return SimpleNamespace(tokenizer=None, errored=False, shutdown=lambda: None,
                               model_config=SimpleNamespace(get_vocab_size=lambda: 128, dtype="torch.float32"),
                               vllm_config=SimpleNamespace(lora_config=None))  # LoRA off, as vLLM's AsyncLLM has it

    monkeypatch.setattr(engine, "_build_engine", build)
    await VllmEngine(EngineSettings(model=str(tmp_path / "model"), num_speculative_tokens=0)).start()
    assert seen == ["forkserver"] and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "forkserver"
