"""The `bubblespec scheduler` process crashes or freezes under a running step, with default settings.

Real parts: the scheduler is a `bubblespec scheduler` subprocess (gRPC on loopback, its journal in
the session's redis-server), the workers are `WorkerAgent`s driving the session's vLLM engines,
the trainer is the SDK with default `ClientSettings`.

- SIGKILL mid-step, a new process on the same port and Redis 8 s later: `generate` returns every
  completion once, token-identical to a greedy run made before the crash.
- SIGSTOP mid-step (the process is alive, its sockets open, nothing answers): keepalive pings
  show the trainer's stream and every worker's stream broken within seconds, not at the deadline;
  after SIGCONT the cluster serves again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bubblespec.client import AsyncRolloutClient, ClientSettings, Prompt, Retry, SamplingParams, ServiceUnavailable
from bubblespec.worker.agent import WorkerAgent, stop_agents
from bubblespec.worker.settings import WorkerSettings
from tests.factories import token_prompts

pytestmark = pytest.mark.vllm
GREEDY = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(predicate, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not (await predicate() if asyncio.iscoroutinefunction(predicate) else predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout:.0f} s")
        await asyncio.sleep(0.05)


class SchedulerProcess:
    """`bubblespec scheduler` on a fixed loopback port (so a restart is found at the same address)."""

    def __init__(self, log: Path, redis_url: str = ""):
        self.port = _free_port()
        self.log = log
        self.redis_url = redis_url
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "bubblespec.cli.main", "scheduler", "--host", "127.0.0.1",
               "--grpc-port", str(self.port), "--http-port", "-1", "--redis-url", self.redis_url]
        env = dict(os.environ, BUBBLESPEC_JOURNAL_SECRET="restart-process-journal-secret", BUBBLESPEC_LOG_LEVEL="INFO")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=log, env=env)

    def signal(self, sig: int) -> None:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()


def staggered_prompts(count: int, seed: int) -> list[Prompt]:
    """Lengths 40, 64, ... 400 tokens: the short ones finish long before the long ones."""
    return [Prompt(f"p{i}", token_ids=t, max_tokens=40 + 24 * i) for i, t in enumerate(token_prompts(count, seed=seed))]


def start_agents(cluster, target: str, name: str) -> tuple[list[WorkerAgent], list[asyncio.Task]]:
    """Real vLLM workers (the session's engines) with default reconnect and keepalive settings."""
    version = cluster.scheduler.core.version  # what the shared engines have loaded
    agents = [WorkerAgent(WorkerSettings(scheduler=target, worker_id=f"{name}-{i}", policy_version=version,
                                         engine=cluster.engine_settings), engine)
              for i, engine in enumerate(cluster.engines)]
    return agents, [asyncio.create_task(a.run()) for a in agents]


async def workers_joined(sdk: AsyncRolloutClient, count: int) -> None:
    async def joined() -> bool:
        return len((await sdk.status())["workers"]) >= count
    await until(joined, what=f"{count} workers joined")


async def _journaled_completions(redis_url: str, step_id: str) -> int:
    """Completions of ``step_id`` in the scheduler's journal (its step hash, less the fingerprint)."""
    import redis.asyncio as aioredis

    r = aioredis.from_url(redis_url)
    try:
        keys = [k async for k in r.scan_iter(match=f"*step:{step_id}")]
        return sum([max(0, await r.hlen(k) - 1) for k in keys])
    finally:
        await r.aclose()


async def _crash_mid_step(sdk: AsyncRolloutClient, sched: SchedulerProcess, redis_url: str, step_id: str,
                          prompts: list[Prompt], version: int):
    """Run ``step_id``, SIGKILL the scheduler once a completion of it is in the journal, restart
    it 8 s later; return (completions the trainer had at the kill, the step's result)."""
    seen: list[int] = []
    # drafts off: history drafts of "before-crash" (the same prompts) would finish the step in a
    # blink, before the kill lands
    gen = asyncio.create_task(sdk.generate(step_id, prompts, GREEDY, n=2, policy_version=version, drafts=False,
                                           on_progress=lambda done, total: seen.append(done)))
    await until(lambda: len(seen) >= 6 or gen.done(), what="six completions")
    journaled = await _journaled_completions(redis_url, step_id)
    while journaled < 1 and not gen.done():
        await asyncio.sleep(0.02)
        journaled = await _journaled_completions(redis_url, step_id)
    sched.signal(signal.SIGKILL)  # mid-step, no goodbye: sockets reset, queued journal writes lost
    at_crash = len(seen)
    sched.proc.wait()
    await asyncio.sleep(8)  # the scenario: the scheduler is away for 8 s
    sched.start()
    return at_crash, await asyncio.wait_for(gen, 300)


async def test_scheduler_sigkill_and_restart_with_default_settings(cluster, redis_server, tmp_path):
    redis_url = redis_server.url.rsplit("/", 1)[0] + "/7"  # a database of its own: a fresh journal
    sched = SchedulerProcess(tmp_path / "scheduler.log", redis_url)
    sched.start()
    agents, runs = start_agents(cluster, sched.target, "sigkill")
    version = cluster.scheduler.core.version
    prompts = staggered_prompts(16, seed=561)
    try:
        async with AsyncRolloutClient(sched.target) as sdk:  # default ClientSettings
            await workers_joined(sdk, len(agents))
            before = await sdk.generate("before-crash", prompts, GREEDY, policy_version=version, drafts=False)
            expected = [c.token_ids for c in before.completions]
            # The kill must land mid-step, after at least one completion of the step reached the
            # journal (its writes are asynchronous and batched). On a loaded machine the step can
            # end first; that attempt tests nothing, so the scenario runs again under a new step id.
            for attempt in range(3):
                step_id = f"crash-{attempt}"
                at_crash, result = await _crash_mid_step(sdk, sched, redis_url, step_id, prompts, version)
                if at_crash < 32:
                    break
    finally:
        await stop_agents(agents, runs)
        sched.kill()
    assert at_crash < 32, "every attempt's step finished before the crash: nothing was tested"
    keys = collections.Counter((c.prompt_id, c.sample_index) for c in result.completions)
    assert len(keys) == 32 and max(keys.values()) == 1
    assert [c.token_ids for c in result.completions] == [e for e in expected for _ in range(2)]
    assert all(c.policy_version == version for c in result.completions)
    resumed = re.findall(rf"step {step_id} resumed from the journal: (\d+)", sched.log.read_text())
    assert resumed and 0 < int(resumed[-1]) < 32, "the restarted scheduler should replay the journal, run the rest"


async def test_silent_scheduler_is_noticed_by_trainer_and_workers_within_seconds(cluster, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="bubblespec.worker.link")
    sched = SchedulerProcess(tmp_path / "scheduler.log")
    sched.start()
    agents, runs = start_agents(cluster, sched.target, "sigstop")
    version = cluster.scheduler.core.version
    prompts = staggered_prompts(16, seed=571)
    # no retries: the first error shows when the SDK noticed; default keepalive settings
    impatient = ClientSettings(target=sched.target, retry=Retry(attempts=1))
    got: list = []

    async def consume(sdk: AsyncRolloutClient) -> None:
        async for c in sdk.stream("frozen", prompts, GREEDY, policy_version=version):
            got.append(c)

    def broke(agent: WorkerAgent) -> bool:
        return any(agent.worker_id in r.getMessage() and "stream broke" in r.getMessage() for r in caplog.records)

    try:
        async with AsyncRolloutClient(settings=impatient) as sdk:
            await workers_joined(sdk, len(agents))
            task = asyncio.create_task(consume(sdk))
            await until(lambda: got or task.done(), what="a first completion")
            caplog.clear()
            sched.signal(signal.SIGSTOP)  # alive, sockets open, silent
            stopped = time.monotonic()
            with pytest.raises(ServiceUnavailable):
                await asyncio.wait_for(task, 30)  # the step's deadline is an hour away
            trainer_noticed = time.monotonic() - stopped
            await until(lambda: all(broke(a) for a in agents), timeout=30, what="every worker noticed")
            workers_noticed = time.monotonic() - stopped
            assert len(got) < len(prompts), "the step finished before the freeze: nothing was tested"
            sched.signal(signal.SIGCONT)
        async with AsyncRolloutClient(sched.target) as sdk:  # awake again: serves with default settings
            await workers_joined(sdk, len(agents))
            again = await sdk.generate("thawed", prompts[:4], GREEDY, policy_version=version)
    finally:
        await stop_agents(agents, runs)
        sched.kill()
    assert trainer_noticed < 30 and workers_noticed < 30, (trainer_noticed, workers_noticed)
    assert [c.prompt_id for c in again.completions] == ["p0", "p1", "p2", "p3"]
    before_freeze = {c.prompt_id: c.token_ids for c in got}
    assert all(c.token_ids == before_freeze[c.prompt_id] for c in again.completions if c.prompt_id in before_freeze)
