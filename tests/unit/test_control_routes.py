"""The RL control routes (``scheduler/rl_api.py``) over HTTP, on the real scheduling core and
asyncio shell, with scripted workers on the shell's worker links (no engines): auth, world size,
pause modes, weight updates from a directory, server info, and refusals in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.types import Completion, FinishReason, Prompt, SamplingParams
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.core.types import ModelLimits, WorkerHello
from bubblespec.scheduler.core.validate import Limits, build_step
from bubblespec.scheduler.hot_routes import HotRoutes
from bubblespec.scheduler.openai_api import create_router as create_openai_router
from bubblespec.scheduler.rl_api import create_router
from bubblespec.scheduler.service import END, SchedulerService
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.scheduler.wire import feed, scheduler_message
from fastapi import FastAPI

LIMITS = ModelLimits(max_model_len=256, vocab_size=100)
ROUTES = [("GET", "/get_world_size"), ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
          ("POST", "/update_weights"), ("POST", "/reload_weights"), ("GET", "/server_info")]


class ScriptedWorker:
    """Answers the scheduler's messages on a worker link: loads succeed (or fail with
    ``load_error``); assignments are answered once ``release`` is set; aborts are recorded."""

    def __init__(self, service: SchedulerService, wid: str, model: str = "/models/base", load_error: str = "",
                 ranks: int = 1):
        self.service, self.wid, self.load_error = service, wid, load_error
        self.link = service.attach_worker(WorkerHello(wid, 2, 0, LIMITS, False, model=model, tensor_parallel_size=ranks))
        self.release = asyncio.Event()
        self.loads: list[tuple[int, str]] = []
        self.aborts: list[str] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            item = await self.link.outbox.get()
            if item is END:
                return
            msg = scheduler_message(item)
            kind = msg.WhichOneof("kind")
            if kind == "load_policy":
                self.loads.append((msg.load_policy.version, msg.load_policy.weights_path))
                feed(self.service, self.wid, pb.WorkerMessage(policy_loaded=pb.PolicyLoaded(
                    version=msg.load_policy.version, ok=not self.load_error, error=self.load_error)))
            elif kind == "assign":
                asyncio.create_task(self._complete(msg.assign))
            elif kind == "abort":
                self.aborts.append(msg.abort.request_key)

    async def _complete(self, a: pb.Assignment) -> None:
        await self.release.wait()
        c = Completion(a.step_id, a.prompt_id, a.sample_index, (7, 8), (-0.5, -0.5), "", FinishReason.STOP,
                       a.policy_version)
        feed(self.service, self.wid, pb.WorkerMessage(completion=pb.WorkerCompletion(
            request_key=a.request_key, completion=cv.completion_to_pb(c))))


def make_app(token: str = "", **settings) -> tuple[httpx.AsyncClient, SimpleNamespace]:
    service = SchedulerService(SchedulerCore(CoreSettings(), lambda: 0.0))
    scheduler = SimpleNamespace(settings=SchedulerSettings(trainer_token=token, **settings), service=service,
                                core=service.core, ready=True)
    app = FastAPI()
    app.include_router(create_openai_router(scheduler))
    app.include_router(create_router(scheduler))
    hot = HotRoutes(app)  # as the scheduler serves them (``Scheduler._start_http``)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=hot), base_url="http://test"), scheduler


def assert_error(r: httpx.Response, status: int, param: str | None, text: str = "") -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, status)
    assert text in err["message"], err["message"]


def step(step_id: str, prompts: int):
    return build_step(step_id=step_id, policy_version=0,
                      prompts=[Prompt(f"p{i}", token_ids=(5, i + 6)) for i in range(prompts)],
                      sampling=SamplingParams(temperature=0.0, max_tokens=4), limits=Limits(), model=LIMITS)


async def test_every_control_route_needs_the_trainer_token_when_one_is_set():
    http, _ = make_app(token="secret")
    async with http:
        for method, path in ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = await http.request(method, path, headers=headers)
                assert_error(r, 401, None, "authorization")
                assert r.json()["error"]["type"] == "AuthenticationError"
        r = await http.get("/is_paused", headers={"Authorization": "Bearer secret"})
        assert r.json() == {"is_paused": False}


async def test_world_size_counts_every_live_workers_ranks():
    http, scheduler = make_app()
    async with http:
        assert (await http.get("/get_world_size")).json() == {"world_size": 0}
        workers = [ScriptedWorker(scheduler.service, "a"), ScriptedWorker(scheduler.service, "b", ranks=4)]
        for query in ("", "?include_dp=true", "?include_dp=false"):
            assert (await http.get(f"/get_world_size{query}")).json() == {"world_size": 5}
        assert_error(await http.get("/get_world_size?include_dp=maybe"), 400, "include_dp", "true or false")
        info = (await http.get("/server_info?config_format=json")).json()["vllm_config"]
        assert info["parallel_config"]["world_size"] == 5
        for w in workers:
            w.task.cancel()


async def test_server_info_says_what_trl_reads():
    for mode, expected, backend in (("processed", "processed_logprobs", None), ("raw", "raw_logprobs", "nccl")):
        http, _ = make_app(default_logprobs_mode=mode, served_model_name="tiny", weight_transfer_backend=backend)
        async with http:
            info = (await http.get("/server_info", params={"config_format": "json"})).json()["vllm_config"]
            assert info["model_config"]["logprobs_mode"] == expected
            assert info["model_config"]["model"] == "tiny"
            assert info["weight_transfer_config"] == (backend and {"backend": backend})
            assert isinstance((await http.get("/server_info")).json()["vllm_config"], str)  # vLLM's default: text
            assert_error(await http.get("/server_info?config_format=yaml"), 400, "config_format")


async def test_calls_sent_while_paused_wait_for_resume_in_every_mode():
    """As ``vllm serve``: a call that arrives while paused is queued, not refused, and runs
    after ``/resume`` (streamed or not)."""
    http, scheduler = make_app()
    async with http:
        workers = [ScriptedWorker(scheduler.service, w) for w in ("a", "b")]
        for w in workers:
            w.release.set()
        assert_error(await http.post("/pause?mode=freeze"), 400, "mode", "abort, wait, keep")
        assert (await http.get("/is_paused")).json() == {"is_paused": False}  # a refused pause changes nothing
        for mode in ("keep", "wait", "abort", None):
            r = await http.post("/pause", params={"mode": mode, "clear_cache": "false"} if mode else None)
            assert r.json() == {"status": "paused"}
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            plain = asyncio.create_task(http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}))
            streamed = asyncio.create_task(http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2,
                                                                             "stream": True}))
            while scheduler.core.pool.pending < 2:
                await asyncio.sleep(0)
            for _ in range(50):
                await asyncio.sleep(0)
            assert not plain.done() and not streamed.done()
            assert len(scheduler.core.pool.parked) == 2  # waiting, not dispatched
            for _ in range(2):  # idempotent
                assert (await http.post("/resume")).json() == {"status": "resumed"}
            assert (await http.get("/is_paused")).json() == {"is_paused": False}
            r = await plain
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
            r = await streamed
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and '"finish_reason": "stop"' in r.text
            assert scheduler.core.pool.pending == 0
        for w in workers:
            w.task.cancel()


async def run_step(service: SchedulerService, spec) -> list:
    return [msg async for msg in service.run_step(spec)]


async def test_pause_wait_answers_once_the_active_step_ended():
    http, scheduler = make_app()
    async with http:
        workers = [ScriptedWorker(scheduler.service, w) for w in ("a", "b")]
        stream = asyncio.create_task(run_step(scheduler.service, step("s", 3)))
        while "s" not in scheduler.core.steps:
            await asyncio.sleep(0)
        pause = asyncio.create_task(http.post("/pause?mode=wait"))
        while not scheduler.core.pauser.paused:  # the route is in, waiting
            await asyncio.sleep(0)
        assert not pause.done() and scheduler.core.steps["s"].active  # the step holds the answer back
        for w in workers:
            w.release.set()
        assert (await pause).json() == {"status": "paused"}
        assert not scheduler.core.steps["s"].active
        assert sum(len(m) for m in await stream if isinstance(m, list)) == 3  # the completions
        await http.post("/resume")
        for w in workers:
            w.task.cancel()


async def test_pause_abort_cancels_the_active_step():
    http, scheduler = make_app()
    async with http:
        workers = [ScriptedWorker(scheduler.service, w) for w in ("a", "b")]
        stream = asyncio.create_task(run_step(scheduler.service, step("s", 3)))
        while "s" not in scheduler.core.steps:
            await asyncio.sleep(0)
        assert (await http.post("/pause")).json() == {"status": "paused"}  # vLLM's default mode: abort
        with pytest.raises(Exception, match="cancelled") as exc:
            await stream
        assert exc.value.code == "CANCELLED"
        await http.post("/resume")
        for w in workers:
            w.task.cancel()


async def test_update_weights_from_a_directory_is_the_policy_barrier():
    http, scheduler = make_app()
    async with http:
        workers = [ScriptedWorker(scheduler.service, w) for w in ("a", "b")]
        r = await http.post("/update_weights", json={"weight_dir": "/ckpt/step_1"})
        assert r.json() == {"status": "ok", "policy_version": 1, "workers": 2}
        assert all(w.loads == [(1, "/ckpt/step_1")] for w in workers)
        assert (scheduler.core.version, scheduler.core.weights_path) == (1, "/ckpt/step_1")
        r = await http.post("/reload_weights", json={})  # back to the weights the workers started from
        assert r.json()["policy_version"] == 2
        assert (scheduler.core.version, scheduler.core.weights_path) == (2, "/models/base")
        for w in workers:
            w.task.cancel()


async def test_a_failed_update_names_the_workers_and_changes_nothing():
    http, scheduler = make_app()
    async with http:
        workers = [ScriptedWorker(scheduler.service, w, load_error="missing model.safetensors") for w in ("a", "b")]
        r = await http.post("/update_weights", json={"weight_dir": "/ckpt/broken"})
        assert_error(r, 400, "weight_dir", "worker a: missing model.safetensors; worker b: missing")
        assert (scheduler.core.version, scheduler.core.weights_path) == (0, "")
        for w in workers:
            w.task.cancel()


async def test_update_weights_while_a_step_runs_unpaused_is_refused():
    http, scheduler = make_app()
    async with http:
        workers = [ScriptedWorker(scheduler.service, w) for w in ("a", "b")]
        stream = asyncio.create_task(run_step(scheduler.service, step("s", 1)))
        while "s" not in scheduler.core.steps:
            await asyncio.sleep(0)
        r = await http.post("/update_weights", json={"weight_dir": "/ckpt/step_1"})
        assert_error(r, 400, None, "step 's' is still running; pause first")
        assert scheduler.core.version == 0 and not workers[0].loads
        for w in workers:
            w.release.set()
        await stream
        for w in workers:
            w.task.cancel()


@pytest.mark.parametrize("body, status, param, text", [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[]", 400, None, "JSON object"),
    (b"{}", 400, "weight_dir", "non-empty string"),
    (b'{"weight_dir": null}', 400, "weight_dir", "non-empty string"),
    (b'{"weight_dir": 7}', 400, "weight_dir", "non-empty string"),
    (b'{"weight_dir": "/a", "update_info": {}}', 400, "weight_dir", "not both"),
    (b'{"weight_dir": "' + b"x" * 5000 + b'"}', 400, "weight_dir", "bytes; at most"),
    (b'{"weight_dir": "' + b"x" * 3_000_000 + b'"}', 413, None, "body is over"),
])
async def test_bad_update_requests_are_refused_naming_the_field(body, status, param, text):
    http, scheduler = make_app(limits=Limits(max_request_bytes=2**20))
    async with http:
        worker = ScriptedWorker(scheduler.service, "a")
        r = await http.post("/update_weights", content=body, headers={"content-type": "application/json"})
        assert_error(r, status, param, text)
        assert scheduler.core.version == 0 and not worker.loads
        worker.task.cancel()


async def test_update_info_goes_to_the_weight_transfer_fan_out():
    http, scheduler = make_app()  # weight_transfer_backend off: the fan-out refuses, naming its setting
    async with http:
        r = await http.post("/update_weights", json={"update_info": {"names": []}})
        assert_error(r, 400, "weight_transfer_config", "weight-transfer")
        assert scheduler.core.version == 0


async def test_reload_needs_workers_that_agree_on_their_base_weights():
    http, scheduler = make_app()
    async with http:
        assert_error(await http.post("/reload_weights"), 503, None, "no live worker")
        workers = [ScriptedWorker(scheduler.service, "a", model="/m/one"),
                   ScriptedWorker(scheduler.service, "b", model="/m/two")]
        assert_error(await http.post("/reload_weights"), 400, None, "different weights")
        workers.append(ScriptedWorker(scheduler.service, "c", model=""))
        assert_error(await http.post("/reload_weights"), 400, None, "did not say")
        for w in workers:
            w.task.cancel()
            scheduler.service.detach_worker(w.link)
        workers = [ScriptedWorker(scheduler.service, "d", model="/" + "m" * 5000)]
        assert_error(await http.post("/reload_weights"), 400, None, "base weights path is 5001 bytes; at most 4096")
        assert scheduler.core.version == 0 and not any(w.loads for w in workers)
        for w in workers:
            w.task.cancel()
