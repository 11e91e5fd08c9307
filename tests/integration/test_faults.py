"""Faults injected mid-step on real runs: every completion delivered once and exact.

A subprocess worker (`bubblespec worker`, its own vLLM engine) dials the session scheduler
through a cuttable TCP proxy, so the tests can freeze it (SIGSTOP), throttle it (SIGSTOP/SIGCONT
duty cycle) and cut its network; the scheduler-restart test runs a second scheduler with a
Redis journal; the disconnect test drops the trainer's stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Self

import pytest

from bubblespec.client import AsyncRolloutClient, Prompt, SamplingParams, SchedulingPolicy
from bubblespec.scheduler.core.types import Assign, LoadPolicy
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.worker.agent import WorkerAgent, stop_agents
from bubblespec.worker.settings import WorkerSettings
from bubblespec.bench.tiny_model import perturb_weights
from tests.factories import generate_request, raw_generate, token_prompts
from tests.support.proxy import CuttableProxy

pytestmark = pytest.mark.vllm
WORKER = "sub-worker"
LONG = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)


@pytest.fixture(scope="module")
async def sub_worker(cluster, tiny_model, redis_server, tmp_path_factory):
    """A `bubblespec worker` process dialing the scheduler through a cuttable proxy."""
    proxy = await CuttableProxy("127.0.0.1", cluster.scheduler.grpc_port).start()
    log = tmp_path_factory.mktemp("sub") / "worker.log"
    cmd = [sys.executable, "-m", "bubblespec.cli.main", "worker", "--scheduler", f"127.0.0.1:{proxy.port}",
           "--worker-id", WORKER, "--model", tiny_model, "--max-model-len", "512", "--max-num-seqs", "16",
           "--num-speculative-tokens", "4", "--kv-cache-memory-bytes", str(128 * 2**20), "--metrics-port", "-1",
           "--redis-url", redis_server.url]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                            env=dict(os.environ, BUBBLESPEC_LOG_LEVEL="INFO"))
    handle = dataclasses.make_dataclass("Sub", ["proc", "proxy", "log"])(proc, proxy, log)
    await wait_for_worker(cluster, handle)
    yield handle
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    await proxy.close()


async def wait_for_worker(cluster, sub, timeout: float = 300) -> None:
    core = cluster.scheduler.core
    for _ in range(int(timeout * 10)):
        w = core.workers.get(WORKER)
        if w is not None and w.version == core.version and w.loading is None:
            return
        assert sub.proc.poll() is None, sub.log.read_text()[-3000:]
        await asyncio.sleep(0.1)
    raise AssertionError(f"{WORKER} did not join: {sub.log.read_text()[-3000:]}")


def _worker_timeout(cluster, seconds: float):
    """Declare silent workers dead after ``seconds`` (instead of 10) for the duration of a test.
    A worker starved of CPU can be silent for seconds: tests send it work only once it is back."""
    core = cluster.scheduler.core
    old = core.settings
    core.settings = dataclasses.replace(old, worker_timeout_seconds=seconds)
    yield
    core.settings = old


@pytest.fixture
def short_timeout(cluster):
    yield from _worker_timeout(cluster, 5.0)


@pytest.fixture
def patient_timeout(cluster):
    """Keep a throttled worker (silent up to a second at a time) connected whatever the load."""
    yield from _worker_timeout(cluster, 60.0)


def assert_exactly_once(msgs, prompts: int, n: int) -> list:
    comps = [m.completion for m in msgs if m.WhichOneof("event") == "completion"]
    keys = collections.Counter((c.prompt_id, c.sample_index) for c in comps)
    assert set(keys) == {(f"p{i}", s) for i in range(prompts) for s in range(n)}
    assert max(keys.values()) == 1, "a completion was returned twice"
    return comps


async def greedy_reference(client, ids, version) -> list[tuple[int, ...]]:
    ref = await client.generate(f"ref-{os.urandom(3).hex()}", ids, LONG, policy_version=version, drafts=False)
    return [c.token_ids for c in ref.completions]


def outputs(comps) -> list[tuple[int, ...]]:
    return [tuple(c.token_ids) for c in sorted(comps, key=lambda c: (int(c.prompt_id[1:]), c.sample_index))]


async def run_static_step(cluster, step_id: str, ids, drafts: bool = True) -> asyncio.Task:
    req = generate_request(step_id, ids, LONG, policy=SchedulingPolicy.STATIC, drafts=drafts,
                           policy_version=cluster.scheduler.core.version)
    return asyncio.create_task(raw_generate(cluster.target, req))


@contextlib.contextmanager
def on_first_assign(cluster, step_id: str, fault: Callable[[], None]):
    """Injects ``fault`` as the scheduler hands the sub worker its first request of ``step_id``,
    before the bytes go out, so the worker holds work it cannot finish. Waiting to see the worker
    running, then injecting it, lost the race to a worker that finished its share first."""
    service, fired = cluster.scheduler.service, []

    def listener(action) -> None:
        if (not fired and type(action) is Assign and action.worker_id == WORKER
                and action.request.step_id == step_id):
            fired.append(action)
            fault()

    service.listeners.append(listener)
    try:
        yield
    finally:
        service.listeners.remove(listener)
    assert fired, f"the sub worker was handed nothing of step {step_id!r}"


async def until(predicate, timeout: float = 120.0) -> None:
    for _ in range(int(timeout * 50)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


async def test_frozen_worker_declared_dead_then_rejoins_and_loads_policy_first(
        cluster, client, sub_worker, short_timeout, tiny_model, tmp_path):
    core, service = cluster.scheduler.core, cluster.scheduler.service
    ids = token_prompts(18, seed=501)
    expected = await greedy_reference(client, ids, core.version)
    await wait_for_worker(cluster, sub_worker)  # it must be there to be handed a share of the step
    try:
        with on_first_assign(cluster, "frozen", lambda: os.killpg(sub_worker.proc.pid, signal.SIGSTOP)):
            msgs = await asyncio.wait_for(await run_static_step(cluster, "frozen", ids), 300)
        comps = assert_exactly_once(msgs, 18, 1)
        assert outputs(comps) == expected
        assert WORKER not in core.workers
        # a new policy while it is frozen: when it comes back it must load it before any work
        v = core.version + 1
        assert await client.update_policy(v, str(perturb_weights(tiny_model, tmp_path / "v", scale=0.0, seed=0))) == 2
        seen: list = []
        service.listeners.append(lambda a: seen.append(a) if getattr(a, "worker_id", None) == WORKER else None)
    finally:
        os.killpg(sub_worker.proc.pid, signal.SIGCONT)
    await wait_for_worker(cluster, sub_worker)
    await client.generate("after-rejoin", token_prompts(12, seed=502), LONG, policy_version=v,
                          policy=SchedulingPolicy.STATIC)
    kinds = [type(a) for a in seen if isinstance(a, (LoadPolicy, Assign))]
    assert kinds and kinds[0] is LoadPolicy and Assign in kinds, kinds


async def test_network_cut_requeues_and_worker_comes_back(cluster, client, sub_worker, short_timeout):
    core = cluster.scheduler.core
    ids = token_prompts(18, seed=511)
    expected = await greedy_reference(client, ids, core.version)
    await wait_for_worker(cluster, sub_worker)
    try:
        with on_first_assign(cluster, "netcut", sub_worker.proxy.freeze):
            msgs = await asyncio.wait_for(await run_static_step(cluster, "netcut", ids, drafts=False), 300)
    finally:
        sub_worker.proxy.thaw()
    comps = assert_exactly_once(msgs, 18, 1)
    assert outputs(comps) == expected
    assert msgs[-1].summary.requests_requeued > 0
    await wait_for_worker(cluster, sub_worker)


class Throttle:
    """Runs a process group 1 part in 50 (SIGSTOP/SIGCONT) from a thread of its own: a stalled
    event loop in this process must not lengthen the group's running windows."""

    def __init__(self, pgid: int, stopped: float = 0.98, running: float = 0.02):
        self.pgid, self.stopped, self.running = pgid, stopped, running
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._cycle, daemon=True)

    def __enter__(self) -> Self:
        os.killpg(self.pgid, signal.SIGSTOP)  # before any work reaches it
        self._thread.start()
        return self

    def _cycle(self) -> None:
        while not self._done.wait(self.stopped):
            os.killpg(self.pgid, signal.SIGCONT)
            time.sleep(self.running)
            os.killpg(self.pgid, signal.SIGSTOP)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        os.killpg(self.pgid, signal.SIGCONT)


async def test_throttled_worker_has_its_queued_work_moved(cluster, client, sub_worker, patient_timeout):
    core = cluster.scheduler.core
    await wait_for_worker(cluster, sub_worker)
    ids = token_prompts(90, seed=521)  # 30 per worker, capacity 16 on the sub worker: 14 queue there
    expected = await greedy_reference(client, ids, core.version)
    # no drafts: the reference run above left history drafts that are all accepted, and with
    # them even a throttled worker keeps up and nothing needs moving
    with Throttle(sub_worker.proc.pid):  # the tiny model decodes a step in 1-2 ms: 1 part in 10 kept up
        task = await run_static_step(cluster, "throttled", ids, drafts=False)
        msgs = await asyncio.wait_for(task, 600)
    comps = assert_exactly_once(msgs, 90, 1)
    assert outputs(comps) == expected
    summary, per_worker = msgs[-1].summary, collections.Counter(c.worker_id for c in comps)
    assert summary.requests_moved > 0, f"straggler watch moved nothing off the slow worker: {per_worker}"
    assert per_worker[WORKER] <= 30 - summary.requests_moved, f"moved work went back to the slow worker: {per_worker}"


async def test_trainer_disconnect_cancels_the_step_and_frees_workers(cluster, sub_worker):
    core, service = cluster.scheduler.core, cluster.scheduler.service
    await wait_for_worker(cluster, sub_worker)
    service.orphan_grace_seconds, old = 1.0, service.orphan_grace_seconds
    try:
        req = generate_request("abandoned", token_prompts(24, seed=531), SamplingParams(
            temperature=0, max_tokens=400, ignore_eos=True), policy=SchedulingPolicy.STATIC,
            policy_version=core.version)
        # the sub worker stops as it is handed its share, so the step cannot end before the orphan
        # grace period does (the other workers' shares alone took about as long as the grace)
        with on_first_assign(cluster, "abandoned", lambda: os.killpg(sub_worker.proc.pid, signal.SIGSTOP)):
            call = asyncio.create_task(raw_generate(cluster.target, req))
            await until(lambda: any(w.running for w in core.workers.values()))
        call.cancel()  # the trainer goes away
        await until(lambda: core.steps["abandoned"].cancelled, timeout=30)
        await until(lambda: not any(k.startswith("abandoned/") for w in core.workers.values() for k in w.running),
                    timeout=10)
    finally:
        os.killpg(sub_worker.proc.pid, signal.SIGCONT)
        service.orphan_grace_seconds = old
    await wait_for_worker(cluster, sub_worker)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_scheduler_restart_sdk_resumes_with_each_completion_once(cluster, client, redis_server):
    port = _free_port()
    settings = SchedulerSettings(host="127.0.0.1", grpc_port=port, http_port=-1, redis_url=redis_server.url,
                                 journal_secret="restart-test-journal-secret")
    first = Scheduler(settings)
    await first.start()
    version = cluster.scheduler.core.version  # what the shared engines have loaded
    agents = [WorkerAgent(WorkerSettings(scheduler=f"127.0.0.1:{port}", worker_id=f"restart-{i}",
                                         policy_version=version, engine=cluster.engine_settings), engine)
              for i, engine in enumerate(cluster.engines)]
    runs = [asyncio.create_task(a.run()) for a in agents]
    ids = [Prompt(f"p{i}", token_ids=t, max_tokens=20 + 18 * i) for i, t in enumerate(token_prompts(16, seed=541))]
    expected = await greedy_reference(client, ids, version)  # staggered lengths: some finish first
    second = None
    try:
        await until(lambda: len(first.core.workers) == 2)
        assert first.core.version == version, "a fresh scheduler adopts the version its workers run"
        sdk = AsyncRolloutClient(f"127.0.0.1:{port}")  # default ClientSettings: 120 s retry budget
        gen = asyncio.create_task(sdk.generate("restarted", ids, LONG, n=2, policy_version=first.core.version))
        await until(lambda: "restarted" in first.core.steps and len(first.core.steps["restarted"].completions) >= 6)
        await first.stop(grace=0)  # the scheduler goes away mid-step
        second = Scheduler(settings)
        delivered = []
        second.service.listeners.append(lambda a: delivered.append(a) if type(a).__name__ == "Deliver" else None)
        await second.start()
        result = await asyncio.wait_for(gen, 300)
        await sdk.close()
    finally:
        await stop_agents(agents, runs)
        await first.stop(grace=0)
        if second is not None:
            await second.stop(grace=0)
    keys = collections.Counter((c.prompt_id, c.sample_index) for c in result.completions)
    assert len(keys) == 32 and max(keys.values()) == 1
    assert [c.token_ids for c in result.completions] == [e for e in expected for _ in range(2)]
    assert 0 < len(delivered) < 32, "the restarted scheduler should run only what was not delivered"


async def test_redis_unreachable_from_the_start_steps_stay_exact(cluster, client):
    from bubblespec.store import StoreSettings, open_store

    dead = StoreSettings(url=f"redis://127.0.0.1:{_free_port()}/0", op_timeout_seconds=0.2, retry_after_seconds=0.5)
    store = open_store(dead, resilient=True)
    sched = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=-1))
    await sched.start()
    version = cluster.scheduler.core.version
    agents = [WorkerAgent(WorkerSettings(scheduler=f"127.0.0.1:{sched.grpc_port}", worker_id=f"noredis-{i}",
                                         policy_version=version, engine=cluster.engine_settings), engine, store)
              for i, engine in enumerate(cluster.engines)]
    runs = [asyncio.create_task(a.run()) for a in agents]
    steps = [token_prompts(10, seed=551 + s) for s in range(3)]
    try:
        await until(lambda: len(sched.core.workers) == 2)
        async with AsyncRolloutClient(f"127.0.0.1:{sched.grpc_port}") as sdk:
            for s in range(2):
                got = await sdk.generate(f"noredis-{s}", steps[s], LONG, policy_version=version, lookahead=steps[s + 1])
                assert [c.token_ids for c in got.completions] == await greedy_reference(client, steps[s], version)
                assert got.summary.provenance.accepted("future") == 0
    finally:
        await stop_agents(agents, runs)
        await sched.stop(grace=0)
    assert not store.available and store.stats.errors > 0
