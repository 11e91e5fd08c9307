"""``bubblespec worker``: one engine, one agent, optional Redis draft store and metrics port."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

from bubblespec.store import StoreSettings, open_store
from bubblespec.worker.agent import WorkerAgent
from bubblespec.worker.settings import WorkerSettings
from bubblespec.worker.engine import VllmEngine
from bubblespec.worker.lifeline import exit_after
from bubblespec.worker.selfcheck import require_self_checks

__all__ = ["run"]

logger = logging.getLogger(__name__)


async def serve(settings: WorkerSettings, store_settings: StoreSettings, metrics_port: int,
                shutdown_seconds: float = 90.0) -> None:
    """Run until SIGTERM/SIGINT, then stop the agent and the engine; a shutdown that takes
    longer than ``shutdown_seconds`` ends the process (its engine processes die with it)."""
    engine = VllmEngine(settings.engine)  # refuses an unsupported vLLM before starting anything
    await engine.start()
    try:  # before the agent dials the scheduler: a worker that fails them is never seen there
        await require_self_checks(engine)
    except BaseException:
        await engine.shutdown()
        raise
    store = open_store(store_settings, resilient=True) if store_settings.url else None
    agent = WorkerAgent(settings, engine, store)
    http = None
    if metrics_port >= 0:
        from bubblespec.worker.http import start_http

        http = await start_http(agent, metrics_port)
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(agent.run())
    deadline: list[threading.Timer] = []

    def on_signal() -> None:
        if not deadline:
            deadline.append(exit_after(shutdown_seconds, "worker shutdown"))
        asyncio.ensure_future(agent.stop())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await task
    finally:
        if http is not None:
            http.should_exit = True
        if store is not None:
            await store.close()
        await engine.shutdown()


def run(settings: WorkerSettings, store_settings: StoreSettings, metrics_port: int,
        shutdown_seconds: float = 90.0) -> None:
    asyncio.run(serve(settings, store_settings, metrics_port, shutdown_seconds))
