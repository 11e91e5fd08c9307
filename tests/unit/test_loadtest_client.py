"""The HTTP load test's client (``cli/loadtest_http._Clients``: HTTP/1.1 on asyncio's streams)
against a scripted server on loopback: a connection the server drops under a call is opened
again and the call sent again, a 429 waits its ``Retry-After``, ``Connection: close`` and
chunked answers are read, an idle connection is opened anew, every answer is checked."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

from bubblespec.cli import loadtest_http
from bubblespec.cli.loadtest_settings import LoadSettings
from bubblespec.cli.loadtest_workers import prompt_key


class ScriptedServer:
    """Answers ``/health`` with 200; POSTs by ``script``, one entry per POST in order: "drop"
    (close without answering), "429", "close" (200, then close), "chunked" (200 in chunks),
    "ok" (200, keep-alive). A POST beyond the script is "ok"."""

    def __init__(self, script: list[str]) -> None:
        self.script = list(script)
        self.posts: list[dict] = []
        self.connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = next((int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length")), 0)
                body = await reader.readexactly(length)
                if lines[0].startswith("GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                self.posts.append(json.loads(body))
                what = self.script.pop(0) if self.script else "ok"
                answer = json.dumps({"choices": [{"index": 0, "token_ids": [1, 2]}]}).encode()
                if what == "drop":
                    writer.close()
                    return
                if what == "429":
                    writer.write(b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 0\r\ncontent-length: 2\r\n\r\n{}")
                elif what == "chunked":
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                                 + b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (answer[:5], answer[5:]))
                                 + b"0\r\n\r\n")
                else:
                    close = b"connection: close\r\n" if what == "close" else b""
                    writer.write(b"HTTP/1.1 200 OK\r\n" + close + b"content-length: %d\r\n\r\n" % len(answer) + answer)
                    if what == "close":
                        await writer.drain()
                        writer.close()
                        return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def test_the_client_retries_reads_and_checks_every_answer():
    server = ScriptedServer(["drop", "429", "close", "chunked", "ok"])
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    settings = LoadSettings(http=True, connections=1, choices=1, max_tokens=4)
    clients = loadtest_http._Clients({"settings": asdict(settings), "url": f"http://127.0.0.1:{port}", "first": 0,
                                      "count": 1})
    await clients.start()
    assert server.connections == 1
    try:
        got = await clients.run_round(1)  # dropped, sent again on a new connection, 429, then 200 + close
        [[conn, key, sent, answered, status, refused, reconnects, out]] = got["calls"]
        assert (conn, status, refused, reconnects) == (0, 200, 1, 1)
        assert key == prompt_key(loadtest_http._call_prompt(settings, 1, 0)) and sent < answered
        assert out == [hash((1, 2))]
        assert got["errors"] == {"IncompleteReadError": 1} and got["opened"] == 1
        assert len(server.posts) == 3 and server.posts[0] == server.posts[2]  # the same call each time
        assert server.posts[0]["prompt"] == loadtest_http._call_prompt(settings, 1, 0)
        got = await clients.run_round(2)  # the connection was closed by the server: opened anew; chunked
        assert [c[4] for c in got["calls"]] == [200] and got["calls"][0][7] == [hash((1, 2))]
        assert got["opened"] == 1 and server.connections == 3
        clients.idle_limit = 0.0  # idle "too long" (keep_alive_seconds - KEEP_ALIVE_MARGIN_SECONDS): opened anew
        got = await clients.run_round(3)
        assert got["calls"][0][4] == 200 and got["opened"] == 1 and server.connections == 4
    finally:
        await clients.stop()
        listening.close()


async def test_a_wrong_answer_is_reported_not_counted():
    async def serve(reader, writer):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")), 0)
            await reader.readexactly(length)
            body = b"" if head.startswith(b"GET") else json.dumps({"choices": [{"index": 1, "token_ids": []}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

    listening = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    settings = LoadSettings(http=True, connections=1, choices=1)
    clients = loadtest_http._Clients({"settings": asdict(settings), "url": f"http://127.0.0.1:{port}", "first": 0,
                                      "count": 1})
    await clients.start()
    try:
        [call] = (await clients.run_round(1))["calls"]
        assert call[4] == 200 and call[7] == "choices [1], expected indices 0..0"
    finally:
        await clients.stop()
        listening.close()
