"""What a restarted scheduler needs, kept in Redis: the policy and each step's completions.

A trainer whose scheduler restarted mid-step retries ``Generate`` with the same step id (the
SDK does this by itself). The new scheduler finds the step's fingerprint and its finished
completions here, replays those, and runs only the rest. Together with the SDK's
de-duplication by (prompt id, sample index) every completion reaches the trainer once.

Layout (prefix ``P``, default ``bubblespec:``)::

    P{sched}:policy           MAC + JSON {"version": v, "weights_path": "..."}
    P{sched}:step:<id>        hash: "fingerprint" -> MAC + hex, "<request key>" -> MAC + Completion protobuf,
                              "failed" -> MAC + JSON {"field": ..., "message": ...} (a failed step)

Redis is trusted for nothing. Every value starts with a 32-byte HMAC-SHA256, keyed by the
scheduler's ``journal_secret``, over the Redis key, the hash field and the value (each
length-prefixed), so an entry can be neither forged nor moved to another step or request. A
record whose MAC does not match, or that does not decode, is dropped, counted (``rejected``,
exported as ``bubblespec_journal_rejected_total``) and logged, never replayed: the step runs
those requests again. Authentic completions are then checked like live ones
(``core.checks.check_replayed``, in the service).

A step's hash lives ``ttl_seconds`` after its last write; once its summary is sent it is kept
only ``finished_ttl_seconds`` more (a trainer that retries ``Generate`` right after a restart
still gets the replay; later, the step id is unknown and runs again).

Writes go through one background task in order; a failed write is logged and dropped
(the service keeps working without Redis, it only loses resumability). Keep the journal in a
Redis that never evicts (``maxmemory-policy noeviction``): ``check_eviction`` warns otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import struct
from typing import Any, cast

from google.protobuf.message import DecodeError

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.types import Completion
from bubblespec.scheduler.pending import Pending
from bubblespec.scheduler.wire import completion_pb
from bubblespec.store import StoreSettings

__all__ = ["MAC_BYTES", "MIN_SECRET_BYTES", "StepJournal"]

logger = logging.getLogger(__name__)
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
_DOMAIN = b"bubblespec-journal-v1"


class StepJournal:
    """What a restarted scheduler needs to resume a step without running its finished requests
    again: each step's fingerprint, its completions, its failure and the current policy, in Redis,
    each entry sealed with an HMAC so a forged or corrupt one is refused, not replayed. Writes are
    queued and batched (one pipeline per ``batch_seconds``); ``flush()`` waits for them."""

    def __init__(self, settings: StoreSettings, secret: bytes, ttl_seconds: int = 24 * 3600,
                 finished_ttl_seconds: int = 600, batch_seconds: float = 0.02):
        """``batch_seconds``: how long a write waits for more to join it (one pipeline, one HSET
        per step key for them all; ``flush`` does not wait). A record not yet written when the
        scheduler dies costs only its request's re-run after the restart, as any write in flight."""
        from bubblespec.store.redis_store import redis_client

        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"journal_secret: must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self.redis = redis_client(settings)
        self.prefix = settings.key_prefix + "{sched}:"
        self.ttl = ttl_seconds
        self.finished_ttl = finished_ttl_seconds
        self.rejected = 0
        """Records dropped on read: MAC mismatch, undecodable, or failing the replay checks."""
        self._secret = secret
        self._keyed: Any = None  # the keyed HMAC state, computed once (_mac)
        self.batch_seconds = batch_seconds
        self._writes = Pending()
        self._flushing = asyncio.Event()  # a flush waits: write what is queued now
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
        self._flushing.set()
        await asyncio.wait_for(done, 5.0)

    # ----------------------------------------------------------------- writes --

    def save_policy(self, version: int, weights_path: str) -> None:
        key = self.prefix + "policy"
        record = json.dumps({"version": version, "weights_path": weights_path}).encode()
        self._writes.put_nowait(("set", key, self._seal(key, "", record)))

    def save_step(self, step_id: str, fingerprint: str) -> None:
        key = self._step_key(step_id)
        self._writes.put_nowait(("hset", key, "fingerprint", self._seal(key, "fingerprint", fingerprint.encode())))

    def finish_step(self, step_id: str) -> None:
        """The step's summary was sent: keep its record only ``finished_ttl_seconds`` more."""
        self._writes.put_nowait(("expire", self._step_key(step_id), self.finished_ttl))

    def save_failure(self, step_id: str, field: str, message: str) -> None:
        """The step failed (``StepFailed``): a resume after a restart gets the same failure."""
        blob = json.dumps({"field": field, "message": message}).encode()
        key = self._step_key(step_id)
        self._writes.put_nowait(("hset", key, "failed", self._seal(key, "failed", blob)))

    def save_completion(self, key: str, completion: Completion, encoded: bytes | None = None) -> None:
        """``encoded``: ``completion`` as serialized ``pb.Completion`` bytes, when the caller has them."""
        if encoded is None:  # encoded once: the trainer's stream takes the same message (wire.completion_pb)
            encoded = completion_pb(completion, keep=True).SerializeToString()
        blob = encoded
        step_key = self._step_key(completion.step_id)
        self._writes.put_nowait(("hset", step_key, key, self._seal(step_key, key, blob)))

    async def _writer(self) -> None:
        """Write queued items in order, everything queued so far in one pipeline."""
        while True:
            await self._writes.wait()
            if self.batch_seconds > 0 and not self._flushing.is_set():  # let more writes join this one
                try:
                    await asyncio.wait_for(self._flushing.wait(), self.batch_seconds)
                except TimeoutError:
                    pass
            self._flushing.clear()  # everything queued so far goes now, flushes included
            batch = self._writes.take()
            writes = [item for item in batch if not isinstance(item, asyncio.Future)]
            try:
                if writes:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        _queue_writes(pipe, writes, self.ttl)
                        await pipe.execute()
            except Exception as exc:  # Redis down: lose resumability, never the service
                logger.warning("step journal write failed (%d items): %s", len(writes), type(exc).__name__)
            for item in batch:
                if isinstance(item, asyncio.Future) and not item.done():
                    item.set_result(None)

    # ------------------------------------------------------------------ reads --

    async def load_policy(self) -> tuple[int, str] | None:
        """(version, weights path) an earlier scheduler served, if its record is authentic."""
        key = self.prefix + "policy"
        try:
            raw = cast("bytes | None", await self.redis.get(key))  # no decode_responses: bytes
        except Exception as exc:
            logger.warning("step journal unreachable: %s", type(exc).__name__)
            return None
        if raw is None:
            return None
        record = self._open(key, "", raw)
        if record is None:
            self.reject("the policy record", "its MAC does not match (forged, or another journal_secret)")
            return None
        try:
            data = json.loads(record)
            version, path = data["version"], data["weights_path"]
            if type(version) is not int or version < 0 or not isinstance(path, str) or not path:
                raise ValueError("version or weights_path out of range")
        except (ValueError, KeyError, TypeError) as exc:
            self.reject("the policy record", f"undecodable: {type(exc).__name__}")
            return None
        return version, path

    async def load_step(self, step_id: str) -> tuple[str, dict[str, Completion]] | None:
        """(fingerprint, completions by request key) of a step an earlier scheduler ran.

        Only authentic, decodable records come back (each dropped one is counted and logged);
        the caller still checks each completion against the step (``check_replayed``)."""
        key = self._step_key(step_id)
        try:
            fields = cast("dict[bytes, bytes]", await self.redis.hgetall(key))
        except Exception as exc:
            logger.warning("step journal unreachable: %s", type(exc).__name__)
            return None
        if not fields:
            return None
        fingerprint = self._open(key, "fingerprint", fields.pop(b"fingerprint", b""))
        if fingerprint is None or not fingerprint.isascii():
            self.reject(f"step {step_id!r}", f"no authentic fingerprint; its {len(fields)} other records are ignored")
            return None
        fields.pop(b"failed", None)
        done = {}
        for name, blob in fields.items():
            try:
                field = name.decode()
            except UnicodeDecodeError:
                self.reject(f"a record of step {step_id!r}", "its field name is not UTF-8")
                continue
            payload = self._open(key, field, blob)
            if payload is None:
                self.reject(f"record {field!r:.80} of step {step_id!r}", "its MAC does not match")
                continue
            try:
                done[field] = cv.completion_from_pb(pb.Completion.FromString(payload))
            except (DecodeError, ValueError, TypeError) as exc:
                self.reject(f"record {field!r:.80} of step {step_id!r}", f"undecodable: {type(exc).__name__}")
        return fingerprint.decode(), done

    def reject(self, what: str, reason: str) -> None:
        """Count and log a journal record that is dropped instead of replayed."""
        self.rejected += 1
        logger.warning("step journal: dropped %s: %s", what, reason)

    async def check_eviction(self) -> None:
        """Warn when the journal's Redis may evict keys: a lost record costs resumability."""
        try:
            reply = await self.redis.config_get("maxmemory-policy")
        except Exception as exc:  # CONFIG may be disabled (managed Redis): nothing to check
            logger.info("step journal: cannot read the Redis eviction policy: %s", type(exc).__name__)
            return
        policy = next(iter(reply.values()), b"") if reply else b""
        policy = policy.decode(errors="replace") if isinstance(policy, bytes) else str(policy)
        if policy and policy != "noeviction":
            logger.warning("step journal: its Redis evicts keys (maxmemory-policy %s); journal records may be "
                           "lost under memory pressure: point journal_redis_url at a noeviction Redis", policy)

    async def load_failure(self, step_id: str) -> tuple[str, str] | None:
        """(field, message) of a step an earlier scheduler ended in failure, if it did."""
        try:
            raw = cast("bytes | None", await self.redis.hget(self._step_key(step_id), "failed"))
            if raw is None:
                return None
            record = self._open(self._step_key(step_id), "failed", raw)
            if record is None:
                self.reject(f"the failure record of step {step_id!r}", "its MAC does not match")
                return None
            data = json.loads(record)
            return str(data["field"]), str(data["message"])
        except (ValueError, KeyError, TypeError):
            logger.warning("step journal failure entry of %r is corrupt; ignoring it", step_id)
            return None
        except Exception as exc:
            logger.warning("step journal unreachable: %s", type(exc).__name__)
            return None

    def _step_key(self, step_id: str) -> str:
        return f"{self.prefix}step:{step_id}"

    # ------------------------------------------------------------------- MACs --

    def _mac(self, key: str, field: str, payload: bytes) -> bytes:
        if self._keyed is None:
            keyed = hmac.new(self._secret, _DOMAIN, hashlib.sha256)
            self._keyed = getattr(keyed, "_hmac", None) or keyed  # OpenSSL's own HMAC object where hmac wraps one
        mac = self._keyed.copy()  # the keyed state once, not per record
        k, f = key.encode(), field.encode()
        mac.update(b"".join((struct.pack(">Q", len(k)), k, struct.pack(">Q", len(f)), f,
                             struct.pack(">Q", len(payload)), payload)))
        return mac.digest()

    def _seal(self, key: str, field: str, payload: bytes) -> bytes:
        """``payload`` behind its MAC, bound to the Redis key and hash field it is stored under."""
        return self._mac(key, field, payload) + payload

    def _open(self, key: str, field: str, blob: bytes) -> bytes | None:
        """The payload of a sealed value, or None when its MAC does not match."""
        if len(blob) < MAC_BYTES:
            return None
        payload = blob[MAC_BYTES:]
        return payload if hmac.compare_digest(blob[:MAC_BYTES], self._mac(key, field, payload)) else None


def _queue_writes(pipe: Any, writes: list[tuple], ttl: int) -> None:
    """Queue ``writes`` on a pipeline in order, each run of consecutive hash writes as one HSET per
    key (all its fields) and one EXPIRE per key, instead of an HSET and an EXPIRE per field: a
    step's completions cost a few Redis commands per batch, not two each. Same result: a run holds
    only hash writes (a later value of a field wins, as it would), and a ``set`` or ``expire``
    between them keeps its place (an ``expire`` to the finished TTL is not undone by the run's)."""
    run: dict[str, dict[str, bytes]] = {}

    def flush() -> None:
        for key, fields in run.items():
            pipe.hset(key, mapping=fields)
            pipe.expire(key, ttl)
        run.clear()

    for item in writes:
        if item[0] == "hset":
            run.setdefault(item[1], {})[item[2]] = item[3]
            continue
        flush()
        if item[0] == "set":
            pipe.set(item[1], item[2], ex=ttl)
        else:
            pipe.expire(item[1], item[2])
    flush()
