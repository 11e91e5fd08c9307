"""SkyRL's own ``RemoteInferenceClient`` (skyrl 0.3.0, in .venv-skyrl: tests/requirements-skyrl.txt)
against BubbleSpec, unchanged: its calls run in a subprocess (``tests/support/skyrl_driver.py``)
and the scheduler's side is checked here.

- Data plane, pause/resume and sleep/wake_up against the shared ``cluster`` (real vLLM CPU
  engines): ``generate`` (``/inference/v1/generate`` + ``/detokenize``), ``completion``,
  ``chat_completion``, ``render_chat_completion``, ``tokenize``/``detokenize``, ``pause(keep)``
  during a generation, ``sleep(level=1)``, a generation sent while asleep, ``wake_up(["weights"])``
  then ``wake_up(["kv_cache"])``, ``reset_prefix_cache``.
- Weight sync through ``/collective_rpc`` (``start_weight_update``, ``update_weights_nccl``,
  ``finish_weight_update``) inside a level-2 sleep: NCCL needs GPUs and vLLM's CPU engine has no
  weight-transfer engine, so the workers here are real worker agents on simulated engines that
  accept the weight-transfer calls and record them (as in test_weight_transfer.py).
- A trainer (SkyRL's client) killed between ``start_weight_update`` and ``finish``: the update is
  rolled back at the deadline, the workers close it, and a new update and requests run.

Before: ``/collective_rpc``, ``/sleep``, ``/wake_up``, ``/is_sleeping`` and
``/v1/chat/completions/render`` answered 404, and a killed trainer left the barrier open for good.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from bubblespec.bench.load_engine import LoadEngineSettings, LoadTestEngine
from bubblespec.scheduler.core.types import PolicyFailed
from bubblespec.worker.agent import WorkerAgent, stop_agents
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.engine import EngineSettings
from tests.integration.test_weight_transfer import started
from tests.support.fake_worker import wait_until

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-skyrl" / "bin" / "python"
DRIVER = ROOT / "tests" / "support" / "skyrl_driver.py"
METADATA = {"names": ["model.embed_tokens.weight"], "dtype_names": ["float32"], "shapes": [[128, 64]]}

pytestmark = pytest.mark.skipif(not PYTHON.exists(), reason="no .venv-skyrl: run scripts/setup.sh")


async def drive(plan: dict, timeout: float = 240) -> dict:
    """Run the driver with ``plan``; its JSON answer (a failure shows its stderr)."""
    proc = await asyncio.create_subprocess_exec(str(PYTHON), str(DRIVER), json.dumps(plan), cwd=ROOT,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


async def test_skyrl_generates_pauses_sleeps_and_wakes_against_real_engines(cluster):
    s = cluster.scheduler
    url = f"http://127.0.0.1:{s.http_port}"
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = await drive({"url": url, "scenario": "serve", "model": s.settings.model_name(), "prompts": prompts})
    ranks = sum(w.hello.tensor_parallel_size for w in s.core.workers.values())
    assert out["world_size"] == [ranks, ranks]
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        # generate: greedy, the same tokens as /v1/completions gives for the same prompt
        for prompt, ids in zip(prompts, out["generate"]["response_ids"], strict=True):
            r = await http.post("/v1/completions", json={"prompt": prompt, "temperature": 0.0, "max_tokens": 8,
                                                         "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert ids == r.json()["choices"][0]["token_ids"] and len(ids) > 0
        detok = (await http.post("/detokenize", json={"tokens": out["generate"]["response_ids"][0]})).json()
        assert out["generate"]["responses"][0] == detok["prompt"]
        assert out["completion"]["object"] == "text_completion" and out["completion"]["choices"][0]["finish_reason"]
        assert out["chat"]["object"] == "chat.completion" and out["chat"]["choices"][0]["finish_reason"]
        # render: the chat template's token ids, as /tokenize renders the same messages
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        tokens = (await http.post("/tokenize", json={"messages": messages})).json()["tokens"]
        render = out["render"]
        assert render["token_ids"] == tokens and render["request_id"].startswith("chatcmpl-")
        assert render["sampling_params"]["temperature"] == 0.0 and render["sampling_params"]["max_tokens"] == 8
        # ... and what it rendered runs as is on /inference/v1/generate, as the chat call's answer
        r = await http.post("/inference/v1/generate", json=render)
        assert r.status_code == 200, r.text
        chat_ids = (await http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0.0,
                                                                  "max_tokens": 8, "return_token_ids": True})).json()
        assert r.json()["choices"][0]["token_ids"] == chat_ids["choices"][0]["token_ids"]
    assert out["detokenize"] == ["hello world"] or out["detokenize"][0].strip() == "hello world"
    # pause(keep) mid-generation: the generation went on after resume, to its end
    assert out["pause"] == [{"status": "paused"}] and out["is_paused"] == [{"is_paused": True}]
    assert out["resume"] == [{"status": "resumed"}] and len(out["kept"]["response_ids"][0]) > 0
    # sleep: dispatch stopped; a call sent while asleep waited for the full wake-up, then ran
    assert out["sleep"] == [{"status": "sleeping", "level": 1}] and out["is_sleeping"] == [{"is_sleeping": True}]
    assert out["resume_while_asleep"]["status"] == 409 and "asleep" in out["resume_while_asleep"]["message"]
    assert out["ran_while_asleep"] is False
    assert out["wake_weights"] == [{"status": "sleeping", "tags": ["weights"]}]  # vLLM: not fully awake yet
    assert out["ran_after_weights"] is False
    assert out["wake_kv_cache"] == [{"status": "awake", "tags": ["kv_cache"]}]
    assert out["after_wake"] == out["generate"]["response_ids"][:1]  # level 1 kept the weights: same tokens
    assert out["is_sleeping_after"] == [{"is_sleeping": False}] and out["reset_prefix_cache"] == [{"success": True}]
    assert not s.core.paused and all(not w.asleep for w in s.core.workers.values())


class _ReceivingEngine(LoadTestEngine):
    """A simulated engine whose weight-transfer and sleep calls succeed and are recorded (vLLM's
    CPU engine has no weight-transfer engine; NCCL needs GPUs)."""

    def __init__(self, settings: LoadEngineSettings):
        super().__init__(settings)
        self.calls: list[tuple[str, dict]] = []
        self.asleep = False

    async def control(self, op: str, args: dict) -> dict:
        self.calls.append((op, args))
        if op == "reset_prefix_cache":
            return await super().control(op, args)
        if op == "sleep":
            self.asleep = True
        if op == "wake_up":
            self.asleep = args.get("tags") == ["weights"]  # weights back, kv cache still asleep
            return {"fully_awake": not self.asleep}
        return {}


async def _agents(s, n: int = 2):
    engines = [_ReceivingEngine(LoadEngineSettings(vocab_size=128, max_model_len=512, step_seconds=0.001,
                                                  median_tokens=4, seed=i)) for i in range(n)]
    agents, tasks = [], []
    for i, engine in enumerate(engines):
        await engine.start()
        agents.append(WorkerAgent(WorkerSettings(scheduler=f"127.0.0.1:{s.grpc_port}", worker_id=f"a{i}",
                                                 heartbeat_seconds=0.2, engine=EngineSettings(
                                                     model="simulated", max_model_len=512, max_num_seqs=4)), engine))
        tasks.append(asyncio.create_task(agents[-1].run()))
    await wait_until(lambda: set(s.core.workers) == {f"a{i}" for i in range(n)}, what="agents connected")
    return engines, agents, tasks


async def _stop(s, engines, agents, tasks) -> None:
    await stop_agents(agents, tasks)
    for engine in engines:
        await engine.shutdown()
    await s.stop(1.0)


async def test_skyrl_weight_sync_through_collective_rpc_inside_a_level_2_sleep():
    s = await started()
    engines, agents, tasks = await _agents(s)
    try:
        out = await drive({"url": f"http://127.0.0.1:{s.http_port}", "scenario": "sync", "model": "bubblespec",
                           "metadata": METADATA})
        assert out["init"] == [{"message": "Weight transfer initialized"}]
        assert [e.calls[0][1]["init_info"]["rank_offset"] for e in engines] == [1, 2]
        assert out["sleep"] == [{"status": "sleeping", "level": 2}]
        assert out["wake_weights"] == [{"status": "sleeping", "tags": ["weights"]}]
        assert out["start"] == out["update"] == out["finish"] == [{"results": [None, None]}]
        for e in engines:
            assert [op for op, _ in e.calls] == ["init_weight_transfer", "sleep", "wake_up", "start_weight_update",
                                                 "update_weights", "finish_weight_update", "wake_up"]
            assert dict(e.calls)["sleep"] == {"level": 2}
            assert dict(e.calls)["update_weights"] == {"update_info": {**METADATA, "packed": True}}
        assert s.core.version == 1 and s.core.weights_path == "weight-transfer:1"
        assert out["wake_kv_cache"] == [{"status": "awake", "tags": ["kv_cache"]}]
        assert [a.weights.version for a in agents] == [1, 1]
        assert out["completion"]["choices"][0]["finish_reason"] in ("length", "stop")  # requests run again
        # the methods SkyRL's weight sync does not use with a remote server are refused by name
        assert out["ipc"]["status"] == 400 and "'update_weights_ipc' is not served" in out["ipc"]["message"]
        assert out["kernel_format"]["status"] == 400 and "only true is served" in out["kernel_format"]["message"]
    finally:
        await _stop(s, engines, agents, tasks)


async def test_a_skyrl_trainer_killed_mid_transfer_is_rolled_back_at_the_deadline():
    s = await started(weight_update_deadline_seconds=3.0)
    engines, agents, tasks = await _agents(s)
    failed: list[PolicyFailed] = []
    s.service.listeners.append(lambda a: failed.append(a) if isinstance(a, PolicyFailed) else None)
    plan = {"url": f"http://127.0.0.1:{s.http_port}", "scenario": "start_and_hang", "model": "bubblespec"}
    trainer = await asyncio.create_subprocess_exec(str(PYTHON), str(DRIVER), json.dumps(plan), cwd=ROOT,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(trainer.stdout.readline(), 60)
        assert json.loads(line) == {"started": True}, (await trainer.stderr.read()).decode()[-2000:]
        assert s.service.transfer.updating == 1 and [a.weights.version for a in agents] == [-1, -1]
        os.kill(trainer.pid, signal.SIGKILL)  # the trainer dies between start and finish
        await trainer.wait()
        await wait_until(lambda: failed, timeout=15, what="the deadline's rollback")
        assert "not finished within 3s" in failed[0].message and "stays at version 0" in failed[0].message
        assert s.core.version == 0 and s.service.transfer.updating is None
        await wait_until(lambda: all(e.calls[-1][0] == "abort_weight_update" for e in engines),
                         what="each engine told to close the update")
        # the engine records the call before its answer travels back; the scheduler clears
        # ``unclosed`` once both answers arrive
        await wait_until(lambda: s.service.transfer.unclosed == set(), what="both closes acknowledged")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.http_port}", timeout=30) as http:
            r = await http.post("/finish_weight_update", json={})
            assert r.status_code == 409 and "not finished within 3s" in r.json()["error"]["message"], r.text
            r = await http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            assert r.status_code in (400, 503) and "policy version" in r.text  # no worker holds a version
            for path, body in (("/start_weight_update", {}), ("/update_weights", {"update_info": METADATA}),
                               ("/finish_weight_update", {"weight_version": "after-rollback"})):
                r = await http.post(path, json=body)
                assert r.status_code == 200, (path, r.text)
            assert s.core.version == 1 and [a.weights.version for a in agents] == [1, 1]
            r = await http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "temperature": 0.0})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
    finally:
        if trainer.returncode is None:
            trainer.kill()
            await trainer.wait()
        await _stop(s, engines, agents, tasks)

