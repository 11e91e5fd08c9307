"""Engine control calls fanned out to workers: one ``ControlCall`` per worker on its stream,
then every answer (``ControlResult``) awaited together.

A worker that leaves before it answers, or does not answer in time, counts as failed, with
the reason; no call is ever reported done for a worker that did not say so. ``SchedulerService``
owns one ``ControlCalls`` and routes ``control_result`` messages and departures to it.

What goes into a worker's outbox is a core type (``core/types.py``: ``ControlCall``, the
operation by name), as for the core's actions; ``wire.py`` turns it into the stream's message.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.scheduler.core.types import ControlCall

__all__ = ["ControlAnswer", "ControlCalls"]

logger = logging.getLogger(__name__)
MAX_ERROR_CHARS = 500
"""A worker's error is cut to this length."""


@dataclass(frozen=True)
class ControlAnswer:
    """One worker's answer: ``error`` None when the call succeeded; ``result`` its JSON result."""

    worker_id: str
    error: str | None
    result: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


class ControlCalls:
    """Control calls fanned out to workers (weight-transfer routes, prefix-cache reset): sends
    one ``ControlCall`` per worker and collects each worker's ``ControlResult`` by call id."""

    def __init__(self, send: Callable[[str, ControlCall], bool]):
        """``send(worker_id, call)``: queue a call on the worker's stream; False when it has none."""
        self._send = send
        self._pending: dict[str, tuple[str, asyncio.Future]] = {}  # call id -> (worker id, its answer)
        self._ids = itertools.count()

    async def fan_out(self, op: pb.ControlOp, args: Mapping[str, dict], timeout: float,
                      policy_version: int = 0) -> dict[str, ControlAnswer]:
        """Send ``op`` to each worker of ``args`` (worker id -> its JSON arguments) and wait
        for every answer, at most ``timeout`` seconds in all."""
        name = pb.ControlOp.Name(op).removeprefix("CONTROL_OP_").lower()  # the outbox carries it by name
        loop = asyncio.get_running_loop()
        waiting: dict[str, tuple[str, asyncio.Future]] = {}
        for wid, arguments in args.items():
            call_id = f"c{next(self._ids)}"
            fut = loop.create_future()
            self._pending[call_id] = (wid, fut)
            waiting[wid] = (call_id, fut)
            if not self._send(wid, ControlCall(wid, call_id, name, json.dumps(arguments), policy_version)):
                fut.set_result(ControlAnswer(wid, "not connected"))
        try:
            if waiting:
                await asyncio.wait([f for _, f in waiting.values()], timeout=timeout)
        finally:
            for call_id, _ in waiting.values():
                self._pending.pop(call_id, None)
        answers = {}
        for wid, (_, fut) in waiting.items():
            if fut.done() and not fut.cancelled():
                answers[wid] = fut.result()
            else:
                fut.cancel()
                answers[wid] = ControlAnswer(wid, f"did not answer within {timeout:g}s")
        return answers

    def answer(self, worker_id: str, msg: pb.ControlResult) -> None:
        """A worker's ``control_result``; one for a call it was not sent is logged and dropped."""
        wid, fut = self._pending.get(msg.call_id, ("", None))
        if fut is None or wid != worker_id or fut.done():
            logger.warning("worker %s sent a bad message: control_result.call_id %.40r was not asked of it",
                           worker_id, msg.call_id)
            return
        try:
            result = json.loads(msg.json) if msg.json else {}
        except ValueError:
            result = None
        if not isinstance(result, dict):
            fut.set_result(ControlAnswer(worker_id, "control_result.json: not a JSON object"))
            return
        error = None if msg.ok else (msg.error or "no reason given")[:MAX_ERROR_CHARS]
        fut.set_result(ControlAnswer(worker_id, error, result))

    def lost(self, worker_id: str, reason: str) -> None:
        """The worker's stream ended: its open calls fail with ``reason``."""
        for wid, fut in list(self._pending.values()):
            if wid == worker_id and not fut.done():
                fut.set_result(ControlAnswer(worker_id, reason))
