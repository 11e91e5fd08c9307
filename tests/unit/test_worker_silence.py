"""A worker's silence is the scheduler's listening time without a message from it
(``core/silence.py``): time in which the scheduler's own event loop stalled is not counted, in
the core (``tick(stalled)``) and in the service, which measures the stall between its ticks."""

from __future__ import annotations

import asyncio
import logging
import time

from bubblespec.scheduler.core.events import WorkerJoined
from bubblespec.scheduler.core.types import Assign, Disconnect, RequestsMoved
from bubblespec.scheduler.service import SchedulerService
from tests.unit.test_core import hello, make_core, of, step


def test_the_schedulers_stall_is_not_the_workers_silence_but_a_worker_gone_is_still_found():
    core, clock = make_core(worker_timeout_seconds=10)
    core.handle(WorkerJoined(hello("a")))
    of(core.submit_step(step("s", 1)), Assign)
    clock.now = 12.0
    assert core.tick(stalled=6.0) == [] and core.worker_count == 1  # 12 s since heard, 6 of them deaf
    clock.now = 15.5
    assert core.tick() == [] and core.worker_count == 1  # 9.5 s of listening
    clock.now = 16.5
    actions = core.tick()  # 10.5 s of listening without a word: gone, its request re-queued
    [gone] = of(actions, Disconnect)
    assert gone.worker_id == "a" and gone.reason == "silent for 10.5s", gone
    assert of(actions, RequestsMoved) and core.worker_count == 0


def test_without_a_stall_the_timeout_is_as_before():
    core, clock = make_core(worker_timeout_seconds=10)
    core.handle(WorkerJoined(hello("a")))
    clock.now = 10.5
    assert of(core.tick(), Disconnect) and core.worker_count == 0


async def test_the_service_measures_its_loop_stall_and_keeps_a_worker_it_could_not_hear(caplog):
    core, clock = make_core(worker_timeout_seconds=1.0)
    clock.now = time.monotonic()
    core.clock = time.monotonic  # the service's ticks and the core's silence on one clock
    service = SchedulerService(core)
    core.handle(WorkerJoined(hello("a")))
    ticks = asyncio.create_task(service.tick_forever(0.05))
    try:
        await asyncio.sleep(0.2)
        with caplog.at_level(logging.WARNING, logger="bubblespec.scheduler.service"):
            time.sleep(1.5)  # the loop stalls: no stream is read, no tick runs
            await asyncio.sleep(0.3)  # ticks run again: 1.8 s since the worker was heard, 1.5 s of it deaf
        assert core.worker_count == 1, "a stall of the scheduler's loop was taken for the worker's silence"
        assert 1.4 <= service.loop_stalls.seconds < 3.0, service.loop_stalls.seconds
        assert any("stalled for 1." in r.getMessage() for r in caplog.records), caplog.text
        await asyncio.sleep(1.2)  # listening, and nothing from the worker: now it is silent
        assert core.worker_count == 0
    finally:
        ticks.cancel()
