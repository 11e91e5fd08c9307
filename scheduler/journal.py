"""What a restarted scheduler needs, kept in Redis: the policy and each step's completions.

A trainer whose scheduler restarted mid-step retries ``Generate`` with the same step id (the
SDK does this by itself). The new scheduler finds the step's fingerprint and its finished
completions here, replays those, and runs only the rest. Together with the SDK's
de-duplication by (prompt id, sample index) every completion reaches the trainer once.

Layout (prefix ``P``, default ``bubblespec:``)::

    P{sched}:policy           JSON {"version": v, "weights_path": "..."}
    P{sched}:step:<id>        hash: "fingerprint" -> hex, "<request key>" -> Completion protobuf

Writes go through one background task in order; a failed write is logged and dropped
(the service keeps working without Redis, it only loses resumability).
"""

from __future__ import annotations

import asyncio
import json
import logging

from google.protobuf.message import DecodeError

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.client import _convert as cv
from bubblespec.client.types import Completion
from bubblespec.store import StoreSettings

__all__ = ["StepJournal"]

logger = logging.getLogger(__name__)


class StepJournal:
    def __init__(self, settings: StoreSettings, ttl_seconds: int = 24 * 3600):
        from bubblespec.store.redis_store import redis_client

        self.redis = redis_client(settings)
        self.prefix = settings.key_prefix + "{sched}:"
        self.ttl = ttl_seconds
        self._writes: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._writer())

    async def close(self) -> None:
        if self._task is not None:
            await self.flush()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.redis.aclose()

    async def flush(self) -> None:
        done = asyncio.get_running_loop().create_future()
        self._writes.put_nowait(done)
        await asyncio.wait_for(done, 5.0)

    # ----------------------------------------------------------------- writes --

    def save_policy(self, version: int, weights_path: str) -> None:
        self._writes.put_nowait(("set", self.prefix + "policy", json.dumps({"version": version, "weights_path": weights_path})))

    def save_step(self, step_id: str, fingerprint: str) -> None:
        self._writes.put_nowait(("hset", self._step_key(step_id), "fingerprint", fingerprint.encode()))

    def save_completion(self, key: str, completion: Completion) -> None:
        blob = cv.completion_to_pb(completion).SerializeToString()
        self._writes.put_nowait(("hset", self._step_key(completion.step_id), key, blob))

    async def _writer(self) -> None:
        """Write queued items in order, everything queued so far in one pipeline."""
        while True:
            batch = [await self._writes.get()]
            while not self._writes.empty():
                batch.append(self._writes.get_nowait())
            writes = [item for item in batch if not isinstance(item, asyncio.Future)]
            try:
                if writes:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for item in writes:
                            if item[0] == "set":
                                pipe.set(item[1], item[2], ex=self.ttl)
                            else:
                                pipe.hset(item[1], item[2], item[3])
                                pipe.expire(item[1], self.ttl)
                        await pipe.execute()
            except Exception as exc:  # Redis down: lose resumability, never the service
                logger.warning("step journal write failed (%d items): %s", len(writes), type(exc).__name__)
            for item in batch:
                if isinstance(item, asyncio.Future) and not item.done():
                    item.set_result(None)

    # ------------------------------------------------------------------ reads --

    async def load_policy(self) -> tuple[int, str] | None:
        try:
            raw = await self.redis.get(self.prefix + "policy")
        except Exception as exc:
            logger.warning("step journal unreachable: %s", type(exc).__name__)
            return None
        if raw is None:
            return None
        data = json.loads(raw)
        return int(data["version"]), str(data["weights_path"])

    async def load_step(self, step_id: str) -> tuple[str, dict[str, Completion]] | None:
        """(fingerprint, completions by request key) of a step an earlier scheduler ran."""
        try:
            fields = await self.redis.hgetall(self._step_key(step_id))
        except Exception as exc:
            logger.warning("step journal unreachable: %s", type(exc).__name__)
            return None
        if b"fingerprint" not in fields:
            return None
        done = {}
        try:
            for key, blob in fields.items():
                if key != b"fingerprint":
                    done[key.decode()] = cv.completion_from_pb(pb.Completion.FromString(blob))
            return fields[b"fingerprint"].decode(), done
        except (DecodeError, UnicodeDecodeError):  # corrupt journal: run the step afresh
            logger.warning("step journal entry of %r is corrupt; ignoring it", step_id)
            return None

    def _step_key(self, step_id: str) -> str:
        return f"{self.prefix}step:{step_id}"
