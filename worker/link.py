"""The worker's end of its stream to the scheduler: the mirror of ``scheduler/wire.py``.

One bidirectional stream per worker (``WorkerLink.Connect``). ``Link.run`` dials the scheduler,
sends the hello, hands every message it reads to its ``Peer`` (the ``WorkerAgent``, which
routes it to the runner or the weights) and sends heartbeats. When the stream breaks it tells
the peer, which drops whatever ran (the scheduler re-queues it), and dials again with backoff
until ``close``. What the worker sends goes through ``send`` into the outbox, and out on the
stream in order; progress reports (``report_progress``) and completions (``outgoing``) are
coalesced into fewer, larger messages.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.common.transport import keepalive_options
from bubblespec.worker.settings import WorkerSettings

__all__ = ["BATCH_BYTES", "BATCH_MAX", "Link", "Peer"]

logger = logging.getLogger(__name__)

BATCH_BYTES = 2**20
"""Most bytes of completions in one ``completions`` batch (a larger single one goes alone):
far under the gRPC message limits (``max_message_bytes``, 64 MiB by default)."""
BATCH_MAX = 256
"""Most completions in one ``completions`` batch."""


class Peer(Protocol):
    """What the link needs of the worker it carries (``WorkerAgent``)."""

    def hello(self) -> pb.Hello:
        """The first message of each stream."""
        ...

    def heartbeat(self) -> pb.Heartbeat:
        """The heartbeat to send now."""
        ...

    async def handle(self, msg: pb.SchedulerMessage) -> None:
        """Act on one message from the scheduler (in the order they came)."""
        ...

    async def alongside(self) -> None:
        """Work that runs while a stream is up; cancelled when it ends."""
        ...

    async def stream_ended(self) -> None:
        """A stream ended: drop whatever it was running."""
        ...

    def requests_running(self) -> bool:
        """Whether any assignment (not a draft job) still runs on this worker."""
        ...

    async def request_end(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a running request to end; whether one did."""
        ...


class Link:
    """One worker's stream to the scheduler (module docstring). Owns the outbox, the
    ``connected`` flag, the progress reports waiting to go and the reconnection loop."""

    def __init__(self, settings: WorkerSettings, worker_id: str, peer: Peer):
        self.settings = settings
        self.worker_id = worker_id
        self.peer = peer
        self.outbox: asyncio.Queue[pb.WorkerMessage | None] = asyncio.Queue()
        self.connected = asyncio.Event()
        self.stopping = False  # set by ``close``: no more streams
        self._progress: dict[str, int] = {}  # request key -> tokens, reports waiting for _flush_progress
        self._progress_timer: asyncio.TimerHandle | None = None

    def send(self, **kind: Any) -> None:  # one WorkerMessage field: its message
        self.outbox.put_nowait(pb.WorkerMessage(**kind))

    def close(self) -> None:
        """End the stream once what is queued has gone, and dial no more: ``run`` returns."""
        self.stopping = True
        self.outbox.put_nowait(None)

    # ------------------------------------------------------------ connection --

    def _channel(self) -> grpc.aio.Channel:
        s = self.settings
        options = [("grpc.max_receive_message_length", s.max_message_bytes),
                   ("grpc.max_send_message_length", s.max_message_bytes),
                   *keepalive_options(s.keepalive_seconds, s.keepalive_timeout_seconds, s.reconnect_max_seconds)]
        if not s.tls:
            return grpc.aio.insecure_channel(s.scheduler, options)
        read = lambda p: open(p, "rb").read() if p else None  # noqa: E731
        creds = grpc.ssl_channel_credentials(read(s.tls_ca_file), read(s.tls_key_file), read(s.tls_cert_file))
        return grpc.aio.secure_channel(s.scheduler, creds, options)

    async def run(self) -> None:
        """Serve until ``close()``; reconnect with backoff whenever the stream breaks. A refused
        token (UNAUTHENTICATED, PERMISSION_DENIED) ends it with that error."""
        delay = self.settings.reconnect_initial_seconds
        while not self.stopping:
            started = time.monotonic()
            try:
                await self._session()
            except (grpc.RpcError, ConnectionError) as exc:
                code = exc.code() if isinstance(exc, grpc.RpcError) else None
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise
                logger.warning("worker %s: scheduler stream broke (%s); reconnecting", self.worker_id, code)
            finally:
                self.connected.clear()
                await self.peer.stream_ended()
            if self.stopping:
                break
            if time.monotonic() - started > 10:
                delay = self.settings.reconnect_initial_seconds
            await asyncio.sleep(delay)
            delay = min(self.settings.reconnect_max_seconds, delay * 2)

    async def _session(self) -> None:
        self._progress.clear()  # reports of the previous stream's requests: dropped with them
        self.outbox = asyncio.Queue()
        self.outbox.put_nowait(pb.WorkerMessage(hello=self.peer.hello()))
        metadata = (("authorization", f"Bearer {self.settings.token}"),) if self.settings.token else ()
        async with self._channel() as channel:
            call = pbg.WorkerLinkStub(channel).Connect(self.outgoing(), metadata=metadata)
            beat = asyncio.create_task(self._heartbeats())
            beside = asyncio.create_task(self.peer.alongside())
            try:
                async for msg in call:
                    self.connected.set()
                    await self.peer.handle(msg)
            finally:
                beat.cancel()
                beside.cancel()
                self.outbox.put_nowait(None)

    async def _heartbeats(self) -> None:
        while True:
            self.connected.set()
            self.send(heartbeat=self.peer.heartbeat())
            await asyncio.sleep(self.settings.heartbeat_seconds)

    # -------------------------------------------------------------- progress --

    def report_progress(self, key: str, tokens: int) -> None:
        """Queue a progress report; every report queued within ``progress_seconds`` of the first
        goes out in one message (``_flush_progress``)."""
        self._progress[key] = tokens
        if self._progress_timer is None:
            self._progress_timer = asyncio.get_running_loop().call_later(self.settings.progress_seconds,
                                                                         self._flush_progress)

    def forget_progress(self, key: str) -> None:
        """Drop ``key``'s waiting report: the request finished or stopped, so it says nothing more."""
        self._progress.pop(key, None)

    def _flush_progress(self) -> None:
        self._progress_timer = None
        reports = [pb.Progress(request_key=k, generated_tokens=n) for k, n in self._progress.items()]
        self._progress.clear()
        if len(reports) == 1:
            self.send(progress=reports[0])
        elif reports:
            self.send(progress_batch=pb.ProgressBatch(progress=reports))

    # -------------------------------------------------------------- outgoing --

    async def outgoing(self) -> AsyncIterator[pb.WorkerMessage]:
        """The outbox as the stream's messages, in order. Completions waiting at once go out
        as one ``completions`` batch (``_batch``): one gRPC message for the scheduler to read
        instead of one each. A completion within ``completion_batch_seconds`` of the last
        completion message waits out the gap first, so that those ending meanwhile join it."""
        pending: pb.WorkerMessage | None | _Nothing = _NOTHING
        gap = self.settings.completion_batch_seconds
        last = -gap
        while True:
            msg = pending if not isinstance(pending, _Nothing) else await self.outbox.get()
            pending = _NOTHING
            if msg is None:
                return
            if msg.WhichOneof("kind") == "completion":
                # let the other requests that ended in this engine step (or within the gap) queue theirs;
                # a full batch already waiting goes at once
                if self.outbox.qsize() < BATCH_MAX:
                    await self._wait_for_more_completions(last + gap)
                if not self.outbox.empty():
                    msg, pending = _batch(msg, self.outbox)
                last = time.monotonic()
            yield msg

    async def _wait_for_more_completions(self, until: float) -> None:
        """Let completions join the one about to go, until ``until`` (``completion_batch_seconds``
        after the last completion message), but only while a request still runs here: with none
        left nothing can join, and waiting would only hold back the worker's last completion,
        which the step's end waits for (by up to the whole gap: 50 ms on a drafted bench step of
        130-250 ms). Yields to the loop once, so completions of the same engine step queue first."""
        await asyncio.sleep(0)
        while self.peer.requests_running() and (left := until - time.monotonic()) > 0:
            if not await self.peer.request_end(left):
                return


class _Nothing(enum.Enum):
    """No message: what ``_batch`` hands back when it took nothing that did not join."""

    NOTHING = enum.auto()


_NOTHING = _Nothing.NOTHING


def _batch(first: pb.WorkerMessage, outbox: asyncio.Queue[pb.WorkerMessage | None],
           ) -> tuple[pb.WorkerMessage, pb.WorkerMessage | None | _Nothing]:
    """``first`` (a completion) and the completions queued right behind it as one message,
    and the next item taken from ``outbox`` that did not join it (``_NOTHING`` if none; it may
    be the None that ends the stream)."""
    group = [first]
    size = first.completion.ByteSize()
    while not outbox.empty() and len(group) < BATCH_MAX:
        nxt = outbox.get_nowait()
        if nxt is None or nxt.WhichOneof("kind") != "completion":
            return _batched(group), nxt
        n = nxt.completion.ByteSize()
        if size + n > BATCH_BYTES:
            return _batched(group), nxt
        group.append(nxt)
        size += n
    return _batched(group), _NOTHING


def _batched(group: list[pb.WorkerMessage]) -> pb.WorkerMessage:
    """``completion`` messages as one message: one alone as it is, more as a batch (each
    completion copied once, into the batch)."""
    if len(group) == 1:
        return group[0]
    msg = pb.WorkerMessage()
    msg.completions.completions.extend(m.completion for m in group)
    return msg
