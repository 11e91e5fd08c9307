"""``POST /abort_weight_update``, ``/collective_rpc``'s refusals and ``/sleep`` ``/wake_up`` on
scripted workers (real scheduler, real HTTP and gRPC on loopback; ``tests/support/fake_worker.py``
records each ``ControlCall`` and answers as scripted).

Before: none of these routes existed (404); an update a trainer opened and never finished kept
the barrier open until the scheduler restarted.
"""

from __future__ import annotations

import asyncio
import json

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.client import AsyncRolloutClient
from bubblespec.scheduler.core.types import PolicyFailed
from tests.integration.test_weight_transfer import GREEDY, INIT, UPDATE, close, cluster_of, fakes, refused, started
from tests.support.fake_worker import FakeWorker, wait_until

OP = pb.ControlOp.Name


async def test_abort_rolls_back_an_open_update_and_a_new_one_then_runs_requests():
    s = await started()
    c = await cluster_of(s, fakes(s))
    try:
        refused(await c.post("/abort_weight_update"), 409, "request", "no weight update is in progress")
        assert (await c.post("/init_weight_transfer_engine", {"init_info": INIT})).status_code == 200
        assert (await c.post("/start_weight_update")).status_code == 200
        assert (await c.post("/update_weights", {"update_info": UPDATE})).status_code == 200
        refused(await c.post("/abort_weight_update", {"why": "x"}), 400, "why", "takes no fields")
        r = await c.post("/abort_weight_update")
        assert r.status_code == 200 and r.json() == {"message": "Weight update aborted"}, r.text
        failed = [a for a in c.actions if isinstance(a, PolicyFailed)]
        assert len(failed) == 1 and "aborted (POST /abort_weight_update)" in failed[0].message
        assert c.core.version == 0 and s.service.transfer.updating is None and s.service.transfer.unclosed == set()
        for w in c.workers:  # each engine closed the update it held open
            assert c.ops(w)[-1] == "CONTROL_OP_ABORT_WEIGHT_UPDATE"
            assert c.core.workers[w.worker_id].version == -1  # weights partly replaced: serves nothing
        refused(await c.post("/finish_weight_update", {}), 409, "weight_version", "was aborted")
        refused(await c.post("/abort_weight_update"), 409, "request", "no weight update is in progress")
        await c.transfer("after-abort")
        assert c.core.version == 1 and {c.core.workers[w.worker_id].version for w in c.workers} == {1}
        async with AsyncRolloutClient(c.target(), timeout_seconds=10) as client:
            result = await asyncio.wait_for(client.generate("s1", [(5, 6), (7, 8)], GREEDY, policy_version=1), 20)
        assert {x.policy_version for x in result.completions} == {1} and len(result.completions) == 2
    finally:
        await close(c)


async def test_a_worker_that_cannot_close_the_rolled_back_update_is_closed_before_the_next_start():
    s = await started()
    target = f"127.0.0.1:{s.grpc_port}"
    refusing = {"on": True}

    def control(call: pb.ControlCall):
        if call.op == pb.CONTROL_OP_ABORT_WEIGHT_UPDATE and refusing["on"]:
            return "engine busy"
        return None

    c = await cluster_of(s, [FakeWorker(target, "fw-0"), FakeWorker(target, "fw-1", control=control)])
    try:
        assert (await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}})).status_code == 200
        assert (await c.post("/start_weight_update")).status_code == 200
        refused(await c.post("/abort_weight_update"), 500, "workers", "the update is rolled back",
                "worker fw-1: engine busy")
        assert c.core.version == 0 and s.service.transfer.updating is None
        assert s.service.transfer.unclosed == {"fw-1"}
        refused(await c.post("/start_weight_update"), 500, "workers", "closing the update rolled back before",
                "worker fw-1: engine busy")
        assert s.service.transfer.updating is None  # nothing started
        refusing["on"] = False
        await c.transfer()  # closes fw-1's, then start -> update -> finish
        assert s.service.transfer.unclosed == set() and c.core.version == 1
        fw1 = [w for w in c.workers if w.worker_id == "fw-1"][0]
        assert c.ops(fw1)[-4:] == ["CONTROL_OP_ABORT_WEIGHT_UPDATE", "CONTROL_OP_START_WEIGHT_UPDATE",
                                   "CONTROL_OP_UPDATE_WEIGHTS", "CONTROL_OP_FINISH_WEIGHT_UPDATE"]
    finally:
        await close(c)


async def test_a_plain_start_outliving_its_deadline_is_rolled_back():
    s = await started(weight_update_deadline_seconds=1.0)
    c = await cluster_of(s, fakes(s, n=2))
    try:
        assert (await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}})).status_code == 200
        assert (await c.post("/start_weight_update")).status_code == 200
        await wait_until(lambda: any(isinstance(a, PolicyFailed) for a in c.actions), timeout=10, what="rollback")
        await wait_until(lambda: all(c.ops(w)[-1] == "CONTROL_OP_ABORT_WEIGHT_UPDATE" for w in c.workers),
                         what="closed on every worker")
        refused(await c.post("/update_weights", {"update_info": UPDATE}), 409, "update_info", "not finished within 1s")
        await c.transfer()
        assert c.core.version == 1
    finally:
        await close(c)


async def test_collective_rpc_refuses_every_other_method_and_bad_arguments_by_name():
    s = await started()
    c = await cluster_of(s, fakes(s, n=2))
    try:
        for body, param, words in (
                ({"method": "reload_weights"}, "method", "'reload_weights' is not served"),
                ({}, "method", "None is not served"),
                ({"method": "update_weights_nccl", "kwargs": {"update_info": UPDATE, "x": 1}}, "kwargs.x", "takes no"),
                ({"method": "skyrl_finish_weight_update", "args": ["a"]}, "args", "as kwargs"),
                ({"method": "skyrl_finish_weight_update", "timeout": -1}, "timeout", "> 0"),
                ({"method": "skyrl_finish_weight_update", "extra": 1}, "extra", "not a field")):
            refused(await c.post("/collective_rpc", body), 400, param, *words)
        refused(await c.post("/collective_rpc", {"method": "skyrl_start_weight_update"}), 409, "init_info",
                "/init_weight_transfer_engine first")
        assert all(c.ops(w) == [] for w in c.workers), "nothing was sent"
        assert (await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}})).status_code == 200
        r = await c.post("/collective_rpc", {"method": "skyrl_start_weight_update", "kwargs": {}, "timeout": 5})
        assert r.status_code == 200 and r.json() == {"results": [None, None]}, r.text
        r = await c.post("/collective_rpc", {"method": "update_weights_nccl", "kwargs": {"update_info": UPDATE}})
        assert r.status_code == 200, r.text
        assert json.loads(c.workers[0].controls[-1].json) == {"update_info": UPDATE}
        assert (await c.post("/collective_rpc", {"method": "skyrl_finish_weight_update"})).status_code == 200
        assert c.core.version == 1
    finally:
        await close(c)


async def test_sleep_stops_dispatch_level_2_forgets_weights_and_wake_up_resumes():
    s = await started()
    c = await cluster_of(s, fakes(s, n=2, control=lambda call: {"fully_awake": True}
                                  if call.op == pb.CONTROL_OP_WAKE_UP else None))
    try:
        for query, param in (("level=3", "level"), ("level=x", "level"), ("mode=later", "mode"), ("tags=weights", "tags")):
            refused(await c.http.post(f"/sleep?{query}"), 400, param)
        refused(await c.http.post("/wake_up?tags=gpu"), 400, "tags", "weights, kv_cache, scheduling")
        r = await c.http.post("/sleep?level=2")
        assert r.status_code == 200 and r.json() == {"status": "sleeping", "level": 2}, r.text
        for w in c.workers:
            assert c.ops(w) == ["CONTROL_OP_SLEEP"] and json.loads(w.controls[0].json) == {"level": 2}
        assert (await c.http.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert {w.version for w in c.core.workers.values()} == {-1}  # level 2 discarded the weights
        refused(await c.http.post("/resume"), 409, "request", "asleep")
        assert (await c.post("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 3}})).status_code == 200
        await c.transfer()  # SkyRL's order: weights synced while asleep
        assert c.core.version == 1 and all(w.asleep for w in c.core.workers.values())
        r = await c.http.post("/wake_up")
        assert r.status_code == 200 and r.json() == {"status": "awake", "tags": None}, r.text
        assert (await c.http.get("/is_sleeping")).json() == {"is_sleeping": False} and not c.core.paused
        async with AsyncRolloutClient(c.target(), timeout_seconds=10) as client:
            result = await asyncio.wait_for(client.generate("s1", [(5, 6)], GREEDY, policy_version=1), 20)
        assert [x.policy_version for x in result.completions] == [1]
    finally:
        await close(c)
