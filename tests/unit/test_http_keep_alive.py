"""The scheduler's HTTP keep-alive (``SchedulerSettings.http_keep_alive_seconds``): how long an
idle connection stays open, from the flag, the environment or the default (5 s, as vLLM's), and
a bad value refused naming the setting."""

from __future__ import annotations

import asyncio

import pytest

from bubblespec.cli.commands import _scheduler_settings
from bubblespec.cli.main import build_parser
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One GET /healthz on an open connection; the answer's status line."""
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    return head.split(b"\r\n")[0]


async def _idle_then_closed(keep_alive: float, idle: float) -> bool:
    """Whether the scheduler closed a connection left idle ``idle`` s after one call (an open one
    must then serve a second call)."""
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0,
                                            http_keep_alive_seconds=keep_alive))
    await scheduler.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", scheduler.http_port)
        assert (await _get(reader, writer)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(idle)
        try:
            assert await asyncio.wait_for(reader.read(1), 0.2) == b""  # EOF: the server closed it
            return True
        except TimeoutError:  # nothing to read and no EOF: open
            assert (await _get(reader, writer)).startswith(b"HTTP/1.1 200")
            return False
        finally:
            writer.close()
    finally:
        await scheduler.stop(grace=0.5)


async def test_an_idle_connection_closes_after_the_keep_alive_and_not_before():
    assert await _idle_then_closed(keep_alive=0.3, idle=1.0)
    assert not await _idle_then_closed(keep_alive=30.0, idle=1.0)


def test_the_flag_and_the_environment_set_it_and_a_bad_value_names_it(monkeypatch):
    assert _scheduler_settings(build_parser().parse_args(["scheduler"])).http_keep_alive_seconds == 5.0
    monkeypatch.setenv("BUBBLESPEC_HTTP_KEEP_ALIVE_SECONDS", "75")
    assert _scheduler_settings(build_parser().parse_args(["scheduler"])).http_keep_alive_seconds == 75.0
    a = build_parser().parse_args(["scheduler", "--http-keep-alive-seconds", "12.5"])
    assert _scheduler_settings(a).http_keep_alive_seconds == 12.5
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit, match="http_keep_alive_seconds"):
            _scheduler_settings(build_parser().parse_args(["scheduler", "--http-keep-alive-seconds", bad]))
