"""The scheduler's and the worker's HTTP servers (uvicorn) leave SIGINT and SIGTERM to the
process's own handlers: a SIGTERM reaches the event loop's handler once, and the HTTP port keeps
answering (the scheduler drains its steps behind it) until the process stops the server itself.
uvicorn >= 0.29 takes both signals while it serves unless told not to; it then closed the port
at the first SIGTERM and raised the signal again once it had stopped."""

from __future__ import annotations

import asyncio
import os
import signal
from types import SimpleNamespace

import httpx

from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.worker.http import start_http


def _serving_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "Server.serve"]


async def _sigterm(server, url: str) -> list[str]:
    """Send this process a SIGTERM with a loop handler in place; the handler's calls, after
    checking that ``server`` still serves ``url``. Stops ``server`` before the handler goes, so
    that a server which took the signal cannot raise it again into the default action."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    loop.add_signal_handler(signal.SIGTERM, lambda: seen.append("loop"))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(60):  # uvicorn checks for exit every 0.1 s
            await asyncio.sleep(0.01)
        assert server.should_exit is False, "the HTTP server took the SIGTERM"
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(url)).status_code == 200
        server.should_exit = True
        for _ in range(500):
            if not _serving_tasks():
                break
            await asyncio.sleep(0.01)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    return seen


async def test_the_worker_http_server_leaves_sigterm_to_the_worker():
    agent = SimpleNamespace(link=SimpleNamespace(connected=asyncio.Event()), weights=SimpleNamespace(version=3))
    server = await start_http(agent, 0)
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    assert signal.getsignal(signal.SIGTERM) != server.handle_exit
    assert await _sigterm(server, f"http://127.0.0.1:{port}/healthz") == ["loop"]


async def test_the_scheduler_http_server_leaves_sigterm_to_the_scheduler():
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0))
    await scheduler.start()
    try:
        server = scheduler._http
        assert server is not None and signal.getsignal(signal.SIGTERM) != server.handle_exit
        assert await _sigterm(server, f"http://127.0.0.1:{scheduler.http_port}/healthz") == ["loop"]
    finally:
        await scheduler.stop(0)
