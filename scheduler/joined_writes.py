"""One socket write for what an HTTP answer writes in one turn of the event loop.

uvicorn writes an answer's status line and headers, then its body, each with its own
``transport.write``: two ``send`` calls and, with ``TCP_NODELAY``, two packets per call. Under the
HTTP load test (docs/LOAD.md) the scheduler spent ~9% of its samples in those writes.
``JoinedWritesProtocol`` (uvicorn's own HTTP protocol, handed a ``JoinedWrites`` transport)
keeps what is written until the end of the current turn of the loop and writes it then as one
buffer, in order: a whole answer goes out in one write; a streamed answer's chunks each go at
the end of the turn that made them. Closing, or writing EOF, first writes what is kept; after
the connection is lost, what is kept is dropped, as the socket would drop it.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.auto import AutoHTTPProtocol

__all__ = ["JoinedWrites", "JoinedWritesProtocol"]


class JoinedWrites:
    """A transport that joins the writes of one turn of ``loop`` into one write to ``transport``
    (module docstring); every other method is the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._kept: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._kept:
            self._loop.call_soon(self.flush)
        self._kept.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Write what is kept now, as one buffer (nothing once the transport is closing)."""
        kept, self._kept = self._kept, []
        if kept and not self._transport.is_closing():
            self._transport.write(kept[0] if len(kept) == 1 else b"".join(kept))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._kept))

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._kept = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class JoinedWritesProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]  # uvicorn's choice of class, a variable
    """uvicorn's HTTP protocol (httptools' where installed, else h11's) on a ``JoinedWrites``
    transport: ``uvicorn.Config(http=JoinedWritesProtocol)``."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        joined = JoinedWrites(cast(asyncio.Transport, transport), asyncio.get_running_loop())
        super().connection_made(cast(asyncio.Transport, joined))
