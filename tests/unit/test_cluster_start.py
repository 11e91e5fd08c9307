"""``Cluster.start`` (``up``, ``demo``, ``bench``) starts its engines at the same time, and when one
of them fails, shuts down every engine that did start and stops the scheduler before raising;
``Cluster.stop`` (and that clean-up) shuts the engines down at the same time too.

A real scheduler (gRPC and HTTP on loopback); the engines are stand-ins built by the
``engine_factory`` seam, so the order of starts and shutdowns is visible without vLLM.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from bubblespec.cli.commands import Cluster
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.worker.engine import EngineInfo, EngineSettings

WORKERS = 3


class StandIn:
    """Records its life; ``start`` waits until every stand-in of the cluster is starting, and
    ``shutdown`` until every one is shutting down."""

    def __init__(self, index: int, settings: EngineSettings, log: list, all_starting: asyncio.Event,
                 all_stopping: asyncio.Event, fail: bool):
        self.index = index
        self.settings = settings
        self.log = log
        self.all_starting = all_starting
        self.all_stopping = all_stopping
        self.fail = fail
        self.started = False
        self.info = EngineInfo("stand-in", 1024, 128, False)
        self.dead = False

    async def start(self) -> None:
        self.log.append(("starting", self.index))
        if sum(1 for event, _ in self.log if event == "starting") == WORKERS:
            self.all_starting.set()
        # a serial start never gets here for the first engine: the guard turns that into a failure
        await asyncio.wait_for(self.all_starting.wait(), 30)
        if self.fail:
            raise RuntimeError("engine failed to start")
        await asyncio.sleep(0.05)  # the others finish after the failure was raised
        self.started = True
        self.log.append(("started", self.index))

    async def shutdown(self) -> None:
        self.log.append(("shutdown", self.index, self.started))
        if sum(1 for e in self.log if e[0] == "shutdown") == WORKERS:
            self.all_stopping.set()
        await asyncio.wait_for(self.all_stopping.wait(), 30)  # every engine shuts down at the same time
        self.started = False


def cluster(fail_index: int | None, log: list, lines: list) -> Cluster:
    all_starting, all_stopping = asyncio.Event(), asyncio.Event()
    built = []

    def factory(settings: EngineSettings) -> StandIn:
        engine = StandIn(len(built), settings, log, all_starting, all_stopping, fail=len(built) == fail_index)
        built.append(engine)
        return engine

    settings = SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0)
    return Cluster(settings, EngineSettings(model="stand-in", self_checks=False), WORKERS, engine_factory=factory,
                   progress=lines.append)


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


async def test_engines_start_at_once_and_a_failure_shuts_down_every_started_one():
    log: list = []
    lines: list[str] = []
    c = cluster(fail_index=1, log=log, lines=lines)
    with pytest.raises(RuntimeError, match="engine failed to start"):
        await c.start()
    starts = [i for i, e in enumerate(log) if e[0] == "starting"]
    assert len(starts) == WORKERS and max(starts) < min(i for i, e in enumerate(log) if e[0] != "starting")
    started = {e[1] for e in log if e[0] == "started"}
    assert len(started) == WORKERS - 1  # the others finished starting although one had failed ...
    shut = {e[1] for e in log if e[0] == "shutdown" and e[2]}
    assert shut == started  # ... and every one of them was shut down afterwards
    assert all(not e.started for e in c.engines)
    assert refused(c.scheduler.grpc_port)  # the scheduler stopped too
    assert sum("ready after" in line for line in lines) == WORKERS - 1


async def test_engines_bind_to_different_cores_and_report_progress():
    log: list = []
    lines: list[str] = []
    c = cluster(fail_index=None, log=log, lines=lines)
    try:
        await c.start()
        assert [e.settings.cpu_cores for e in c.engines[:2]] == ["0", "1"]  # one core each (cores permitting)
        assert sorted(line.strip().split(" ready")[0] for line in lines if "ready after" in line) == \
            [f"engine {i}/{WORKERS}" for i in range(1, WORKERS + 1)]
        assert len(c.scheduler.core.workers) == WORKERS  # all joined after the starts
    finally:
        await c.stop()
