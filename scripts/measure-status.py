"""Time ``/status`` and the event-loop stall it causes, at N workers (default 1,024).

A real ``Scheduler`` (gRPC + HTTP on loopback) whose core holds N workers with full timelines
(``CoreSettings.timeline_segments`` closed segments each, as after a long run) and a running
step; before each call every worker closes one more segment. Two routes are timed side by side:
``/status`` and ``/status-dict``, which returns
``core.status()`` as a dict for FastAPI to encode (how ``/status`` was served before
``StatusEncoder``). A probe task on the scheduler's loop measures how late a 5 ms sleep wakes:
that lateness is the stall that gRPC calls, heartbeats and completions see meanwhile. The
client is ``curl`` (another process, so it takes no event-loop or GIL time from the scheduler).

    .venv/bin/python scripts/measure-status.py --workers 1024 --calls 20
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bubblespec.common.types import Prompt, SamplingParams
from bubblespec.scheduler.core.events import WorkerJoined
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.types import ModelLimits, WorkerHello
from bubblespec.scheduler.core.validate import Limits, build_step
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings


def fill(scheduler: Scheduler, workers: int) -> None:
    core = scheduler.core
    for i in range(workers):
        core.handle(WorkerJoined(WorkerHello(f"sim-{i:04d}", 8, 0, ModelLimits(1024, 128), True)))
    prompts = [Prompt(f"p{j}", token_ids=(1, 2, 3, j % 100 + 1)) for j in range(512)]
    spec = build_step(step_id="s1", policy_version=0, prompts=prompts, limits=Limits(), model=ModelLimits(1024, 128),
                      sampling=SamplingParams(temperature=1.0, max_tokens=64, n=4),
                      lookahead=[Prompt(f"l{j}", token_ids=(5, 6, j % 100 + 1)) for j in range(512)])
    core.submit_step(spec)
    now = core.clock()
    for w in core.workers.values():  # a long run's timelines: the segment cap reached
        t0 = now - 600.0
        w.timeline.segments[:] = [(("busy", "idle", "drafting")[k % 3], t0 + 2 * k, t0 + 2 * k + 1.9)
                                  for k in range(core.settings.timeline_segments)]


async def probe(stalls: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.005)
        stalls.append(time.perf_counter() - t - 0.005)


def churn(scheduler: Scheduler) -> None:
    """Every worker closes one more segment (and its timeline drops its oldest), as in a step."""
    core = scheduler.core
    now = core.clock()
    for w in core.workers.values():
        w.timeline.segments.append(("busy", now - 0.5, now))
        del w.timeline.segments[0]


async def measure(scheduler: Scheduler, path: str | None, calls: int) -> tuple[list[float], list[float], int]:
    stalls: list[float] = []
    stop = asyncio.Event()
    task = asyncio.create_task(probe(stalls, stop))
    times = []
    size = 0
    port = scheduler.http_port
    for _ in range(calls):
        churn(scheduler)
        t = time.perf_counter()
        if path is None:  # baseline: the same churn, no status call
            await asyncio.sleep(0.05)
            times.append(time.perf_counter() - t)
            continue
        curl = await asyncio.create_subprocess_exec(  # another process: no GIL shared with the loop
            "curl", "-sf", "-o", "/dev/null", "-w", "%{size_download}", f"http://127.0.0.1:{port}{path}",
            stdout=asyncio.subprocess.PIPE)
        out, _ = await curl.communicate()
        times.append(time.perf_counter() - t)
        size = int(out)
        await asyncio.sleep(0.6)  # past status_max_age_seconds: every call builds afresh
    stop.set()
    await task
    return times, stalls, size


async def main(args: argparse.Namespace) -> None:
    settings = SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0,
                                 core=CoreSettings(worker_timeout_seconds=1e9, stall_seconds=1e9, drafting=False))
    scheduler = Scheduler(settings)
    await scheduler.start()
    app = scheduler._http.config.app
    app.add_api_route("/status-dict", lambda: scheduler.core.status(), methods=["GET"])
    try:
        fill(scheduler, args.workers)
        for path in (None, "/status-dict", "/status"):
            times, stalls, size = await measure(scheduler, path, args.calls)
            print(f"{path or 'no call':13s} {args.workers} workers: {size / 2**20:.1f} MiB, per call median "
                  f"{statistics.median(times) * 1e3:.0f} ms (max {max(times) * 1e3:.0f} ms); event-loop stall "
                  f"max {max(stalls) * 1e3:.0f} ms, p99 {statistics.quantiles(stalls, n=100)[98] * 1e3:.0f} ms")
    finally:
        await scheduler.stop(0.1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=20)
    asyncio.run(main(parser.parse_args()))
