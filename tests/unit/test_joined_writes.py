"""One socket write for an HTTP answer's head and body (``scheduler/joined_writes.py``)."""

from __future__ import annotations

import asyncio
from asyncio import selector_events

from bubblespec.scheduler.joined_writes import JoinedWrites
from bubblespec.scheduler.server import Scheduler
from bubblespec.scheduler.settings import SchedulerSettings


class Recorder:
    """A transport that records what is done to it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", bytes(data)))

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", b""))
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


async def test_the_writes_of_one_turn_go_as_one_in_order_and_the_next_turns_apart() -> None:
    t = Recorder()
    joined = JoinedWrites(t, asyncio.get_running_loop())  # type: ignore[arg-type]  # a stand-in transport
    joined.write(b"HTTP/1.1 200 OK\r\n\r\n")
    joined.writelines([b"{", b"}"])
    joined.write(b"")
    assert t.calls == [] and joined.get_write_buffer_size() == 7 + 21
    await asyncio.sleep(0)
    assert t.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\n{}")]
    joined.write(b"data: 1\n\n")
    await asyncio.sleep(0)
    joined.write(b"data: 2\n\n")
    await asyncio.sleep(0)
    assert t.calls[1:] == [("write", b"data: 1\n\n"), ("write", b"data: 2\n\n")]
    assert joined.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the transport's own


async def test_close_writes_what_is_kept_first_and_a_lost_connection_drops_it() -> None:
    t = Recorder()
    joined = JoinedWrites(t, asyncio.get_running_loop())  # type: ignore[arg-type]
    joined.write(b"head")
    joined.write(b"body")
    joined.close()
    await asyncio.sleep(0)  # the scheduled flush finds nothing more
    assert t.calls == [("write", b"headbody"), ("close", b"")]
    lost = Recorder()
    joined = JoinedWrites(lost, asyncio.get_running_loop())  # type: ignore[arg-type]
    joined.write(b"late")
    lost.closing = True  # the peer went away before the turn ended
    await asyncio.sleep(0)
    assert lost.calls == []
    aborted = Recorder()
    joined = JoinedWrites(aborted, asyncio.get_running_loop())  # type: ignore[arg-type]
    joined.write(b"never")
    joined.abort()
    await asyncio.sleep(0)
    assert aborted.calls == [("abort", b"")]


async def test_the_scheduler_answers_a_call_in_one_socket_write(monkeypatch) -> None:
    writes: list[bytes] = []
    real = selector_events._SelectorSocketTransport.write

    def counted(self, data):
        writes.append(bytes(data))
        return real(self, data)

    monkeypatch.setattr(selector_events._SelectorSocketTransport, "write", counted)
    scheduler = Scheduler(SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0))
    await scheduler.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", scheduler.http_port)
        for _ in range(2):  # and the connection serves the next call
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = next(int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                          if k.lower() == b"content-length")
            body = await reader.readexactly(length)
            assert head.startswith(b"HTTP/1.1 200") and body
        writer.close()
    finally:
        await scheduler.stop(grace=0.5)
    answers = [w for w in writes if w.startswith(b"HTTP/1.1")]
    assert len(answers) == 2 and all(a.endswith(body) for a in answers), answers  # head and body together
