"""vLLM's weight-transfer routes and /reset_prefix_cache, fanned out to every worker.

Real scheduler, real HTTP and real gRPC on loopback; the workers are scripted
(``tests/support/fake_worker.py``: they record each ``ControlCall`` and answer ok or a scripted
failure), since NCCL needs GPUs. One test drives a real vLLM CPU worker through the same path.

Before: none of these routes existed (404), a worker had no control message to receive, and
the scheduler could not say which rank offset a worker has in the trainer's group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import httpx
import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.client import AsyncRolloutClient, SamplingParams
from bubblespec.client.errors import FatalError
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.types import PolicyFailed, PolicyReady
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.worker.agent import WorkerAgent, stop_agents
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.engine import EngineSettings
from bubblespec.bench.load_engine import LoadEngineSettings, LoadTestEngine
from tests.support.fake_worker import FakeWorker, wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
CALM = CoreSettings(drafting=False, worker_timeout_seconds=3600, stall_seconds=3600)
INIT = {"master_address": "10.0.0.7", "master_port": 29551, "rank_offset": 1, "world_size": 4, "packed": True}
UPDATE = {"names": ["model.embed_tokens.weight"], "dtype_names": ["float32"], "shapes": [[128, 64]]}
OP = pb.ControlOp.Name


async def started(**settings) -> Scheduler:
    base = {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0, "drain_seconds": 1.0, "core": CALM,
            "weight_transfer_backend": "nccl"}
    scheduler = Scheduler(SchedulerSettings(**{**base, **settings}))
    await scheduler.start()
    return scheduler


class Cluster:
    """A scheduler with scripted workers, and an HTTP client on its port."""

    def __init__(self, scheduler: Scheduler, workers: list[FakeWorker]):
        self.scheduler, self.workers = scheduler, workers
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{scheduler.http_port}", timeout=30)
        self.actions: list = []
        scheduler.service.listeners.append(self.actions.append)

    @property
    def core(self):
        return self.scheduler.core

    def target(self) -> str:
        return f"127.0.0.1:{self.scheduler.grpc_port}"

    async def post(self, path: str, body: dict | None = None) -> httpx.Response:
        return await self.http.post(path, json=body if body is not None else {})

    def ops(self, worker: FakeWorker) -> list[str]:
        return [OP(c.op) for c in worker.controls]

    async def transfer(self, weight_version: str | None = None) -> None:
        """start -> update -> finish, each answered 200."""
        for path, body in (("/start_weight_update", {}), ("/update_weights", {"update_info": UPDATE}),
                           ("/finish_weight_update", {"weight_version": weight_version})):
            r = await self.post(path, body)
            assert r.status_code == 200, (path, r.text)


async def cluster_of(scheduler: Scheduler, workers: list[FakeWorker]) -> Cluster:
    for w in workers:
        await w.start()
    ids = {w.worker_id for w in workers}
    await wait_until(lambda: set(scheduler.core.workers) == ids and ids <= set(scheduler.service.links),
                     what="workers connected")
    return Cluster(scheduler, workers)


async def close(c: Cluster) -> None:
    await c.http.aclose()
    for w in c.workers:
        await w.stop()
    await c.scheduler.stop(1.0)


def fakes(scheduler: Scheduler, n: int = 3, **kw) -> list[FakeWorker]:
    return [FakeWorker(f"127.0.0.1:{scheduler.grpc_port}", f"fw-{i}", **kw) for i in reversed(range(n))]


async def server_info(c: Cluster) -> dict:
    """What TRL's ``VLLMClient.get_server_info`` reads (``init_communicator`` checks its weight_transfer_config)."""
    r = await c.http.get("/server_info", params={"config_format": "json"})
    assert r.status_code == 200, r.text
    return r.json()["vllm_config"]


def by_id(c: Cluster) -> dict[str, FakeWorker]:
    return {w.worker_id: w for w in c.workers}


def refused(r: httpx.Response, status: int, param: str, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status, err
    for word in words:
        assert word in err["message"], (word, err["message"])


async def test_each_worker_gets_the_trainers_init_info_with_its_own_rank_offset():
    s = await started()
    c = await cluster_of(s, fakes(s))
    try:
        r = await c.post("/init_weight_transfer_engine", {"init_info": INIT})
        assert r.status_code == 200 and r.json() == {"message": "Weight transfer initialized"}
        for i, w in enumerate(sorted(c.workers, key=lambda w: w.worker_id)):
            assert c.ops(w) == ["CONTROL_OP_INIT_WEIGHT_TRANSFER"]
            got = json.loads(w.controls[0].json)["init_info"]
            assert got == {**INIT, "rank_offset": 1 + i}, (w.worker_id, got)  # fw-0 -> 1, fw-1 -> 2, fw-2 -> 3
        assert {m.worker_id: m.rank_offset for m in c.scheduler.service.transfer.members.values()} == \
            {"fw-0": 1, "fw-1": 2, "fw-2": 3}
    finally:
        await close(c)


async def test_tensor_parallel_workers_take_as_many_ranks_and_their_slice_of_a_list_update():
    s = await started()
    target = f"127.0.0.1:{s.grpc_port}"
    c = await cluster_of(s, [FakeWorker(target, "b", tensor_parallel_size=1),
                             FakeWorker(target, "a", tensor_parallel_size=2)])
    try:
        r = await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "rank_offset": 2, "world_size": 5}})
        assert r.status_code == 200, r.text
        a, b = by_id(c)["a"], by_id(c)["b"]
        assert json.loads(a.controls[0].json)["init_info"]["rank_offset"] == 2  # ranks 2, 3
        assert json.loads(b.controls[0].json)["init_info"]["rank_offset"] == 4
        assert (await c.post("/start_weight_update")).status_code == 200
        per_rank = [{**UPDATE, "rank": i} for i in range(3)]
        r = await c.post("/update_weights", {"update_info": per_rank})
        assert r.status_code == 200 and r.json() == {"message": "Weights updated"}, r.text
        assert json.loads(a.controls[-1].json)["update_info"] == per_rank[0:2]
        assert json.loads(b.controls[-1].json)["update_info"] == per_rank[2:3]
        refused(await c.post("/update_weights", {"update_info": per_rank[:2]}), 400, "update_info", "3, got 2")
        assert len(a.controls) == 3, "a refused list is not sent"
    finally:
        await close(c)


async def test_a_world_size_that_does_not_match_the_workers_is_refused_and_nothing_is_sent():
    s = await started(trainer_token="t0ken-for-the-trainer-xyz")
    c = await cluster_of(s, fakes(s))
    c.http.headers["authorization"] = "Bearer t0ken-for-the-trainer-xyz"
    try:
        r = await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}})
        refused(r, 400, "init_info.world_size", "rank_offset 1", "= 4, got 3")
        refused(await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "rank_offset": -1}}),
                400, "init_info.rank_offset")
        refused(await c.post("/init_weight_transfer_engine", {}), 400, "init_info")
        refused(await c.post("/start_weight_update"), 409, "init_info", "/init_weight_transfer_engine first")
        refused(await c.post("/finish_weight_update", {"weight_version": 7}), 400, "weight_version", "a string")
        assert all(not w.controls for w in c.workers), "nothing reached a worker"
        assert c.scheduler.service.transfer.members == {} and c.core.policy_loading is None
        anonymous = await c.http.post("/init_weight_transfer_engine", json={"init_info": INIT},
                                      headers={"authorization": ""})
        assert anonymous.status_code == 401
    finally:
        await close(c)


async def test_routes_are_off_without_a_backend_and_say_how_to_turn_them_on():
    s = await started(weight_transfer_backend=None)
    c = await cluster_of(s, fakes(s, 1))
    try:
        for path in ("/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update"):
            refused(await c.post(path, {"init_info": INIT}), 400, "weight_transfer_config", "--weight-transfer-backend")
        assert not c.workers[0].controls
        assert (await server_info(c))["weight_transfer_config"] is None
    finally:
        await close(c)


async def test_finish_moves_the_version_and_the_next_steps_completions_carry_it():
    s = await started()
    c = await cluster_of(s, fakes(s, auto=False))
    try:
        assert (await server_info(c))["weight_transfer_config"] == {"backend": "nccl"}
        assert (await c.post("/init_weight_transfer_engine", {"init_info": INIT})).status_code == 200
        async with AsyncRolloutClient(c.target(), timeout_seconds=10) as client:
            running = asyncio.create_task(client.generate("s0", [(5, 6), (7, 8)], GREEDY))
            await wait_until(lambda: sum(len(w.assignments) for w in c.workers) == 2, what="step s0 running")
            refused(await c.post("/start_weight_update"), 409, "weight_version", "step 's0' is still running")
            assert all(c.ops(w) == ["CONTROL_OP_INIT_WEIGHT_TRANSFER"] for w in c.workers), "start was not sent"
            for w in c.workers:
                w.complete_all()
            assert {x.policy_version for x in (await running).completions} == {0}

            assert (await c.post("/start_weight_update")).status_code == 200
            with pytest.raises(FatalError) as during:  # no dispatch on half-updated weights
                await client.generate("s-during", [(5, 6)], GREEDY, policy_version=0)
            assert during.value.code == grpc.StatusCode.FAILED_PRECONDITION and "still loading" in during.value.message
            r = await c.post("/update_weights", {"update_info": UPDATE})
            assert r.status_code == 200, r.text
            assert c.core.version == 0, "the version moves at finish only"
            r = await c.post("/finish_weight_update", {"weight_version": "step-7"})
            assert r.status_code == 200 and r.json() == {"message": "Weight update finished"}, r.text
            assert c.core.version == 1 and c.core.weights_path == "weight-transfer:step-7"
            assert PolicyReady(1, 3) in c.actions  # what the journal records (service.execute)
            for w in c.workers:
                assert c.ops(w) == ["CONTROL_OP_INIT_WEIGHT_TRANSFER", "CONTROL_OP_START_WEIGHT_UPDATE",
                                    "CONTROL_OP_UPDATE_WEIGHTS", "CONTROL_OP_FINISH_WEIGHT_UPDATE"]
                assert w.controls[-1].policy_version == 1
                assert json.loads(w.controls[-1].json) == {"weight_version": "step-7"}
                assert c.core.workers[w.worker_id].version == 1
                w.auto = True
            after = await asyncio.wait_for(client.generate("s1", [(5, 6), (9, 9)], GREEDY, policy_version=1), 20)
            assert len(after.completions) == 2 and {x.policy_version for x in after.completions} == {1}

            await c.transfer()  # no label: weight-transfer:<version>
            assert c.core.version == 2 and c.core.weights_path == "weight-transfer:2"
    finally:
        await close(c)


async def test_a_step_held_by_a_keep_pause_runs_at_the_transferred_version_after_resume():
    s = await started()
    c = await cluster_of(s, fakes(s, 2, auto=False))
    try:
        assert (await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}})).status_code == 200
        async with AsyncRolloutClient(c.target(), timeout_seconds=10) as client:
            running = asyncio.create_task(client.generate("s0", [(5, 6), (7, 8)], GREEDY))
            await wait_until(lambda: sum(len(w.assignments) for w in c.workers) == 2, what="step s0 running")
            assert (await c.http.post("/pause", params={"mode": "keep"})).status_code == 200
            await wait_until(lambda: not any(w.assignments for w in c.workers), what="the held requests aborted")
            await c.transfer("v-next")
            assert c.core.version == 1 and not running.done()
            for w in c.workers:
                w.auto = True
            assert (await c.http.post("/resume")).status_code == 200
            result = await asyncio.wait_for(running, 20)
            assert [x.policy_version for x in result.completions] == [1, 1], "run from scratch at the new version"
    finally:
        await close(c)


async def test_a_worker_failing_update_is_named_the_version_stays_and_its_weights_are_unknown():
    s = await started()

    def nccl_error(call):
        return "NCCL error: unhandled system error" if call.op == pb.CONTROL_OP_UPDATE_WEIGHTS else None

    target = f"127.0.0.1:{s.grpc_port}"
    c = await cluster_of(s, [FakeWorker(target, "fw-0"), FakeWorker(target, "fw-1", control=nccl_error),
                             FakeWorker(target, "fw-2")])
    try:
        assert (await c.post("/init_weight_transfer_engine", {"init_info": INIT})).status_code == 200
        assert (await c.post("/start_weight_update")).status_code == 200
        r = await c.post("/update_weights", {"update_info": UPDATE})
        refused(r, 500, "workers", "update_weights failed on 1 of 3 worker(s): worker fw-1: NCCL error: unhandled")
        assert "fw-0" not in r.json()["error"]["message"]
        assert c.core.version == 0 and c.core.policy_loading is None
        assert any(isinstance(a, PolicyFailed) and a.version == 1 for a in c.actions)
        assert {w.version for w in c.core.workers.values()} == {-1}, "weights in flux: none serves"
        refused(await c.post("/finish_weight_update"), 409, "weight_version", "no weight update is in progress")
        async with AsyncRolloutClient(c.target(), timeout_seconds=10) as client:
            with pytest.raises(FatalError) as err:
                await client.generate("s-after", [(5, 6)], GREEDY)
            assert "no connected worker holds policy version 0" in err.value.message

            by_id(c)["fw-1"].control = None  # the trainer retries the whole update: it succeeds
            await c.transfer()
            assert c.core.version == 1 and {w.version for w in c.core.workers.values()} == {1}
            result = await asyncio.wait_for(client.generate("s1", [(5, 6)], GREEDY, policy_version=1), 20)
            assert [x.policy_version for x in result.completions] == [1]
    finally:
        await close(c)


async def test_a_worker_lost_or_joining_mid_transfer_fails_the_next_call_clearly():
    s = await started(weight_transfer_timeout_seconds=30)
    hold = {"on": False}
    target = f"127.0.0.1:{s.grpc_port}"
    c = await cluster_of(s, fakes(s, 2) + [FakeWorker(target, "fw-2", control=lambda call: FakeWorker.HOLD
                                                        if hold["on"] else None)])
    try:
        assert (await c.post("/init_weight_transfer_engine", {"init_info": INIT})).status_code == 200
        late = await FakeWorker(target, "fw-9").start()  # joins after init: not in the trainer's group
        try:
            await wait_until(lambda: "fw-9" in c.core.workers, what="fw-9 joined")
            refused(await c.post("/start_weight_update"), 409, "workers", "worker fw-9 joined after")
            assert not late.controls and c.core.policy_loading is None and c.core.version == 0
        finally:
            await late.stop()
        await wait_until(lambda: "fw-9" not in c.core.workers, what="fw-9 left")

        assert (await c.post("/start_weight_update")).status_code == 200
        hold["on"] = True  # fw-2 takes the update and goes away without answering
        pending = asyncio.create_task(c.post("/update_weights", {"update_info": UPDATE}))
        fw2 = by_id(c)["fw-2"]
        await wait_until(lambda: len(fw2.controls) == 3, what="fw-2 got the update")
        await fw2.stop()
        r = await asyncio.wait_for(pending, 20)
        refused(r, 500, "workers", "worker fw-2: its stream ended before it answered")
        assert c.core.version == 0 and {w.version for w in c.core.workers.values()} == {-1}

        refused(await c.post("/start_weight_update"), 409, "workers", "worker fw-2 (rank_offset 3) left")
        r = await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}})
        assert r.status_code == 200, "a new group of the workers left"
        await c.transfer()
        assert c.core.version == 1
    finally:
        await close(c)


async def test_a_worker_that_does_not_answer_in_time_is_named():
    s = await started(weight_transfer_timeout_seconds=0.5)
    target = f"127.0.0.1:{s.grpc_port}"
    c = await cluster_of(s, [FakeWorker(target, "fw-0"), FakeWorker(target, "fw-1", control=lambda _: FakeWorker.HOLD)])
    try:
        r = await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}})
        refused(r, 500, "workers", "1 of 2", "worker fw-1: did not answer within 0.5s")
        refused(await c.post("/start_weight_update"), 409, "init_info", "first")  # a failed init forms no group
    finally:
        await close(c)


async def test_reset_prefix_cache_is_fanned_out_and_fails_when_a_worker_does():
    s = await started(weight_transfer_backend=None)  # not a weight-transfer route: always on
    answers: dict[str, object] = {}
    c = await cluster_of(s, fakes(s, control=lambda call: answers.get("now")))
    try:
        r = await c.http.post("/reset_prefix_cache?reset_running_requests=true")
        assert r.status_code == 200 and r.json() == {"success": True}
        for w in c.workers:
            assert c.ops(w) == ["CONTROL_OP_RESET_PREFIX_CACHE"]
            assert json.loads(w.controls[0].json) == {"reset_running_requests": True, "reset_external": False}
        by_id(c)["fw-1"].control = lambda call: {"success": False}  # blocks still held there: vLLM's false
        assert (await c.post("/reset_prefix_cache")).json() == {"success": False}
        by_id(c)["fw-1"].control = lambda call: "EngineDeadError: EngineCore encountered an issue"
        refused(await c.post("/reset_prefix_cache"), 500, "workers", "worker fw-1: EngineDeadError")
        assert [len(w.controls) for w in c.workers] == [3, 3, 3]
    finally:
        await close(c)


async def test_a_real_vllm_worker_resets_its_prefix_cache_and_refuses_an_nccl_group_on_cpu(cluster, monkeypatch):
    """The shared vLLM CPU workers through the same path: ``reset_prefix_cache`` runs on each
    engine; ``init_weight_transfer_engine`` fails there with vLLM's own error (an engine
    without a weight-transfer backend; NCCL needs GPUs), named per worker, changing nothing."""
    s = cluster.scheduler
    monkeypatch.setattr(s, "settings", dataclasses.replace(s.settings, weight_transfer_backend="nccl"))
    version, n = s.core.version, len(s.core.workers)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.http_port}", timeout=120) as http:
        r = await http.post("/reset_prefix_cache?reset_running_requests=true")  # drafts may be running
        assert r.status_code == 200 and r.json() == {"success": True}, r.text
        r = await http.post("/init_weight_transfer_engine", json={"init_info": {**INIT, "world_size": 1 + n}})
        refused(r, 500, "workers", f"init_weight_transfer_engine failed on {n} of {n} worker(s)",
                "Weight transfer not configured")
    assert s.service.transfer.members == {} and s.core.version == version and s.core.policy_loading is None


async def test_a_hello_with_a_negative_tensor_parallel_size_is_refused_naming_it():
    s = await started()
    bad = FakeWorker(f"127.0.0.1:{s.grpc_port}", "fw-bad", tensor_parallel_size=-2)
    try:
        await bad.start()
        err = await bad.closed()
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hello.tensor_parallel_size" in err.details() and "fw-bad" not in s.core.workers
    finally:
        await bad.stop()
        await s.stop(1.0)


async def test_the_worker_agent_answers_control_calls_and_refuses_a_transferred_version_it_never_got():
    """The real worker agent (simulated engine: no weight transfer, a prefix cache reset that
    succeeds) joins after an update pushed by weight transfer."""
    s = await started()
    c = await cluster_of(s, fakes(s, 2))
    engine = LoadTestEngine(LoadEngineSettings(vocab_size=128, max_model_len=512, step_seconds=0.001, median_tokens=4))
    await engine.start()
    agent = WorkerAgent(WorkerSettings(scheduler=c.target(), worker_id="sim-0", heartbeat_seconds=0.2,
                                       engine=EngineSettings(model="simulated", max_model_len=512, max_num_seqs=4)),
                        engine)
    task = None
    try:
        assert (await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}})).status_code == 200
        await c.transfer()
        task = asyncio.create_task(agent.run())
        await wait_until(lambda: "sim-0" in c.core.workers and c.core.workers["sim-0"].load_failed == 1,
                         what="sim-0 refused version 1")
        assert agent.weights.version == 0 and c.core.version == 1, "its old weights stay; it gets no work"
        assert (await c.post("/reset_prefix_cache")).json() == {"success": True}
        r = await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 4}})
        refused(r, 500, "workers", "1 of 3", "worker sim-0: init_weight_transfer: the simulated engine has no weight transfer")
    finally:
        if task is not None:
            await stop_agents([agent], [task])
        await engine.shutdown()
        await close(c)


class _ReceivingEngine(LoadTestEngine):
    """A simulated engine whose weight-transfer calls succeed (and are recorded)."""

    def __init__(self, settings: LoadEngineSettings):
        super().__init__(settings)
        self.calls: list[tuple[str, dict]] = []

    async def control(self, op: str, args: dict) -> dict:
        self.calls.append((op, args))
        return await super().control(op, args) if op == "reset_prefix_cache" else {}


async def test_worker_agents_serve_the_transferred_version_only_after_finish():
    s = await started()
    engines = [_ReceivingEngine(LoadEngineSettings(vocab_size=128, max_model_len=512, step_seconds=0.001,
                                                  median_tokens=4, seed=i)) for i in range(2)]
    agents, tasks = [], []
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.http_port}", timeout=30)
    try:
        for i, engine in enumerate(engines):
            await engine.start()
            agents.append(WorkerAgent(WorkerSettings(scheduler=f"127.0.0.1:{s.grpc_port}", worker_id=f"a{i}",
                                                     heartbeat_seconds=0.2, engine=EngineSettings(
                                                         model="simulated", max_model_len=512, max_num_seqs=4,
                                                         tensor_parallel_size=2)), engine))
            tasks.append(asyncio.create_task(agents[-1].run()))
        await wait_until(lambda: set(s.core.workers) == {"a0", "a1"}, what="two agents")
        assert {w.hello.tensor_parallel_size for w in s.core.workers.values()} == {2}
        r = await http.post("/init_weight_transfer_engine", json={"init_info": {**INIT, "world_size": 5}})
        assert r.status_code == 200, r.text
        assert [e.calls[0][1]["init_info"]["rank_offset"] for e in engines] == [1, 3]
        assert (await http.post("/start_weight_update")).status_code == 200
        assert [a.weights.version for a in agents] == [-1, -1], "weights in flux between start and finish"
        assert (await http.post("/update_weights", json={"update_info": UPDATE})).status_code == 200
        assert (await http.post("/finish_weight_update", json={})).status_code == 200
        assert [a.weights.version for a in agents] == [1, 1] and s.core.version == 1
        assert [op for op, _ in engines[0].calls] == ["init_weight_transfer", "start_weight_update", "update_weights",
                                                      "finish_weight_update"]
        async with AsyncRolloutClient(f"127.0.0.1:{s.grpc_port}", timeout_seconds=10) as client:
            result = await asyncio.wait_for(client.generate("s1", [(5, 6), (7, 8)], GREEDY, policy_version=1), 20)
        assert {x.policy_version for x in result.completions} == {1} and len(result.completions) == 2
    finally:
        await http.aclose()
        await stop_agents(agents, tasks)
        for engine in engines:
            await engine.shutdown()
        await s.stop(1.0)


async def test_an_answer_forged_by_another_worker_does_not_count():
    """fw-0 answers fw-1's call (its id) and one nobody asked: both dropped, fw-1 is still named."""
    s = await started(weight_transfer_timeout_seconds=1.0)
    target = f"127.0.0.1:{s.grpc_port}"
    c = await cluster_of(s, [FakeWorker(target, "fw-0"), FakeWorker(target, "fw-1", control=lambda _: FakeWorker.HOLD)])
    fw0, fw1 = by_id(c)["fw-0"], by_id(c)["fw-1"]
    try:
        pending = asyncio.create_task(c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}}))
        await wait_until(lambda: fw1.controls, what="fw-1 got init")
        for call_id in (fw1.controls[0].call_id, "c-nobody-asked"):
            fw0.send(control_result=pb.ControlResult(call_id=call_id, ok=True, json="{}"))
        refused(await pending, 500, "workers", "1 of 2", "worker fw-1: did not answer within 1s")
        assert set(c.scheduler.service.links) == {"fw-0", "fw-1"}, "both stay connected"
    finally:
        await close(c)
