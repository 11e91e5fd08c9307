"""A normal engine shutdown logs no error.

vLLM's ``AsyncLLM.shutdown`` (run off the event loop, as ``VllmEngine.shutdown`` does) stops the
engine core first and cancels its output handler after; the handler, waiting for the engine's
next output, then wakes to a dead engine and logs "AsyncLLM output_handler failed" with an
``EngineDeadError``. The stand-in below does the same, in the same order; ``VllmEngine.shutdown``
cancels the handler before it calls vLLM's shutdown.
"""

from __future__ import annotations

import asyncio
import time

from bubblespec.worker.engine import EngineSettings, VllmEngine


class FakeLLM:
    """vLLM's shutdown order: the engine dies (the waiting handler sees it), then the handler is cancelled."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.next_output = self.loop.create_future()
        self.errors: list[BaseException] = []
        self.output_handler = self.loop.create_task(self._handler())

    async def _handler(self) -> None:
        try:
            await self.next_output
        except Exception as exc:  # vLLM: logger.exception("AsyncLLM output_handler failed.")
            self.errors.append(exc)

    def _engine_died(self) -> None:
        if not self.next_output.done():
            self.next_output.set_exception(RuntimeError("EngineDeadError: EngineCore encountered an issue"))

    def shutdown(self) -> None:  # in a thread, as vLLM's is called
        self.loop.call_soon_threadsafe(self._engine_died)  # engine_core.shutdown(): the processes are gone
        time.sleep(0.05)  # it waits for them
        self.loop.call_soon_threadsafe(self.output_handler.cancel)


async def test_shutdown_cancels_the_output_handler_before_the_engine_stops():
    llm = FakeLLM()
    await asyncio.sleep(0)  # the handler is waiting for an output
    engine = VllmEngine(EngineSettings(model="fake"))
    engine._llm = llm  # type: ignore[assignment]
    await engine.shutdown()
    await asyncio.sleep(0.1)  # whatever vLLM's shutdown scheduled on the loop has run
    assert llm.output_handler.cancelled()
    assert llm.errors == []
    assert engine._llm is None


async def test_the_stand_in_logs_the_error_when_vllm_shuts_down_alone():
    """The check above can fail: vLLM's shutdown by itself makes the handler see a dead engine."""
    llm = FakeLLM()
    await asyncio.sleep(0)
    await asyncio.to_thread(llm.shutdown)
    await asyncio.sleep(0.1)
    assert [str(e) for e in llm.errors] == ["EngineDeadError: EngineCore encountered an issue"]
