"""vLLM's LoRA routes on the scheduler (``scheduler/lora_api.py``), fanned out to every worker.

Real scheduler, real HTTP and real gRPC on loopback; the workers are scripted
(``tests/support/fake_worker.py``), so the fan-out, the versions, the barrier and a failed
load's undo are seen call by call, without engines. ``test_lora.py`` runs real vLLM engines.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx

from bubblespec.api.v1 import rollout_pb2 as pb
from tests.integration.test_weight_transfer import OP, close, cluster_of, fakes, refused, server_info, started
from tests.support.fake_worker import FakeWorker, wait_until

ADAPTER = {"lora_name": "math", "lora_path": "/adapters/math"}


def lora_calls(worker: FakeWorker) -> list[tuple[str, dict]]:
    return [(OP(c.op), json.loads(c.json)) for c in worker.controls
            if c.op in (pb.CONTROL_OP_LOAD_LORA_ADAPTER, pb.CONTROL_OP_UNLOAD_LORA_ADAPTER)]


async def complete(c, model: str, **extra) -> httpx.Response:
    return await c.post("/v1/completions", {"model": model, "prompt": [5, 6, 7], "max_tokens": 3,
                                            "temperature": 0, **extra})


async def test_load_fans_out_versions_each_load_and_requests_run_with_the_adapter():
    s = await started()
    c = await cluster_of(s, fakes(s, 2))
    try:
        r = await c.post("/v1/load_lora_adapter", ADAPTER)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'math' added successfully."
        for w in c.workers:
            assert lora_calls(w) == [("CONTROL_OP_LOAD_LORA_ADAPTER", {**ADAPTER, "version": 1, "lora_int_id": 1})]
        models = (await c.http.get("/v1/models")).json()["data"]
        base = models[0]["id"]
        assert [(m["id"], m["parent"], m["root"]) for m in models[1:]] == [("math", base, "/adapters/math")]
        r = await complete(c, "math")
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "math" and r.headers["X-BubbleSpec-Adapter-Version"] == "1"
        sent = [a for w in c.workers for a in w.answered]
        assert len(sent) == 1
        assignment = next(m.assign for w in c.workers for m in w.received if m.WhichOneof("kind") == "assign")
        assert (assignment.adapter, assignment.adapter_version) == ("math", 1)
        r = await complete(c, base)
        assert r.status_code == 200 and "X-BubbleSpec-Adapter-Version" not in r.headers
        # vLLM: a loaded name reloads only in place; each reload is the next version, with a new engine id
        refused(await c.post("/v1/load_lora_adapter", ADAPTER), 400, "lora_name", "already been loaded")
        r = await c.post("/v1/load_lora_adapter", {**ADAPTER, "lora_path": "/adapters/math2", "load_inplace": True})
        assert r.status_code == 200, r.text
        assert lora_calls(c.workers[0])[-1] == ("CONTROL_OP_LOAD_LORA_ADAPTER", {
            "lora_name": "math", "lora_path": "/adapters/math2", "version": 2, "lora_int_id": 2})
        r = await complete(c, "math")
        assert r.status_code == 200 and r.headers["X-BubbleSpec-Adapter-Version"] == "2"
    finally:
        await close(c)


async def test_bad_loads_are_refused_by_field_as_vllm_and_nothing_is_sent():
    s = await started()
    c = await cluster_of(s, fakes(s, 1))
    try:
        base = (await c.http.get("/v1/models")).json()["data"][0]["id"]
        refused(await c.post("/v1/load_lora_adapter", {"lora_name": "x"}), 400, "lora_name",
                "Both 'lora_name' and 'lora_path' must be provided")
        refused(await c.post("/v1/load_lora_adapter", {"lora_name": base, "lora_path": "/p"}), 400, "lora_name",
                "conflicts with a served base model")
        refused(await c.post("/v1/load_lora_adapter", {**ADAPTER, "load_inplace": "yes"}), 400, "load_inplace")
        refused(await c.post("/v1/load_lora_adapter", {**ADAPTER, "is_3d_lora_weight": True}), 400,
                "is_3d_lora_weight", "not served")
        refused(await c.post("/v1/load_lora_adapter", {**ADAPTER, "lora_rank": 8}), 400, "lora_rank")
        refused(await c.post("/v1/unload_lora_adapter", {"lora_name": "math"}), 404, "lora_name", "cannot be found")
        refused(await c.post("/v1/unload_lora_adapter", {}), 400, "lora_name", "needs to be provided")
        assert lora_calls(c.workers[0]) == []
        refused(await complete(c, "math"), 404, "model", "The model `math` does not exist.")
    finally:
        await close(c)


async def test_a_load_that_fails_on_one_worker_is_undone_on_the_others_and_names_it():
    s = await started()
    failing = {"fw-1"}
    why = ["ValueError: the adapter's rank 64 is larger than max_lora_rank 16"]
    workers = fakes(s, 3)
    for w in workers:
        w.control = lambda call, wid=w.worker_id: (
            why[0] if call.op == pb.CONTROL_OP_LOAD_LORA_ADAPTER and wid in failing else None)
    c = await cluster_of(s, workers)
    try:
        r = await c.post("/v1/load_lora_adapter", ADAPTER)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["param"] == "workers" and "worker fw-1: ValueError: the adapter's rank 64" in err["message"]
        assert "failed on 1 of 3 worker(s)" in err["message"] and "served on no worker" in err["message"]
        for w in c.workers:  # the ones that took it dropped that version again
            expected = [("CONTROL_OP_LOAD_LORA_ADAPTER", {**ADAPTER, "version": 1, "lora_int_id": 1})]
            if w.worker_id not in failing:
                expected.append(("CONTROL_OP_UNLOAD_LORA_ADAPTER", {"lora_name": "math", "version": 1}))
            assert lora_calls(w) == expected, w.worker_id
        assert [m["id"] for m in (await c.http.get("/v1/models")).json()["data"][1:]] == []
        refused(await complete(c, "math"), 404, "model")
        why[0] = "lora_path: '/adapters/math' is not a directory on this worker"  # 404 naming the path, as
        failing.update({"fw-0", "fw-2"})  # vLLM's LoRAAdapterNotFoundError
        refused(await c.post("/v1/load_lora_adapter", ADAPTER), 404, "lora_path", "failed on 3 of 3 worker(s)",
                "worker fw-0: lora_path: '/adapters/math' is not a directory")
        failing.clear()
        r = await c.post("/v1/load_lora_adapter", ADAPTER)
        assert r.status_code == 200, r.text
        assert json.loads(c.workers[0].controls[-1].json)["version"] == 1  # failed loads used no version
    finally:
        await close(c)


def holding_loads(hold: asyncio.Event, held: list):
    """A scripted worker's control answer: adapter loads are held (and kept in ``held``) while
    ``hold`` is clear; everything else is answered at once."""
    def control(call: pb.ControlCall):
        if call.op == pb.CONTROL_OP_LOAD_LORA_ADAPTER and not hold.is_set():
            held.append(call)
            return FakeWorker.HOLD
        return None
    return control


async def test_while_an_adapter_loads_its_requests_wait_and_the_base_models_go_on():
    s = await started()
    hold = asyncio.Event()
    hold.set()  # the first load is answered at once
    held: list[pb.ControlCall] = []

    control = holding_loads(hold, held)

    c = await cluster_of(s, fakes(s, 1, control=control))
    try:
        assert (await c.post("/v1/load_lora_adapter", ADAPTER)).status_code == 200
        hold.clear()
        reload = asyncio.create_task(c.post("/v1/load_lora_adapter", {**ADAPTER, "load_inplace": True}))
        await wait_until(lambda: len(held) == 1, what="the reload reached the worker")
        waiting = asyncio.create_task(complete(c, "math"))
        base = (await c.http.get("/v1/models")).json()["data"][0]["id"]
        r = await complete(c, base)  # the base model's requests go on
        assert r.status_code == 200 and not waiting.done()
        hold.set()
        c.workers[0].send(control_result=pb.ControlResult(call_id=held[0].call_id, ok=True, json="{}"))
        assert (await reload).status_code == 200
        r = await waiting
        assert r.status_code == 200 and r.headers["X-BubbleSpec-Adapter-Version"] == "2"
    finally:
        await close(c)


async def test_unload_drops_it_everywhere_and_refuses_later_requests():
    s = await started()
    c = await cluster_of(s, fakes(s, 1))
    try:
        assert (await c.post("/v1/load_lora_adapter", ADAPTER)).status_code == 200
        assert (await complete(c, "math")).status_code == 200
        r = await c.post("/v1/unload_lora_adapter", {"lora_name": "math"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'math' removed successfully."
        assert lora_calls(c.workers[0])[-1] == ("CONTROL_OP_UNLOAD_LORA_ADAPTER", {"lora_name": "math", "version": None})
        refused(await complete(c, "math"), 404, "model", "does not exist")
        assert [m["id"] for m in (await c.http.get("/v1/models")).json()["data"][1:]] == []
    finally:
        await close(c)


async def test_a_worker_that_joins_after_a_load_loads_every_adapter_first_and_only_then_takes_its_requests():
    s = await started()
    c = await cluster_of(s, fakes(s, 1))
    hold = asyncio.Event()
    held: list[pb.ControlCall] = []

    control = holding_loads(hold, held)

    try:
        assert (await c.post("/v1/load_lora_adapter", ADAPTER)).status_code == 200
        r = await c.post("/v1/load_lora_adapter", {**ADAPTER, "lora_path": "/adapters/math2", "load_inplace": True})
        assert r.status_code == 200, r.text
        other = {"lora_name": "code", "lora_path": "/adapters/code"}
        assert (await c.post("/v1/load_lora_adapter", other)).status_code == 200
        late = FakeWorker(f"127.0.0.1:{s.grpc_port}", "late", control=control)
        await late.start()
        c.workers.append(late)
        await wait_until(lambda: len(held) == 1, what="the late worker was asked to load the first adapter")
        # one adapter at a time, each at its current version and engine id
        assert lora_calls(late) == [("CONTROL_OP_LOAD_LORA_ADAPTER", {"lora_name": "code", "lora_path": "/adapters/code",
                                                                      "version": 1, "lora_int_id": 3})]
        for _ in range(4):  # while it loads, the adapter's requests go to the worker that holds it
            assert (await complete(c, "code")).status_code == 200
        assert late.answered == [] and len(c.workers[0].answered) == 4
        hold.set()
        late.send(control_result=pb.ControlResult(call_id=held[0].call_id, ok=True, json="{}"))
        await wait_until(lambda: len(lora_calls(late)) == 2, what="the late worker loaded the second adapter")
        assert lora_calls(late)[1] == ("CONTROL_OP_LOAD_LORA_ADAPTER", {
            "lora_name": "math", "lora_path": "/adapters/math2", "version": 2, "lora_int_id": 2})
        await wait_until(lambda: s.core.adapters.holds("late", ("math", 2)), what="the late worker holds math v2")
        await c.workers[0].stop()  # the worker that held them from the start leaves: the late one serves both
        c.workers.remove(c.workers[0])
        await wait_until(lambda: set(s.core.workers) == {"late"}, what="the first worker gone")
        for model, version in (("math", "2"), ("code", "1")):
            r = await complete(c, model)
            assert r.status_code == 200 and r.headers["X-BubbleSpec-Adapter-Version"] == version, r.text
        assert len(late.answered) == 2
    finally:
        await close(c)


async def test_a_load_that_fails_when_a_worker_joins_is_an_error_and_that_worker_never_runs_the_adapter(caplog):
    s = await started()
    c = await cluster_of(s, fakes(s, 1))
    why = "ValueError: LoRA is not enabled on this worker's engine"
    try:
        assert (await c.post("/v1/load_lora_adapter", ADAPTER)).status_code == 200
        late = FakeWorker(f"127.0.0.1:{s.grpc_port}", "late",
                          control=lambda call: why if call.op == pb.CONTROL_OP_LOAD_LORA_ADAPTER else None)
        with caplog.at_level("ERROR", logger="bubblespec.scheduler.lora_api"):
            await late.start()
            c.workers.append(late)
            await wait_until(lambda: "late" in s.core.adapters.served["math"].failed, what="the failed load recorded")
        assert any("worker late could not load LoRA adapter 'math' version 1" in r.getMessage() and why in r.getMessage()
                   for r in caplog.records), caplog.text
        for _ in range(3):
            assert (await complete(c, "math")).status_code == 200
        assert late.answered == [] and len(c.workers[0].answered) == 3
        assert (await complete(c, (await c.http.get("/v1/models")).json()["data"][0]["id"])).status_code == 200
        await c.workers[0].stop()  # the only worker that holds it leaves: no worker can serve the adapter
        c.workers.remove(c.workers[0])
        await wait_until(lambda: set(s.core.workers) == {"late"}, what="the first worker gone")
        refused(await complete(c, "math"), 503, "model", "no connected worker holds adapter 'math' version 1",
                f"worker late could not load it: {why}")
        assert late.answered == []
    finally:
        await close(c)


LORA_CONFIG = {"max_lora_rank": 16, "max_loras": 4, "fully_sharded_loras": False, "max_cpu_loras": 4,
               "lora_dtype": "torch.float32", "target_modules": None, "default_mm_loras": None,
               "enable_tower_connector_lora": False, "specialize_active_lora": False,
               "enable_mixed_moe_lora_format": False, "enable_moe_shared_loras": False, "max_lora_cls_labels": None}
"""vLLM 0.32's dump of ``LoRAConfig(max_lora_rank=16, max_loras=4)`` on a float32 model (what its
``/server_info`` answers; ``test_lora.py`` compares a real engine's with the scheduler's)."""


def lora_worker(s, worker_id: str, config: dict | None | str, **kw) -> FakeWorker:
    text = config if isinstance(config, str) else json.dumps(config) if config is not None else ""
    hello = pb.Hello(worker_id=worker_id, capacity=4, max_model_len=512, vocab_size=128, model="fake",
                     lora_config=text)
    return FakeWorker(f"127.0.0.1:{s.grpc_port}", worker_id, first=pb.WorkerMessage(hello=hello), **kw)


async def test_server_info_reports_the_workers_lora_config_only_where_every_worker_runs_with_lora():
    s = await started()
    small = {**LORA_CONFIG, "max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 3}
    c = await cluster_of(s, [lora_worker(s, "a", LORA_CONFIG), lora_worker(s, "b", small)])
    try:
        # every worker with LoRA on: vLLM's dump, each capacity the smallest (a load must fit every worker)
        assert (await server_info(c))["lora_config"] == {**LORA_CONFIG, "max_lora_rank": 8, "max_loras": 2,
                                                         "max_cpu_loras": 3}
        r = await c.http.get("/server_info")  # vLLM's default, text, carries it too
        assert "'max_lora_rank': 8" in r.json()["vllm_config"]
        plain = lora_worker(s, "plain", None)  # a worker without --enable-lora: adapters cannot load everywhere
        await plain.start()
        c.workers.append(plain)
        await wait_until(lambda: "plain" in s.service.links, what="the plain worker connected")
        assert (await server_info(c))["lora_config"] is None
        await plain.stop()
        c.workers.remove(plain)
        await wait_until(lambda: "plain" not in s.service.links, what="the plain worker gone")
        assert (await server_info(c))["lora_config"]["max_lora_rank"] == 8
        for bad, why in (("[1]", "must be a JSON object"), ("{", "not JSON"), ("x" * 9000, "over 8192 characters")):
            async with lora_worker(s, "bad", bad, heartbeat_seconds=0) as w:
                err = await w.closed()
            assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert "hello.lora_config" in err.details() and why in err.details(), err.details()
        assert set(s.service.links) == {"a", "b"}
    finally:
        await close(c)
